// The causal Hopper grids' order in groups of heads: the backward's (key blocks, kv
// heads, batch) grid and the forward's non-persistent (query tiles, heads, batch) grid.
//
// A causal unit's cost falls with its position in the head: a backward unit (key block
// n, head) costs M - n query-block steps, a forward unit (query tile m) m + 1 key blocks.
// The usual grids go longest first within a head, position fastest, and the hardware
// hands CTAs out in that linear order, so the longest unit of the last head starts
// about one head's work before the end and runs past every other SM. A greedy dispatch
// model (scripts/causal_grid_sim.py; the benchmark's shapes, 16K tokens, N H = 2048)
// puts that 3-7% above total / SMs for the backward at T = 1K-8K (H = 128 / 256; H = 64
// ~3%) and 11-13% for the forward at H = 256 T = 4K-8K (0.3-0.8% at 16K). Fully
// longest-first over every head is within 1%, but puts 132 different heads in flight,
// each CTA reading its own head's operands: their DRAM traffic, not the tensor cores,
// would bind (the forward's causal grid measured ~700 MB of DRAM reads for 192 MB of
// inputs that way, session 12). Here the heads (batch-major: b K + kv_head for the
// backward, b N + head for the forward, so query heads that share K / V stay adjacent)
// are cut into `groups` consecutive groups of near-equal size (sizes differ by at most
// one), each with about f SMs of units or more, and each group's units go out position
// slowest: longest first inside a group, and only ~f SMs / (units a head) heads in
// flight. The model: within 0.1-1.6% of total / SMs at f = 2 for the backward, 0.5-2.4%
// at f = 2-3 for the forward.
//
// Backward: f = 2 by default (-DJAXATTN_BWD_CAUSAL_GROUPS=F10 sets f = F10 / 10; 0
// restores the usual grid). Measured on the H200 (session 35, standalone, the same
// kernel on the usual grid in the same binary): +3-4% at H = 128 T = 2K-8K, +1-3% at
// H = 256 T = 1K-4K (0 at 8K), +1-1.5% at H = 64 T = 2K-8K (-1% at 1K); f = 1.5 and 2
// within noise of each other.
// Forward (the default at H = 256 causal with T > 1024, sm90/fwd_launch.cuh): f = 2 by
// default (-DJAXATTN_FWD_CAUSAL_GROUPS=F10; 0 restores the usual grid). Measured on the
// H200 (session 35 run 6, standalone, one binary, TFLOP/s grouped / usual grid /
// persistent pairs): T = 2K 569-576 / 548-549 / 558-564, 4K 681-683 / 633-638 / 643-647,
// 8K 739-744 / 687-700 / 681-695, 16K 780-786 / 785-791 / 710-719; f = 3 within 1% of
// f = 2.
#pragma once

#include "common/fast_div.h"  // JAXATTN_HD

#ifndef JAXATTN_BWD_CAUSAL_GROUPS
#define JAXATTN_BWD_CAUSAL_GROUPS 20
#endif
#ifndef JAXATTN_FWD_CAUSAL_GROUPS
#define JAXATTN_FWD_CAUSAL_GROUPS 20
#endif

namespace jaxattn::sm90 {

// f * 10 of each direction (0: off, the usual grid).
inline constexpr int kBwdCausalGroupsF10 = JAXATTN_BWD_CAUSAL_GROUPS;
inline constexpr int kFwdCausalGroupsF10 = JAXATTN_FWD_CAUSAL_GROUPS;

// Groups for `heads` heads of `units` units each on `sms` SMs: about f * sms units or
// more a group (f = f10 / 10), at least 1, at most `heads` (one head a group is the
// usual order).
inline int causal_groups(int heads, int units, int sms, int f10) {
  const long long per = ((long long)f10 * sms + 9) / 10;
  long long g = per > 0 ? (long long)heads * units / per : heads;
  if (g < 1) g = 1;
  if (g > heads) g = heads;
  return (int)g;
}

// Unit x of the grouped order: its position in its head (0 = the longest unit: key
// block 0 of the backward, the last query tile of the forward) and its head.
JAXATTN_HD void causal_group_unit(int x, int heads, int units, int groups, int& pos, int& head) {
  const int base = heads / groups, extra = heads % groups;  // groups < extra hold base + 1 heads
  const int big = (base + 1) * units;
  int g, size, at;
  if (x < extra * big) {
    g = x / big, size = base + 1, at = x - g * big;
  } else {
    const int y = x - extra * big;
    g = extra + y / (base * units), size = base, at = y - (g - extra) * base * units;
  }
  pos = at / size;
  head = g * base + (g < extra ? g : extra) + at % size;
}

}  // namespace jaxattn::sm90
