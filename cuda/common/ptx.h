// Device helpers around sm_80-level PTX: tensor-core MMA, ldmatrix, cp.async,
// fast exp2, warp reductions and 16-bit packing. Shared by every mma.sync
// kernel; Hopper-only instructions (wgmma, TMA) live in their own header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jaxattn::ptx {

// Shared-memory address of a generic pointer, as the 32-bit value PTX wants.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// D += A * B for one m16n8k16 tile; A row-major 16x16, B col-major 16x8, f32 acc.
template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// x, hidden from the optimiser (no value derived from it is hoisted out of a loop).
__device__ __forceinline__ int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// 32-bit store to / 64-bit and 128-bit loads from a shared-memory address.
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 ld_shared_u32x4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// Four 8x8 b16 matrices from shared memory; lane l gives the row address of matrix l/8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// As ldmatrix_x4, each 8x8 matrix transposed on the way.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Asynchronous 16-byte global->shared copy (L2 only); writes zeros when !valid.
__device__ __forceinline__ void cp_async_16(uint32_t smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(src_bytes));
}

// 16-byte global load for data read once (non-coherent path, no L1 line
// allocated); zeros when !valid (the address is then not read). kL2Line: a miss
// fetches the whole 128-byte line into L2 (.L2::128B), for loads that read half
// a line each.
template <bool kL2Line = false>
__device__ __forceinline__ uint4 ldg_stream_16(const void* gmem, bool valid) {
  uint4 v;
#define JAXATTN_LDG_STREAM_16(PREFETCH_SIZE)                                                  \
  asm volatile(                                                                              \
      "{\n"                                                                                  \
      ".reg .pred p;\n"                                                                      \
      "setp.ne.b32 p, %5, 0;\n"                                                              \
      "mov.b32 %0, 0;\nmov.b32 %1, 0;\nmov.b32 %2, 0;\nmov.b32 %3, 0;\n"                     \
      "@p ld.global.nc.L1::no_allocate" PREFETCH_SIZE ".v4.u32 {%0,%1,%2,%3}, [%4];\n"       \
      "}\n"                                                                                  \
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                                           \
      : "l"(gmem), "r"(int(valid)))
  if constexpr (kL2Line) {
    JAXATTN_LDG_STREAM_16(".L2::128B");
  } else {
    JAXATTN_LDG_STREAM_16("");
  }
#undef JAXATTN_LDG_STREAM_16
  return v;
}

// A 32-bit load cached in L2 only (ld.global.cg): it leaves no line in this SM's L1
// that a later ordinary load of the same address could return stale.
__device__ __forceinline__ int32_t ldg_l2_only_s32(const int32_t* gmem) {
  int32_t v;
  asm volatile("ld.global.cg.s32 %0, [%1];\n" : "=r"(v) : "l"(gmem));
  return v;
}

// Fetches the 128-byte line holding `gmem` into L2 (no register written,
// nothing to wait for).
__device__ __forceinline__ void prefetch_l2(const void* gmem) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(gmem));
}

// Transpose of an 8x8 matrix of 16-bit elements held across the warp (thread
// 4 g + t holds row g, columns 2t and 2t + 1): returns row g of the transpose.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// Programmatic dependent launch (sm_90+; no-ops before, and when the grid
// was launched without the programmatic-serialization attribute):
// griddep_wait blocks until the grids this one depends on have completed and
// their memory is visible; griddep_launch_dependents lets the next grid in
// the stream launch once every CTA of this one has called it (or exited).
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Nanoseconds of the GPU's global timer (profiling builds only).
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// Closes the current group of cp.async copies.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most N committed cp.async groups of this thread are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 2^x with the MUFU unit (flushes denormals; exp2(-inf) = 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Barrier `id` (1..15; 0 is __syncthreads) among `threads` threads (a multiple
// of 32), ordering their shared-memory accesses.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Max over the 4 lanes of a quad (lanes 4i..4i+3), result in all of them.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Sum over the 4 lanes of a quad, result in all of them.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Max / sum over the 8 lanes that share lane % 4 (the rows of an mma fragment
// column: lanes t, t + 4, ..., t + 28), result in all of them.
__device__ __forceinline__ float column_max(float x) {
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float column_sum(float x) {
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Sum over the 32 lanes of a warp, result in all of them.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Two floats rounded to a packed 16-bit pair (lo in the low half), as MMA operands want.
template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// The two floats of a packed 16-bit pair (lo, hi).
template <typename Elem>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
    return __bfloat1622float2(h);
  } else {
    __half2 h = *reinterpret_cast<__half2*>(&v);
    return __half22float2(h);
  }
}

// Fire-and-forget f32 atomic add to global memory.
__device__ __forceinline__ void red_add_f32(float* addr, float v) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(v) : "memory");
}

// Fire-and-forget f32 atomic add to two adjacent floats (8-byte aligned): one
// vector reduction on sm_90+, two scalar ones before.
__device__ __forceinline__ void red_add_f32x2(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
#else
  red_add_f32(addr, a);
  red_add_f32(addr + 1, b);
#endif
}

// Fire-and-forget f32 atomic add to four adjacent floats (16-byte aligned): one
// vector reduction on sm_90+, two 8-byte ones before.
__device__ __forceinline__ void red_add_f32x4(float* addr, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#else
  red_add_f32x2(addr, a, b);
  red_add_f32x2(addr + 2, c, d);
#endif
}

// One m16n8 f32 accumulator fragment of lane (g, t) (c0, c1: row g, columns 2t, 2t + 1;
// c2, c3: row g + 8, same columns) added to global memory with one 16-byte reduction
// per lane: lanes t and t ^ 1 swap halves, so an even lane adds row g, columns
// 2t .. 2t + 3 and an odd one row g + 8, columns 2t - 2 .. 2t + 1. lo / hi: rows g and
// g + 8 at the fragment's first column (16-byte aligned); add_lo / add_hi: whether
// they are added. Every lane of the warp calls it (shuffles).
__device__ __forceinline__ void red_add_frag_f32x4(float* lo, float* hi, bool add_lo, bool add_hi, int t, float c0,
                                                   float c1, float c2, float c3) {
  const bool odd = t & 1;
  const float r0 = __shfl_xor_sync(0xffffffffu, odd ? c0 : c2, 1);
  const float r1 = __shfl_xor_sync(0xffffffffu, odd ? c1 : c3, 1);
  const int col = 2 * (t & 2);
  if (odd) {
    if (add_hi) red_add_f32x4(hi + col, r0, r1, c2, c3);
  } else if (add_lo) {
    red_add_f32x4(lo + col, c0, c1, r0, r1);
  }
}

// Spins until the int32 counter at `addr` (global) reaches `target`; acquire at GPU scope,
// so what the releasing threads wrote before their increment is visible after.
__device__ __forceinline__ void wait_counter_geq(const int32_t* addr, int32_t target) {
  int32_t v;
  while (true) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(addr) : "memory");
    if (v >= target) break;
    __nanosleep(32);
  }
}

// Adds 1 to the int32 counter at `addr` (global) with release semantics at GPU scope.
__device__ __forceinline__ void release_counter_inc(int32_t* addr) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(addr) : "memory");
}

}  // namespace jaxattn::ptx
