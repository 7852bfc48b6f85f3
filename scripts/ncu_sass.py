#!/usr/bin/env python3
"""ncu_sass.py CSV [TOP]: where a kernel's instructions and stalls go, from Nsight Compute's
source page.

CSV is the output (plain or .gz) of
    ncu --import REP.ncu-rep --page source --print-source sass --csv
for one kernel profiled with the SourceCounters section (e.g. --section SourceCounters
--section WarpStateStats). Prints:
  - the executed instructions per mma (HMMA, or per instruction where the kernel has none) by
    opcode, with each opcode's share of the stall samples;
  - the stall reasons' shares, each with the opcodes that stalled most on it;
  - for the TOP (default 6) largest reasons, the instructions with the most samples, by
    SASS line (its index in the CSV, its execution count, the text).
Reading the per-item code this way (how often each line runs) shows per-element branches,
divisions and register moves that the source does not make obvious. Exit status 1 when the
CSV has no instruction rows."""
import collections
import csv
import gzip
import sys


def rows_of(path):
    f = gzip.open(path, "rt") if path.endswith(".gz") else open(path, newline="")
    with f:
        r = csv.reader(f)
        hdr = None
        for row in r:  # the kernel's name line comes first, then the header
            if "Source" in row and "Instructions Executed" in row:
                hdr = row
                break
        if hdr is None:
            return None, []
        return hdr, [row for row in r if len(row) == len(hdr)]


def opcode(text):
    t = text.strip().split()
    if not t:
        return "?"
    return t[1] if t[0].startswith("@") and len(t) > 1 else t[0]


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    hdr, rows = rows_of(sys.argv[1])
    if not rows:
        print(f"{sys.argv[1]}: no instruction rows", file=sys.stderr)
        return 1
    i_src, i_exe = hdr.index("Source"), hdr.index("Instructions Executed")
    i_smp = hdr.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda s: int(s) if s.strip().isdigit() else 0
    exe, smp = collections.Counter(), collections.Counter()
    by_reason = collections.defaultdict(collections.Counter)
    for row in rows:
        op = opcode(row[i_src])
        exe[op] += num(row[i_exe])
        smp[op] += num(row[i_smp])
        for i in reasons:
            by_reason[hdr[i]][op.split(".")[0]] += num(row[i])
    n_inst, n_smp = sum(exe.values()), max(sum(smp.values()), 1)
    n_mma = sum(v for k, v in exe.items() if k.startswith("HMMA")) or n_inst
    per = "mma" if n_mma != n_inst else "instruction"
    print(f"{n_inst / n_mma:.2f} instructions per {per}; {n_smp} stall samples")
    for op, v in exe.most_common(30):
        print(f"  {op:30s} {v / n_mma:7.3f} per {per}   stalls {100 * smp[op] / n_smp:5.1f}%")
    totals = {r: sum(c.values()) for r, c in by_reason.items()}
    all_r = max(sum(totals.values()), 1)
    print("stall reasons:")
    for r, v in sorted(totals.items(), key=lambda a: -a[1])[:10]:
        ops = ", ".join(f"{o} {c}" for o, c in by_reason[r].most_common(4))
        print(f"  {r:26s} {100 * v / all_r:5.1f}%   {ops}")
    for r, _ in sorted(totals.items(), key=lambda a: -a[1])[:top]:
        i = hdr.index(r)
        worst = sorted(range(len(rows)), key=lambda k: -num(rows[k][i]))[:5]
        print(f"{r}: the lines with the most samples (line, samples, executions, SASS)")
        for k in sorted(worst):
            print(f"  {k:5d} {num(rows[k][i]):6d} {num(rows[k][i_exe]):9d}  {rows[k][i_src].strip()[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
