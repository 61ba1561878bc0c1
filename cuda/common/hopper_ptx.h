// Device helpers around Hopper-only PTX (sm_90a): warpgroup MMA (wgmma), shared
// memory matrix descriptors, mbarriers, bulk tensor copies (TMA), proxy fences,
// register reallocation (setmaxnreg) and named barriers. Used by cuda/sm90/;
// the sm_80-level helpers live in common/ptx.h.
//
// Conventions: shared-memory addresses are 32-bit (`smem_addr` in ptx.h gives
// one from a generic pointer); tensor maps are passed by generic address of a
// __grid_constant__ kernel parameter.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jaxattn::hptx {

// ---- warpgroup MMA: ordering ----------------------------------------------

// Orders earlier register writes (accumulators, A fragments) before the next wgmma.mma_async.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the group of wgmma.mma_async issued since the last commit.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warp are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins a register across an async wgmma: the compiler may not move its uses past this point.
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void reg_fence(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
// reg_fence on every element of a register array.
template <typename T, int N>
__device__ __forceinline__ void reg_fence_array(T (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(a[i]);
}

// ---- shared memory matrix descriptors ---------------------------------------

// wgmma descriptor of a 128B-swizzled tile at smem byte address `addr` (1024-aligned atom
// pattern; a k-step inside the atom just adds bytes to addr). K-major: lbo unused (pass 16),
// sbo = 1024 (8 rows x 128 B). MN-major: lbo = bytes between 64-element MN atoms, sbo = 1024
// (between groups of 8 K rows).
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32;
  d |= 1ull << 62;  // swizzle mode 1 = 128B; base offset 0
  return d;
}

// Descriptors of one tile at byte offsets inside it. kAdd = false: each is built from
// its address (make_desc_sw128: ~5 dependent uniform instructions before every HGMMA);
// kAdd = true: the tile's descriptor plus (offset >> 4) in the low word, one 32-bit add
// (the start-address field, (addr & 0x3FFFF) >> 4 in 14 bits, never carries for offsets
// inside shared memory). Which kernels take which is a measured choice
// (FwdTraits::desc_add, BwdTraits::desc_add): neither wins everywhere on the H200.
template <bool kAdd>
struct TileDesc {
  uint32_t addr, lbo, sbo;
  uint64_t desc;
  __device__ __forceinline__ TileDesc(uint32_t a, uint32_t lbo_bytes, uint32_t sbo_bytes)
      : addr(a), lbo(lbo_bytes), sbo(sbo_bytes), desc(make_desc_sw128(a, lbo_bytes, sbo_bytes)) {}
  __device__ __forceinline__ uint64_t at(uint32_t byte_offset) const {
    if constexpr (kAdd) {
      const uint32_t lo = static_cast<uint32_t>(desc) + (byte_offset >> 4);
      return (desc & 0xFFFFFFFF00000000ull) | lo;
    } else {
      return make_desc_sw128(addr + byte_offset, lbo, sbo);
    }
  }
};

// ---- warpgroup MMA: instructions (f32 accumulate, bf16 or fp16 inputs) --------
// Accumulator layout (per warp w of the warpgroup, lane = 4 g + t): d[4 j + 2 h + e] is row
// 16 w + g + 8 h, column 8 j + 2 t + e. kTransA / kTransB = 0: the operand is K-major (its
// rows of K contiguous); 1: MN-major (K rows of M / N contiguous). A from registers is
// always the mma.sync A fragment layout (4 x 16-bit pairs per k16 step).

// One wgmma per accumulator width N (R = N / 2 f32 registers per thread). Inline asm
// needs its operand list and the matching "%0,...,%R-1" text spelled out, so both are
// built here from pieces of 8 registers; the instruction's other operands follow the
// accumulators (numbers R, R + 1, ... passed explicitly: the preprocessor cannot add).
#define JAXATTN_REG8_0 "%0,%1,%2,%3,%4,%5,%6,%7"
#define JAXATTN_REG8_1 "%8,%9,%10,%11,%12,%13,%14,%15"
#define JAXATTN_REG8_2 "%16,%17,%18,%19,%20,%21,%22,%23"
#define JAXATTN_REG8_3 "%24,%25,%26,%27,%28,%29,%30,%31"
#define JAXATTN_REG8_4 "%32,%33,%34,%35,%36,%37,%38,%39"
#define JAXATTN_REG8_5 "%40,%41,%42,%43,%44,%45,%46,%47"
#define JAXATTN_REG8_6 "%48,%49,%50,%51,%52,%53,%54,%55"
#define JAXATTN_REG8_7 "%56,%57,%58,%59,%60,%61,%62,%63"
#define JAXATTN_REG8_8 "%64,%65,%66,%67,%68,%69,%70,%71"
#define JAXATTN_REG8_9 "%72,%73,%74,%75,%76,%77,%78,%79"
#define JAXATTN_REG8_10 "%80,%81,%82,%83,%84,%85,%86,%87"
#define JAXATTN_REG8_11 "%88,%89,%90,%91,%92,%93,%94,%95"
#define JAXATTN_REG8_12 "%96,%97,%98,%99,%100,%101,%102,%103"
#define JAXATTN_REG8_13 "%104,%105,%106,%107,%108,%109,%110,%111"
#define JAXATTN_REG8_14 "%112,%113,%114,%115,%116,%117,%118,%119"
#define JAXATTN_REG8_15 "%120,%121,%122,%123,%124,%125,%126,%127"
#define JAXATTN_REGS16 JAXATTN_REG8_0 "," JAXATTN_REG8_1
#define JAXATTN_REGS32 JAXATTN_REGS16 "," JAXATTN_REG8_2 "," JAXATTN_REG8_3
#define JAXATTN_REGS40 JAXATTN_REGS32 "," JAXATTN_REG8_4
#define JAXATTN_REGS64 JAXATTN_REGS32 "," JAXATTN_REG8_4 "," JAXATTN_REG8_5 "," JAXATTN_REG8_6 "," JAXATTN_REG8_7
#define JAXATTN_REGS80 JAXATTN_REGS64 "," JAXATTN_REG8_8 "," JAXATTN_REG8_9
#define JAXATTN_REGS88 JAXATTN_REGS80 "," JAXATTN_REG8_10
#define JAXATTN_REGS128 JAXATTN_REGS64 "," JAXATTN_REG8_8 "," JAXATTN_REG8_9 "," JAXATTN_REG8_10 "," JAXATTN_REG8_11 "," JAXATTN_REG8_12 "," JAXATTN_REG8_13 "," JAXATTN_REG8_14 "," JAXATTN_REG8_15
#define JAXATTN_ACC8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define JAXATTN_ACC16 JAXATTN_ACC8(0), JAXATTN_ACC8(8)
#define JAXATTN_ACC32 JAXATTN_ACC16, JAXATTN_ACC8(16), JAXATTN_ACC8(24)
#define JAXATTN_ACC40 JAXATTN_ACC32, JAXATTN_ACC8(32)
#define JAXATTN_ACC64 JAXATTN_ACC32, JAXATTN_ACC8(32), JAXATTN_ACC8(40), JAXATTN_ACC8(48), JAXATTN_ACC8(56)
#define JAXATTN_ACC80 JAXATTN_ACC64, JAXATTN_ACC8(64), JAXATTN_ACC8(72)
#define JAXATTN_ACC88 JAXATTN_ACC80, JAXATTN_ACC8(80)
#define JAXATTN_ACC128 JAXATTN_ACC64, JAXATTN_ACC8(64), JAXATTN_ACC8(72), JAXATTN_ACC8(80), JAXATTN_ACC8(88), JAXATTN_ACC8(96), JAXATTN_ACC8(104), JAXATTN_ACC8(112), JAXATTN_ACC8(120)

// D(64xN, f32) (+)= A(64x16, smem desc) * B(16xN, smem desc); scale_d = 0 overwrites D.
// Operands: accumulators, desc_a = %R0, desc_b = %R1, scale_d = %R2, kTransA = %R3, kTransB = %R4.
#define JAXATTN_WGMMA_SS_ASM(TY, N, REGS, ACC, R0, R1, R2, R3, R4)                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #R2 ", 0;\n"                                         \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "                             \
               "{" REGS "}, %" #R0 ", %" #R1 ", p, 1, 1, %" #R3 ", %" #R4 ";\n}\n"                        \
               : ACC                                                                                      \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB))
