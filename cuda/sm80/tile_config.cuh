// Tile shapes of the sm80 (mma.sync) kernels, per padded head dim.
//
// Every shared-memory tile is row-major with rows of kHeadDim + 8 elements:
// the 16-byte pad makes the 8 row addresses of one ldmatrix phase land in 8
// different 16-byte bank groups (row pitch = 16 mod 128 bytes or an odd
// multiple of 16), so ldmatrix, cp.async and the epilogue stores are free of
// bank conflicts without a swizzle.
#pragma once

namespace jaxattn::cuda::sm80 {

// The head dims that have kernels; others (multiples of 8) run on the next one.
inline int padded_head_dim(int h) {
  if (h <= 32) return 32;
  if (h <= 64) return 64;
  if (h <= 96) return 96;
  if (h <= 128) return 128;
  if (h <= 192) return 192;
  return 256;
}

// Forward: one CTA per (query block, query head, batch). Each warp owns
// kMTiles*16 query rows (Q in shared memory, O and S in registers); the CTA
// streams K/V blocks of kBlockN keys, V(j) loading during S = Q K(j)^T and
// K(j-1) loading during softmax and O += P V(j).
template <int kHeadDim_, int kBlockN_, int kWarps_, int kMTiles_, int kMinBlocks_,
          int kBlockNSm100_ = kBlockN_, int kBlockNMasked_ = kBlockNSm100_, int kBlockNDense_ = kBlockNMasked_,
          int kKVStages_ = 1, bool kPipelineS_ = false>
struct FwdTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  // ptxas for sm_100 needs a few more registers than for sm_80/90; where
  // kBlockN would spill there, its device code streams kBlockNSm100 keys a
  // step instead (same kernel symbol; smem sized for the larger).
  static constexpr int kBlockNSm100 = kBlockNSm100_;
  // The masked kernels (mask state, segment ids) stream kBlockNMasked keys a
  // step on every target (no larger than the others: no spills there either).
  static constexpr int kBlockNMasked = kBlockNMasked_;
  // ... and those with a dense bias or mask kBlockNDense (their reads need
  // registers too).
  static constexpr int kBlockNDense = kBlockNDense_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kMTiles = kMTiles_;
  static constexpr int kMinBlocks = kMinBlocks_;  // CTAs per SM the registers allow
  // K/V buffers: 1 = one K and one V tile (V(j) loads during S = Q K(j)^T,
  // K(j-1) during softmax and P V(j); two barriers a step); 2 = two of each
  // (K(j-1) and V(j-1) load during the whole step j; one barrier a step).
  static constexpr int kKVStages = kKVStages_ > 1 || kPipelineS_ ? 2 : 1;
  // kPipelineS (unmasked kernels; implies kKVStages = 2): S = Q K(j-1)^T is
  // computed before the softmax and P V of block j, so the tensor cores have
  // work while the warp does the softmax (a second S tile in registers).
  static constexpr bool kPipelineS = kPipelineS_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = kWarps * 16 * kMTiles;
  static constexpr int kPitch = kHeadDim + 8;  // smem row, elements
  static constexpr int kSmemQ = kBlockM * kPitch;
  static constexpr int kSmemKV = (kBlockN > kBlockNSm100 ? kBlockN : kBlockNSm100) * kPitch;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kKVStages * kSmemKV) * 2;
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0 && kBlockNSm100 % 16 == 0 && kBlockNMasked % 16 == 0 &&
                    kBlockNMasked <= kBlockNSm100 && kBlockNMasked <= kBlockN && kBlockNDense % 16 == 0 &&
                    kBlockNDense <= kBlockNMasked && (kKVStages == 1 || kKVStages == 2),
                "tile shape");
};

