#!/usr/bin/env python3
"""Greedy-dispatch model of the causal Hopper backward's grid order (no GPU).

A causal unit (key block n, head) costs M - n * kBlockN / kBlockM query-block steps
plus a fixed `--overhead` (its K / V load and epilogue); the hardware hands CTAs out in
linear block order to whichever SM frees first, one CTA per SM. Prints each order's
makespan over the bound (total work / SMs) for the benchmark's shapes:
  usual:    key blocks fastest, then kv heads, then batch (the (n, K, B) grid);
  grouped:  sm90/bwd_causal_groups.h at f = 1.0 / 1.5 / 2.0 (heads in near-equal
            groups of >= f SMs of units, key block slowest inside a group);
  global:   key block slowest over every head (the balance bound of longest-first).
Usage: scripts/causal_grid_sim.py [--sms 132] [--overhead 2] [--tokens 16384] [--width 2048]
"""
import argparse
import heapq


def makespan(works, sms, overhead):
    free = [0.0] * sms
    for w in works:
        t = heapq.heappop(free)
        heapq.heappush(free, t + w + overhead)
    return max(free)


def groups_of(heads, nk, sms, f10):
    """As bwd_causal_groups (cuda/sm90/bwd_causal_groups.h)."""
    per = (f10 * sms + 9) // 10
    return max(1, min(heads, heads * nk // per if per > 0 else heads))


def grouped_order(heads, nk, sms, f10, work):
    ng = groups_of(heads, nk, sms, f10)
    base, extra = divmod(heads, ng)
    order = []
    for g in range(ng):
        size = base + (1 if g < extra else 0)
        order += [work(n) for n in range(nk) for _ in range(size)]
    return order, ng


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--width", type=int, default=2048)
    a = ap.parse_args()
    print("| H | T | heads | usual | f=1.0 | f=1.5 | f=2.0 | global |")
    print("|---|---|---|---|---|---|---|---|")
    for H, bn, bm in [(64, 128, 64), (128, 128, 64), (256, 64, 64)]:
        N = a.width // H
        for T in [1024, 2048, 4096, 8192, 16384]:
            if a.tokens % T:
                continue
            B = a.tokens // T
            heads, nk, M = B * N, -(-T // bn), -(-T // bm)

            def work(n):
                return M - (n * bn) // bm

            usual = [work(n) for _ in range(heads) for n in range(nk)]
            bound = (sum(usual) + a.overhead * len(usual)) / a.sms
            cells = ["%.3f" % (makespan(usual, a.sms, a.overhead) / bound)]
            for f10 in (10, 15, 20):
                order, ng = grouped_order(heads, nk, a.sms, f10, work)
                cells.append("%.3f (%d)" % (makespan(order, a.sms, a.overhead) / bound, ng))
            glob = [work(n) for n in range(nk) for _ in range(heads)]
            cells.append("%.3f" % (makespan(glob, a.sms, a.overhead) / bound))
            print(f"| {H} | {T} | {heads} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
