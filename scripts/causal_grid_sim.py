#!/usr/bin/env python3
"""Greedy-dispatch model of the causal Hopper grids' orders (no GPU).

Backward (default): a causal unit (key block n, head) costs M - n * kBlockN / kBlockM
query-block steps; --forward: the non-persistent forward grid at H=256 (the one causal
default on it), a unit (query tile m of 128 rows, head) costs its ceil((m + 1) 128 / 80)
key blocks of 80. Each unit also costs a fixed `--overhead` (its loads and epilogue);
the hardware hands CTAs out in linear block order to whichever SM frees first, one CTA
per SM. Prints each order's makespan over the bound (total work / SMs) for the
benchmark's shapes:
  usual:    longest unit first inside a head, heads one after another (the (n, K, B)
            grid of the backward, the (m reversed, N, B) grid of the forward);
  grouped:  sm90/causal_groups.h at f = 1.0 / 1.5 / 2.0 (3.0 too with --forward; heads
            in near-equal groups of >= f SMs of units, position slowest inside a group);
  global:   position slowest over every head (the balance bound of longest-first).
Usage: scripts/causal_grid_sim.py [--forward] [--sms 132] [--overhead 2] [--tokens 16384]
       [--width 2048]
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
    """As causal_groups (cuda/sm90/causal_groups.h)."""
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
    ap.add_argument("--forward", action="store_true", help="the H=256 forward's causal grid")
    a = ap.parse_args()
    fs = (10, 15, 20, 30) if a.forward else (10, 15, 20)
    print("| H | T | heads | usual | " + " | ".join("f=%.1f" % (f / 10) for f in fs) + " | global |")
    print("|---|---|---|---|" + "---|" * len(fs) + "---|")
    if a.forward:
        for T in [1024, 2048, 4096, 8192, 16384]:
            if a.tokens % T:
                continue
            H, M = 256, -(-T // 128)
            heads = (a.tokens // T) * (a.width // H)

            def fwork(i):  # i = 0: the last query tile, the longest
                return -(-(M - i) * 128 // 80)

            report(H, T, heads, M, fwork, fs, a)
        return
    for H, bn, bm in [(64, 128, 64), (128, 128, 64), (256, 64, 64)]:
        N = a.width // H
        for T in [1024, 2048, 4096, 8192, 16384]:
            if a.tokens % T:
                continue
            B = a.tokens // T
            heads, nk, M = B * N, -(-T // bn), -(-T // bm)

            def work(n):
                return M - (n * bn) // bm

            report(H, T, heads, nk, work, fs, a)


def report(H, T, heads, nk, work, fs, a):
    """One row: each order's makespan over the bound (groups in parentheses)."""
    usual = [work(n) for _ in range(heads) for n in range(nk)]
    bound = (sum(usual) + a.overhead * len(usual)) / a.sms
    cells = ["%.3f" % (makespan(usual, a.sms, a.overhead) / bound)]
    for f10 in fs:
        order, ng = grouped_order(heads, nk, a.sms, f10, work)
        cells.append("%.3f (%d)" % (makespan(order, a.sms, a.overhead) / bound, ng))
    glob = [work(n) for n in range(nk) for _ in range(heads)]
    cells.append("%.3f" % (makespan(glob, a.sms, a.overhead) / bound))
    print(f"| {H} | {T} | {heads} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