// Why these shapes (registers per thread: O = kMTiles*kHeadDim/2,
// S = kMTiles*kBlockN/2): 32 query rows per warp halve the K/V shared-memory
// reads per MMA against 16 rows, which matters because mma.sync kernels on
// Hopper are close to shared-memory bound (measured on H200, H = 128:
// 4 warps x 32 rows 330 TFLOP/s; 8 warps x 16 rows 261-265; 4 warps x 16
// rows, 3 CTAs/SM 316). With 32 rows, O + S (+ softmax state) must fit 255
// registers on sm_80/90/100 alike: kBlockN = 64 spills for H = 96/128 (O
// 96/128 + S 64); H = 128 takes 48 keys a step (351 TFLOP/s against 338 for
// 32; 48 spills on sm_100, which takes 32), H = 96 takes 32, and H = 64 takes
// 64 (96 and 128 spill on some targets).
// For H = 192/256 the O accumulator alone is 96/128 registers, so warps own 16
// rows and the CTA has 8 warps. Two CTAs per SM hide each other's barriers.
template <int kHeadDim>
struct FwdTileFor;
template <> struct FwdTileFor<32> { using type = FwdTile<32, 128, 4, 2, 2, 128, 64>; };
// (Benchmark knobs, left at their defaults in builds: scripts/sm80_variants.sh
// compiles one head dim's file with other values. JAXATTN_FWD_STAGES sets
// kKVStages of every head dim of the translation unit.)
#ifndef JAXATTN_FWD_STAGES
#define JAXATTN_FWD_STAGES 1
#endif
#ifndef JAXATTN_FWD_PIPE
#define JAXATTN_FWD_PIPE false
#endif
#ifndef JAXATTN_FWD64_BN
#define JAXATTN_FWD64_BN 64
#endif
#ifndef JAXATTN_FWD64_WARPS
#define JAXATTN_FWD64_WARPS 4
#endif
#ifndef JAXATTN_FWD64_MTILES
#define JAXATTN_FWD64_MTILES 2
#endif
#ifndef JAXATTN_FWD64_MINB
#define JAXATTN_FWD64_MINB 2
#endif
#ifndef JAXATTN_FWD64_BND  // (keys a step of the kernels with a dense bias / mask)
#define JAXATTN_FWD64_BND JAXATTN_FWD64_BN
#endif
template <> struct FwdTileFor<64> {
  using type = FwdTile<64, JAXATTN_FWD64_BN, JAXATTN_FWD64_WARPS, JAXATTN_FWD64_MTILES, JAXATTN_FWD64_MINB,
                       JAXATTN_FWD64_BN, JAXATTN_FWD64_BN, JAXATTN_FWD64_BND, JAXATTN_FWD_STAGES, JAXATTN_FWD_PIPE>;
};
template <> struct FwdTileFor<96> { using type = FwdTile<96, 32, 4, 2, 2>; };
#ifndef JAXATTN_FWD128_BN
#define JAXATTN_FWD128_BN 48
#endif
#ifndef JAXATTN_FWD128_WARPS
#define JAXATTN_FWD128_WARPS 4
#endif
#ifndef JAXATTN_FWD128_MTILES
#define JAXATTN_FWD128_MTILES 2
#endif
#ifndef JAXATTN_FWD128_MINB
#define JAXATTN_FWD128_MINB 2
#endif
#ifndef JAXATTN_FWD128_BNM  // (keys a step of the masked kernels: 8-warp tiles spill with 32)
#define JAXATTN_FWD128_BNM 32
#endif
// H = 128 double-buffers K / V (one barrier a step): H200, session 4
// (scripts/sm80_variants.sh, T=16K): 376.5 vs 353.0 TFLOP/s, causal 341.0 vs 326.5.
// (At H = 64 it lost, 282 vs 301; at 256 it was even.)
#ifndef JAXATTN_FWD128_STAGES
#define JAXATTN_FWD128_STAGES (JAXATTN_FWD_STAGES > 1 ? JAXATTN_FWD_STAGES : 2)
#endif
template <> struct FwdTileFor<128> {
  using type = FwdTile<128, JAXATTN_FWD128_BN, JAXATTN_FWD128_WARPS, JAXATTN_FWD128_MTILES,
                       JAXATTN_FWD128_MINB, 32, JAXATTN_FWD128_BNM, 16, JAXATTN_FWD128_STAGES, JAXATTN_FWD_PIPE>;
};
template <> struct FwdTileFor<192> { using type = FwdTile<192, 64, 8, 1, 1, 64, 64, 32>; };
#ifndef JAXATTN_FWD256_BN
#define JAXATTN_FWD256_BN 64
#endif
#ifndef JAXATTN_FWD256_WARPS
#define JAXATTN_FWD256_WARPS 8
#endif
#ifndef JAXATTN_FWD256_MTILES
#define JAXATTN_FWD256_MTILES 1
#endif
#ifndef JAXATTN_FWD256_MINB
#define JAXATTN_FWD256_MINB 1
#endif
template <> struct FwdTileFor<256> {
  using type = FwdTile<256, JAXATTN_FWD256_BN, JAXATTN_FWD256_WARPS, JAXATTN_FWD256_MTILES, JAXATTN_FWD256_MINB,
                       JAXATTN_FWD256_BN, JAXATTN_FWD256_BN, 32, JAXATTN_FWD_STAGES, JAXATTN_FWD_PIPE>;
};

