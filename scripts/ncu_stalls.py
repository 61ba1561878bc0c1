#!/usr/bin/env python3
"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

Input: the CSV of `ncu --import R.ncu-rep --page source --csv --print-source sass`
(plain or .gz) of a launch profiled with `--section SourceCounters` (one kernel per
file). Prints the launch's instruction and stall-sample totals, then the instructions
with the most samples: index, offset, share of the samples, times executed, the SASS
and its largest stall reasons ("unlisted": samples the page's stall columns do not
account for, such as the warpgroup-arrive / gmma waits of wgmma instructions).

With --base B.csv[.gz] --work W it compares two launches of related kernels (for
example causal against non-causal): B's samples scaled by W (the first launch's work
over B's, e.g. 0.504 for causal vs non-causal steps) give the samples the first launch
would have at B's efficiency, and the reasons' totals are listed side by side with
the difference (session 36 run 3 found the causal H=256 backward's extra time this way).

With --shared it also sums the page's "L1 Wavefronts Shared" column by opcode: which
instructions use the shared-memory data path (wgmma operand reads count there too;
session 37 run 7: SS wgmmas 57%, RS wgmmas' B operands 19%, the lse / D loads 9.5%).

  scripts/ncu_stalls.py sass_c1.csv.gz --top 30
  scripts/ncu_stalls.py sass_c1.csv.gz --base sass_c0.csv.gz --work 0.504
  scripts/ncu_stalls.py sass_c1.csv.gz --top 0 --shared
"""
import argparse
import collections
import csv
import gzip
import sys


def read_rows(path):
    """(header, rows) of the source page: the header is the row that names "Address"."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    for i, row in enumerate(rows):
        if row and row[0] == "Address":
            header = row
            return header, [r for r in rows[i + 1:] if len(r) >= len(header)]
    raise ValueError(f"{path}: no header row naming 'Address' (not a --page source --csv export?)")


def load(path):
    """Instructions of one launch: dicts with index, offset, sass, samples, executed,
    stalls (reason -> samples, the 'stall_*' columns of all samples)."""
    header, rows = read_rows(path)
    col = {name: i for i, name in enumerate(header)}
    for need in ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"):
        if need not in col:
            raise ValueError(f"{path}: no column {need!r} (profile with --section SourceCounters)")
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    shared_col = col.get("L1 Wavefronts Shared")
    out, base = [], None

    def num(text):
        text = text.replace(",", "").strip()
        return int(float(text)) if text not in ("", "-") else 0

    for i, r in enumerate(rows):
        addr = int(r[col["Address"]], 16)
        base = addr if base is None else base
        samples = num(r[col["Warp Stall Sampling (All Samples)"]])
        stalls = {k[len("stall_"):]: num(r[col[k]]) for k in reasons}
        # The page has no column for some reasons (warpgroup arrive, gmma: the launch's
        # details list them); what its columns do not account for goes here.
        stalls["unlisted"] = max(samples - sum(stalls.values()), 0)
        out.append({
            "index": i,
            "offset": addr - base,
            "sass": r[col["Source"]].strip(),
            "samples": samples,
            "executed": num(r[col["Instructions Executed"]]),
            "stalls": stalls,
            "shared": num(r[shared_col]) if shared_col is not None else 0,
        })
    return out


def opcode(sass):
    """The opcode of a SASS line with its first modifier: '@!P0 LDS.64 R2, [R4]' -> 'LDS.64',
    'HGMMA.64x64x16.F32.BF16 ...' -> 'HGMMA.64x64x16'."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    if not words:
        return ""
    parts = words[0].split(".")
    return ".".join(parts[:2])


def shared_by_opcode(instrs):
    """(opcode, wavefronts) pairs, most first, of the instructions with shared wavefronts."""
    by_op = collections.Counter()
    for ins in instrs:
        if ins["shared"]:
            by_op[opcode(ins["sass"])] += ins["shared"]
    return by_op.most_common()


def totals(instrs):
    by_reason = collections.Counter()
    for ins in instrs:
        by_reason.update(ins["stalls"])
    return sum(i["samples"] for i in instrs), sum(i["executed"] for i in instrs), by_reason


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25, help="instructions to list (default 25)")
    p.add_argument("--base", help="a second launch's CSV to compare against")
    p.add_argument("--work", type=float, default=1.0, help="first launch's work over the base's (default 1)")
    p.add_argument("--shared", action="store_true", help="shared-memory wavefronts by opcode")
    a = p.parse_args(argv)
    instrs = load(a.csv)
    samples, executed, reasons = totals(instrs)
    print(f"{a.csv}: {len(instrs)} instructions, {samples} samples, {executed} executed")
    for ins in sorted(instrs, key=lambda x: -x["samples"])[:a.top]:
        top = sorted(((v, k) for k, v in ins["stalls"].items() if v), reverse=True)[:2]
        why = ", ".join(f"{k} {v}" for v, k in top)
        share = 100.0 * ins["samples"] / max(samples, 1)
        print(f"{ins['index']:5d} {ins['offset']:6x} {share:5.2f}% x{ins['executed']:<9d} {ins['sass'][:58]:58s} {why}")
    if a.shared:
        rows = shared_by_opcode(instrs)
        total = sum(v for _, v in rows)
        if not rows:
            print("\nno 'L1 Wavefronts Shared' counts in this export")
        else:
            print(f"\nshared-memory wavefronts by opcode ({total} in all)")
            for op, v in rows:
                print(f"{op:24s} {v:14d} {100.0 * v / total:6.1f}%")
    if a.base:
        b_samples, b_executed, b_reasons = totals(load(a.base))
        print(f"\nagainst {a.base} scaled by {a.work}: samples {samples} vs {b_samples * a.work:.0f}, "
              f"executed {executed} vs {b_executed * a.work:.0f}")
        print(f"{'reason':22s} {'this':>9s} {'base x work':>12s} {'extra':>9s}")
        for k in sorted(set(reasons) | set(b_reasons), key=lambda k: -(reasons[k] - b_reasons[k] * a.work)):
            scaled = b_reasons[k] * a.work
            if reasons[k] or scaled:
                print(f"{k:22s} {reasons[k]:9d} {scaled:12.0f} {reasons[k] - scaled:+9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