#define JAXATTN_DEFINE_WGMMA_SS(N, R, R0, R1, R2, R3, R4)                                                 \
  template <typename Elem, int kTransA, int kTransB>                                                      \
  __device__ __forceinline__ void wgmma_ss_m64n##N##k16(float(&d)[R], uint64_t desc_a, uint64_t desc_b,    \
                                                        int scale_d) {                                    \
    if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {                                                 \
      JAXATTN_WGMMA_SS_ASM("bf16", N, JAXATTN_REGS##R, JAXATTN_ACC##R, R0, R1, R2, R3, R4);              \
    } else {                                                                                             \
      JAXATTN_WGMMA_SS_ASM("f16", N, JAXATTN_REGS##R, JAXATTN_ACC##R, R0, R1, R2, R3, R4);               \
    }                                                                                                     \
  }

// D(64xN, f32) (+)= A(64x16, registers) * B(16xN, smem desc).
// Operands: accumulators, a[0..3] = %R0..%R0+3, desc_b = %R4, scale_d = %R5, kTransB = %R6.
#define JAXATTN_WGMMA_RS_ASM(TY, N, REGS, ACC, R0, R1, R2, R3, R4, R5, R6)                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #R5 ", 0;\n"                                         \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "                             \
               "{" REGS "}, {%" #R0 ",%" #R1 ",%" #R2 ",%" #R3 "}, %" #R4 ", p, 1, 1, %" #R6 ";\n}\n"       \
               : ACC                                                                                      \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB))