// Backward (why: dK and dV of a warp's 16 keys x H stay in registers, 128 of
// them at H = 128, so a CTA has one step's S^T / dP^T, 16 x kBlockM each, on
// top; kBlockM = 64 measured 246 TFLOP/s against 226 for 32 at H = 128).
// One CTA per (key block, kv head, batch); warp w owns keys
// [16w, 16w+16) of the block, so S^T = K Q^T and dP^T = V dO^T come out of
// the MMA already in the A-operand layout of dV += P^T dO and dK += dS^T Q.
// dS^T goes through shared memory once for dQ += dS K, which every warp
// computes a piece of and adds to dq_accum with f32 atomics; the dQ of a step
// runs at the start of the next (dS^T double-buffered), so one barrier per
// step suffices. Q, dO, lse and dpsum of the next query block load while the
// current one is processed (two stages).
// kSplitDV: dK+dV accumulators do not fit registers (H >= 192): a first pass
// computes dV alone, a second dK and dQ (one extra Q K^T recompute).
// kPair (unmasked kernels, no kSplitDV): warps 2p and 2p+1 share keys
// [32p, 32p+32): each computes S^T and dP^T for the 32 keys and one half of
// the kBlockM queries, P^T and dS^T go through shared memory (a barrier of
// the pair), and each accumulates dV, dK for the 32 keys and one half of the
// head dim. Per MMA this reads about a fifth less shared memory (Q and dO
// slices of 32 queries / H/2 columns instead of all kBlockM queries / H).
template <int kHeadDim_, int kBlockM_, int kWarps_, bool kSplitDV_, int kMinBlocks_ = 1, bool kPair_ = false>
struct BwdTile {
  static constexpr bool kPair = kPair_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = kWarps * 16;  // keys per CTA
  static constexpr bool kSplitDV = kSplitDV_;
  static constexpr int kMinBlocks = kMinBlocks_;  // CTAs per SM the registers allow
  static constexpr int kPitch = kHeadDim + 8;
  static constexpr int kDsPitch = kBlockM + 8;
  // dQ = dS K: each warp computes kDqMTiles*16 rows x kDqCols columns; 32 rows
  // (fewer ldmatrix per MMA) where the head dim splits into 16-column pieces.
  static constexpr bool dq_two_m_tiles() {
    if (kBlockM % 32 != 0 || kWarps % (kBlockM / 32) != 0) return false;
    const int warps_n = kWarps / (kBlockM / 32);
    return kHeadDim % warps_n == 0 && (kHeadDim / warps_n) % 16 == 0;
  }
  static constexpr int kDqMTiles = dq_two_m_tiles() ? 2 : 1;
  static constexpr int kDqWarpsM = kBlockM / (16 * kDqMTiles);
  static constexpr int kDqWarpsN = kWarps / kDqWarpsM;
  static constexpr int kDqCols = kHeadDim / kDqWarpsN;  // per warp
  // smem, in elements: K, V, 2 x Q, 2 x dO, 2 x dS^T; then 2 x (lse, dpsum) f32.
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kBlockN * kPitch;
  static constexpr int kOffQ = kOffV + kBlockN * kPitch;
  static constexpr int kOffdO = kOffQ + 2 * kBlockM * kPitch;
  static constexpr int kOffdS = kOffdO + 2 * kBlockM * kPitch;
  static constexpr int kOffP = kOffdS + 2 * kBlockN * kDsPitch;  // kPair: P^T [kBlockN][kDsPitch]
  static constexpr int kElems = kOffP + (kPair ? kBlockN * kDsPitch : 0);
  static constexpr int kSmemBytes = kElems * 2 + 4 * kBlockM * 4;
  static_assert(kWarps % kDqWarpsM == 0 && kDqCols % 16 == 0, "dQ warp layout");
  static_assert(!kPair || (!kSplitDV && kWarps % 2 == 0 && kBlockM % 32 == 0 && kHeadDim % 32 == 0),
                "pair layout");
  static_assert(kBlockM % 16 == 0 && kHeadDim % 16 == 0, "tile shape");
};

