// The causal Hopper backward's grid order in groups of heads: f = 2 by default
// (-DJAXATTN_BWD_CAUSAL_GROUPS=F10 sets f = F10 / 10; 0 restores the usual grid).
// Measured on the H200 (session 35, standalone, the same kernel on the usual grid in the
// same binary): +3-4% at H = 128 T = 2K-8K, +1-3% at H = 256 T = 1K-4K (0 at 8K), +1-1.5%
// at H = 64 T = 2K-8K (-1% at 1K); f = 1.5 and 2 within noise of each other.
//
// The usual grid is (key blocks, kv heads, batch), key blocks fastest, and a causal unit
// (key block n, head) costs M - n query-block steps (longest first within a head). The
// hardware hands out CTAs in that linear order, so the longest unit of the last head
// starts about one head's work before the end and runs past every other SM: a greedy
// dispatch simulation of the benchmark's shapes (16K tokens, 2048 = N H) gives
// makespans 3-7% above total / SMs at T = 1K-8K for H = 128 and 256 (H = 64: ~3%).
// Fully longest-first over every head (key block slowest) is within 1%, but puts 132
// different heads in flight, each CTA reading its own head's Q / dO and adding into its
// own dQ: their DRAM traffic, not the tensor cores, would bind (the forward's causal
// grid measured ~700 MB of DRAM reads for 192 MB of inputs that way, session 12).
// Here the heads (batch-major, b K + kv_head) are cut into `groups` consecutive groups
// of near-equal size (sizes differ by at most one), each with about f SMs of units or
// more, and each group's units go out key block slowest: longest first inside a group,
// and only ~f SMs / (key blocks) heads in flight. The simulation: within 0.1-1.6% of
// total / SMs at f = 2 on the same shapes, and on 12K- and 24K-token shapes (head counts
// that are not powers of two), against 3-9% for the usual order.
#pragma once

#include "common/fast_div.h"  // JAXATTN_HD

#ifndef JAXATTN_BWD_CAUSAL_GROUPS
#define JAXATTN_BWD_CAUSAL_GROUPS 20
#endif

namespace jaxattn::sm90 {

// f * 10 (0: off, the usual grid).
inline constexpr int kBwdCausalGroupsF10 = JAXATTN_BWD_CAUSAL_GROUPS;

// Groups for `heads` = batch * kv heads of `n_kblocks` units each on `sms` SMs: about
// f * sms units or more a group (f = f10 / 10), at least 1, at most `heads` (one head a
// group is the usual order).
inline int bwd_causal_groups(int heads, int n_kblocks, int sms, int f10) {
  const long long per = ((long long)f10 * sms + 9) / 10;
  long long g = per > 0 ? (long long)heads * n_kblocks / per : heads;
  if (g < 1) g = 1;
  if (g > heads) g = heads;
  return (int)g;
}

// Unit x of the grouped order: its key block and its head (b K + kv_head).
JAXATTN_HD void bwd_causal_group_unit(int x, int heads, int n_kblocks, int groups, int& n_block, int& head) {
  const int base = heads / groups, extra = heads % groups;  // groups < extra hold base + 1 heads
  const int big = (base + 1) * n_kblocks;
  int g, size, at;
  if (x < extra * big) {
    g = x / big, size = base + 1, at = x - g * big;
  } else {
    const int y = x - extra * big;
    g = extra + y / (base * n_kblocks), size = base, at = y - (g - extra) * base * n_kblocks;
  }
  n_block = at / size;
  head = g * base + (g < extra ? g : extra) + at % size;
}

}  // namespace jaxattn::sm90