#define JAXATTN_DEFINE_WGMMA_RS(N, R, R0, R1, R2, R3, R4, R5, R6)                                         \
  template <typename Elem, int kTransB>                                                                   \
  __device__ __forceinline__ void wgmma_rs_m64n##N##k16(float(&d)[R], const uint32_t(&a)[4], uint64_t desc_b, \
                                                        int scale_d) {                                    \
    if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {                                                 \
      JAXATTN_WGMMA_RS_ASM("bf16", N, JAXATTN_REGS##R, JAXATTN_ACC##R, R0, R1, R2, R3, R4, R5, R6);      \
    } else {                                                                                             \
      JAXATTN_WGMMA_RS_ASM("f16", N, JAXATTN_REGS##R, JAXATTN_ACC##R, R0, R1, R2, R3, R4, R5, R6);       \
    }                                                                                                     \
  }

JAXATTN_DEFINE_WGMMA_SS(32, 16, 16, 17, 18, 19, 20)
JAXATTN_DEFINE_WGMMA_SS(64, 32, 32, 33, 34, 35, 36)
JAXATTN_DEFINE_WGMMA_SS(80, 40, 40, 41, 42, 43, 44)
JAXATTN_DEFINE_WGMMA_SS(128, 64, 64, 65, 66, 67, 68)
JAXATTN_DEFINE_WGMMA_SS(160, 80, 80, 81, 82, 83, 84)
JAXATTN_DEFINE_WGMMA_SS(176, 88, 88, 89, 90, 91, 92)
JAXATTN_DEFINE_WGMMA_SS(256, 128, 128, 129, 130, 131, 132)
JAXATTN_DEFINE_WGMMA_RS(32, 16, 16, 17, 18, 19, 20, 21, 22)
JAXATTN_DEFINE_WGMMA_RS(64, 32, 32, 33, 34, 35, 36, 37, 38)
JAXATTN_DEFINE_WGMMA_RS(128, 64, 64, 65, 66, 67, 68, 69, 70)
JAXATTN_DEFINE_WGMMA_RS(256, 128, 128, 129, 130, 131, 132, 133, 134)
#undef JAXATTN_DEFINE_WGMMA_SS
#undef JAXATTN_DEFINE_WGMMA_RS
#undef JAXATTN_WGMMA_SS_ASM
#undef JAXATTN_WGMMA_RS_ASM
#undef JAXATTN_ACC8
#undef JAXATTN_REGS16
#undef JAXATTN_ACC16
#undef JAXATTN_REGS32
#undef JAXATTN_ACC32
#undef JAXATTN_REGS40
#undef JAXATTN_ACC40
#undef JAXATTN_REGS64
#undef JAXATTN_ACC64
#undef JAXATTN_REGS80
#undef JAXATTN_ACC80
#undef JAXATTN_REGS88
#undef JAXATTN_ACC88
#undef JAXATTN_REGS128
#undef JAXATTN_ACC128
#undef JAXATTN_REG8_0
#undef JAXATTN_REG8_1
#undef JAXATTN_REG8_2
#undef JAXATTN_REG8_3
#undef JAXATTN_REG8_4
#undef JAXATTN_REG8_5
#undef JAXATTN_REG8_6
#undef JAXATTN_REG8_7
#undef JAXATTN_REG8_8
#undef JAXATTN_REG8_9
#undef JAXATTN_REG8_10
#undef JAXATTN_REG8_11
#undef JAXATTN_REG8_12
#undef JAXATTN_REG8_13
#undef JAXATTN_REG8_14
#undef JAXATTN_REG8_15

// wgmma_ss_m64n{N}k16 for N = 32, 64, 80, 128, 160, 176 or 256, with either operand's major-ness.
template <typename Elem, int N, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss_t(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(N == 32 || N == 64 || N == 80 || N == 128 || N == 160 || N == 176 || N == 256, "wgmma N");
  if constexpr (N == 32) wgmma_ss_m64n32k16<Elem, kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 64) wgmma_ss_m64n64k16<Elem, kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 80) wgmma_ss_m64n80k16<Elem, kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 128) wgmma_ss_m64n128k16<Elem, kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 160) wgmma_ss_m64n160k16<Elem, kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  else if constexpr (N == 176) wgmma_ss_m64n176k16<Elem, kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  else wgmma_ss_m64n256k16<Elem, kTransA, kTransB>(d, desc_a, desc_b, scale_d);
}
// wgmma_ss_t with a K-major A (the common case).
template <typename Elem, int N, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  wgmma_ss_t<Elem, N, 0, kTransB>(d, desc_a, desc_b, scale_d);
}
// wgmma_rs_m64n{N}k16 for N = 32, 64, 128 or 256.
template <typename Elem, int N, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  static_assert(N == 32 || N == 64 || N == 128 || N == 256, "wgmma N");
  if constexpr (N == 32) wgmma_rs_m64n32k16<Elem, kTransB>(d, a, desc_b, scale_d);
  else if constexpr (N == 64) wgmma_rs_m64n64k16<Elem, kTransB>(d, a, desc_b, scale_d);
  else if constexpr (N == 128) wgmma_rs_m64n128k16<Elem, kTransB>(d, a, desc_b, scale_d);
  else wgmma_rs_m64n256k16<Elem, kTransB>(d, a, desc_b, scale_d);
}