template <int kHeadDim>
struct BwdTileFor;
// (Benchmark knob: JAXATTN_BWD_DQ_V4=1 adds dQ with 16-byte reductions on
// sm_90+, see bwd_kernel.cuh.)
#ifndef JAXATTN_BWD_DQ_V4
#define JAXATTN_BWD_DQ_V4 0
#endif
// JAXATTN_BWD_STAGGER (default 1; kPair kernels, not in deterministic mode): warps
// [kWarps/2, kWarps) (pairs 2, 3 at 8 warps) add the dQ of the previous step at the
// end of a step instead of its start, so that each SM sub-partition (warps w and
// w + 4) has one warp in a tensor-core phase while the other is in its exp / dS /
// atomics phase, see bwd_kernel.cuh. With JAXATTN_BWD_LEAN_DQ (default 1; kPair
// kernels: a query block whose rows are all < T with head_dim == the tile's adds its
// dQ without per-row / per-column bounds branches) the H=128 backward went 262 ->
// 294 TFLOP/s non-causal and 264 -> 293 causal at T=16K (H200, session 15 run 1,
// standalone, same run; lean dQ alone: -1%, stagger alone: +10%).
#ifndef JAXATTN_BWD_STAGGER
#define JAXATTN_BWD_STAGGER 1
#endif
#ifndef JAXATTN_BWD_LEAN_DQ
#define JAXATTN_BWD_LEAN_DQ 1
#endif
// (Benchmark knob: JAXATTN_BWD_PAIR=1 turns on kPair for H = 64, 96 (128 has it
// by default: JAXATTN_BWD128_PAIR).)
#ifndef JAXATTN_BWD_PAIR
#define JAXATTN_BWD_PAIR 0
#endif
template <> struct BwdTileFor<32> { using type = BwdTile<32, 64, 8, false, 2>; };
template <> struct BwdTileFor<64> { using type = BwdTile<64, 64, 8, false, 1, JAXATTN_BWD_PAIR != 0>; };
template <> struct BwdTileFor<96> { using type = BwdTile<96, 64, 8, false, 1, JAXATTN_BWD_PAIR != 0>; };
#ifndef JAXATTN_BWD128_BM
#define JAXATTN_BWD128_BM 64
#endif
#ifndef JAXATTN_BWD128_WARPS
#define JAXATTN_BWD128_WARPS 8
#endif
#ifndef JAXATTN_BWD128_MINB
#define JAXATTN_BWD128_MINB 1
#endif
// H = 128 uses warp pairs (kPair): H200, session 4: bwd 262.0 vs 252.6 TFLOP/s at
// T=16K (causal 264.4 vs 254.5); at H = 64 pairs lost (206.6 vs 223.1).
#ifndef JAXATTN_BWD128_PAIR
#define JAXATTN_BWD128_PAIR 1
#endif
template <> struct BwdTileFor<128> {
  using type = BwdTile<128, JAXATTN_BWD128_BM, JAXATTN_BWD128_WARPS, false, JAXATTN_BWD128_MINB,
                       JAXATTN_BWD_PAIR != 0 || JAXATTN_BWD128_PAIR != 0>;
};
template <> struct BwdTileFor<192> { using type = BwdTile<192, 32, 8, true>; };
template <> struct BwdTileFor<256> { using type = BwdTile<256, 32, 8, true>; };

// The masked backward's tile: the same, except H = 128 takes 32 queries a
// step (its mask state spills with 64 under the 255-register cap).
template <int kHeadDim>
struct BwdTileMaskedFor { using type = typename BwdTileFor<kHeadDim>::type; };
template <> struct BwdTileMaskedFor<128> { using type = BwdTile<128, 32, 8, false>; };

}  // namespace jaxattn::cuda::sm80
