// The one Python extension: exports every XLA FFI handler as a capsule.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cpu/decode_handler.h"
#include "cpu/parallel_for.h"
#include "cpu_handlers.h"
#ifdef JAXATTN_WITH_CUDA
#include "common/device.h"
#include "cuda_decode_handler.h"
#include "cuda_handlers.h"
#include "decode/launch_decode.h"
#include "launch.h"
#endif

namespace nb = nanobind;

template <typename T>
static nb::capsule capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

#ifdef JAXATTN_WITH_SM90
// Params of a call with contiguous tensors at an aligned stand-in address: what the
// dispatch rules see for XLA's buffers (only sizes, strides and alignment matter).
// `masks`: the call's mask options, 0 = none, 1 = structured (window, lengths,
// segments, soft cap; the stand-in marks them with lengths), 2 = a dense bias or
// mask too (marked with a mask).
static jaxattn::AttnParams stand_in_params(int batch, int seqlen_q, int seqlen_k, int num_heads, int num_heads_k,
                                           int head_dim, bool half_precision, bool deterministic, int masks) {
  jaxattn::AttnParams p;
  p.batch = batch, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.num_heads = num_heads, p.num_heads_k = num_heads_k, p.head_dim = head_dim;
  p.dtype = half_precision ? jaxattn::DType::kBF16 : jaxattn::DType::kF32;
  jaxattn::set_contiguous_strides(p);
  alignas(256) static char stand_in[256];
  p.q = p.k = p.v = p.dout = stand_in;
  p.o = stand_in;
  p.dq = p.dk = p.dv = stand_in;
  p.lse = p.dq_accum = p.dpsum = reinterpret_cast<float*>(stand_in);
  p.deterministic = deterministic;
  p.dq_semaphore = reinterpret_cast<int32_t*>(stand_in);
  if (masks >= 1) p.q_lengths = p.kv_lengths = reinterpret_cast<int32_t*>(stand_in);
  if (masks >= 2) p.mask = reinterpret_cast<const bool*>(stand_in);
  return p;
}
#endif

NB_MODULE(_jaxattn, m) {
  m.doc() = "jaxattn's XLA FFI handlers";
  m.def("cpu_targets", []() {
    nb::dict d;
    d["jaxattn_cpu_fwd"] = capsule(JaxattnCpuFwd);
    d["jaxattn_cpu_bwd"] = capsule(JaxattnCpuBwd);
    d["jaxattn_cpu_decode"] = capsule(JaxattnCpuDecode);
    return d;
  });
  // Worker threads the CPU kernels start for a large call (JAXATTN_CPU_THREADS,
  // else the CPUs of this thread's affinity mask).
  m.def("cpu_threads", []() { return jaxattn::cpu::num_threads(); });
  m.def("cuda_targets", []() {
    nb::dict d;
#ifdef JAXATTN_WITH_SM90
    jaxattn::cuda::sm90_prepare();
#endif
#ifdef JAXATTN_WITH_CUDA
    d["jaxattn_cuda_fwd"] = capsule(JaxattnCudaFwd);
    d["jaxattn_cuda_bwd"] = capsule(JaxattnCudaBwd);
    d["jaxattn_cuda_decode"] = capsule(JaxattnCudaDecode);
#endif
    return d;
  });
  // The CUDA forward's dispatch rule, asked from Python (jaxattn.kernel_for) so
  // that the rule exists once. Buffers are described as XLA hands them over:
  // contiguous, 64-byte aligned (the addresses below are stand-ins).
  // Which CUDA kernel each pass uses for a call of these sizes on a device of this
  // compute capability (contiguous, aligned tensors, as XLA gives them): "sm90" or "sm80".
  // `masks`: 0 = no mask option, 1 = window / lengths / segments / soft cap only,
  // 2 = a dense bias or mask (stand_in_params).
  m.def("cuda_forward_kernel", [](int batch, int seqlen_q, int seqlen_k, int num_heads, int num_heads_k,
                                  int head_dim, bool half_precision, int masks, int cc_major,
                                  int cc_minor) -> std::string {
#ifdef JAXATTN_WITH_SM90
    const jaxattn::AttnParams p = stand_in_params(batch, seqlen_q, seqlen_k, num_heads, num_heads_k, head_dim,
                                                  half_precision, false, masks);
    if (jaxattn::cuda::fwd_on_sm90(p, cc_major, cc_minor)) return "sm90";
#else
    (void)masks;
#endif
    return "sm80";
  });
  m.def("cuda_backward_kernel", [](int batch, int seqlen_q, int seqlen_k, int num_heads, int num_heads_k,
                                   int head_dim, bool half_precision, bool deterministic, int masks, int cc_major,
                                   int cc_minor) -> std::string {
#ifdef JAXATTN_WITH_SM90
    const jaxattn::AttnParams p = stand_in_params(batch, seqlen_q, seqlen_k, num_heads, num_heads_k, head_dim,
                                                  half_precision, deterministic, masks);
    if (jaxattn::cuda::bwd_on_sm90(p, cc_major, cc_minor)) return "sm90";
#else
    (void)masks;
#endif
    return "sm80";
  });
  // Rows per unit of the Hopper backward's tail-split workspace, 0 when the Hopper kernels
  // are not built (jaxattn/_ffi_calls.py sizes that workspace with it).
  m.def("cuda_bwd_tail_rows", []() -> int {
#ifdef JAXATTN_WITH_SM90
    return jaxattn::cuda::sm90_bwd_tail_rows();
#else
    return 0;
#endif
  });
#ifdef JAXATTN_WITH_CUDA
  // Splits the CUDA decode kernels' workspace must hold for a row capacity and
  // a forced chunk (0 = none) (jaxattn/decode.py sizes the workspace outputs with it).
  m.def("cuda_decode_max_splits",
        [](int capacity, int forced_chunk) { return jaxattn::cuda::decode_max_splits(capacity, forced_chunk); });
  m.attr("cuda_decode_max_forced_chunk") = jaxattn::cuda::kDecodeMaxForcedChunk;
  m.attr("cuda_decode_variant_end") = jaxattn::cuda::kV2VariantEnd;  // version 2's loader bits lie below it
  // The current CUDA device's peak DRAM bandwidth (GB/s, memory clock x bus width; 0 if not
  // reported) as the decode launcher reads it: version 2 runs its register loop by default
  // at cuda_decode_regs_min_gbs and above (cuda/decode/launch_decode.h; benchmarks and tests).
  m.def("cuda_device_peak_dram_gbs", []() { return jaxattn::cuda::device_peak_dram_gbs(); });
  m.attr("cuda_decode_regs_min_gbs") = jaxattn::cuda::kRegsMinPeakGBs;
#ifdef JAXATTN_DECODE_TIMELINE
  // Profiling builds only (CUDAFLAGS / CXXFLAGS -DJAXATTN_DECODE_TIMELINE;
  // scripts/decode_jax_probe.py --timeline): where decode_mma_kernel writes its
  // per-CTA phase stamps (device addresses of two zeroed arrays; 0 = off).
  m.def("decode_timeline_set", [](uintptr_t buf, uintptr_t calls, int max_calls, int ctas) {
    const cudaError_t e = jaxattn::cuda::decode_timeline_set(reinterpret_cast<unsigned long long*>(buf),
                                                             reinterpret_cast<unsigned*>(calls), max_calls, ctas);
    if (e != cudaSuccess) throw std::runtime_error(std::string("decode_timeline_set: ") + cudaGetErrorName(e));
  });
#endif
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