// ---- mbarrier -------------------------------------------------------------

// Initialises the mbarrier at `bar` to expect `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes mbarrier initialisations visible to the async proxy (TMA) and other threads.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// Arrives once and adds `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrives once (release semantics at CTA scope).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Spins until the phase with parity `parity` of the mbarrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_AGAIN:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_AGAIN;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- bulk tensor copies (TMA) ------------------------------------------------

// 5D tiled load global -> shared (box of the tensor map at coordinates c0..c4, innermost
// first); completes `bytes` of transactions on the mbarrier `bar`. Out-of-range elements read 0.
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(dst),
      "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}
// 4D tiled load global -> shared, as tma_load_5d.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// L2 eviction priority policies for the .L2::cache_hint forms (a 64-bit operand made by
// createpolicy; fraction 1.0: every line the access touches). evict_last: data other
// CTAs will touch again soon; evict_first: data read once.
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
// tma_load_5d with an L2 policy.
__device__ __forceinline__ void tma_load_5d_hint(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                                 int c2, int c3, int c4, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2], %8;\n" ::"r"(dst),
      "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "l"(policy)
      : "memory");
}
// 5D tiled store shared -> global (elements out of the tensor's range are not written).
__device__ __forceinline__ void tma_store_5d(const void* tmap, uint32_t src, int c0, int c1, int c2, int c3,
                                             int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group"
      " [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(tmap),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}
// 5D tiled reduce-add shared -> global: global += the box at c0..c4, element type and
// layout from the tensor map (f32 for the dQ accumulator); out-of-range elements are skipped.
__device__ __forceinline__ void tma_reduce_add_5d(const void* tmap, uint32_t src, int c0, int c1, int c2, int c3,
                                                  int c4) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.5d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(tmap),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}
// tma_reduce_add_5d with an L2 policy.
__device__ __forceinline__ void tma_reduce_add_5d_hint(const void* tmap, uint32_t src, int c0, int c1, int c2,
                                                       int c3, int c4, uint64_t policy) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.5d.global.shared::cta.add.tile.bulk_group.L2::cache_hint"
      " [%0, {%2, %3, %4, %5, %6}], [%1], %7;\n" ::"l"(tmap),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "l"(policy)
      : "memory");
}
// Contiguous bulk copy global -> shared of `bytes` (a multiple of 16; both addresses
// 16-byte aligned), no tensor map; completes `bytes` of transactions on the mbarrier
// `bar`. (sm_90; tests/cuda/stream_probe.cu's bulk ring: one copy per 256-byte key row
// streamed at half the read bandwidth, perf.md session 18 run 1.)
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// Orders this thread's async-proxy (TMA) global accesses with its generic-proxy ones.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// Closes the current group of bulk stores.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until the bulk store groups of this thread have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until the bulk store groups of this thread are complete (written to global).
__device__ __forceinline__ void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Orders this thread's ordinary shared-memory writes before later async-proxy (TMA/wgmma) reads.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Brings the tensor map (a kernel parameter) into the descriptor cache ahead of first use.
__device__ __forceinline__ void prefetch_tmap(const void* tmap) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tmap) : "memory");
}

// ---- registers and barriers ----------------------------------------------------

// Raises this warpgroup's per-thread register limit to N (the warps wait for free registers).
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
// Lowers this warpgroup's per-thread register limit to N, releasing the rest.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
// Named barrier `id` (1..15; 0 is __syncthreads) over `nthreads` threads (multiple of 32).
__device__ __forceinline__ void named_bar_sync(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}
// Arrives at named barrier `id` without waiting (the producer side of a bar.sync).
__device__ __forceinline__ void named_bar_arrive(int id, int nthreads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

}  // namespace jaxattn::hptx
