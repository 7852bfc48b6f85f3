#!/usr/bin/env python3
"""ab_attnx.py LOGDIR N: the table of scripts/ab.sh's part attnx.

Reads LOGDIR/attnx-{a,b}-{1..N}.log (bench_dflash_attn's output, A = the default build and
B = the switched one, run alternately) and prints, per configuration (layout x layer) and
figure (forward, backward and the backward's passes), the median over the runs of each side,
the change, and in how many of the N run pairs (A run r, B run r) B was faster. The attention
moves 2-5% from process to process, more than most kernel changes; the pairs say whether a
difference holds run by run. Also whether the default forward / backward bits (hashes) agree.
Exit status 1 when a log is missing or has no configuration."""
import re
import statistics
import sys

CONF = re.compile(r"^(\S+)\s+(full|sliding)\s+visible pairs")
FWD = re.compile(r"default fwd ([0-9.]+) ms")
BWD = re.compile(r"bwd ([0-9.]+) ms")


def parse(path):
    """{config: {figure: ms}} and the bit-hash lines of one bench_dflash_attn log"""
    out, bits, conf, cols = {}, [], None, None
    with open(path) as f:
        for line in f:
            m = CONF.match(line)
            if m:
                conf = f"{m.group(1)} {m.group(2)}"
                fig = out.setdefault(conf, {})
                fw, bw = FWD.search(line), BWD.search(line)
                if fw:
                    fig["fwd"] = float(fw.group(1))
                if bw:
                    fig["bwd"] = float(bw.group(1))
                cols = None
                continue
            if "default forward bits" in line or "default backward bits" in line:
                bits.append(line.strip())
            if conf is None:
                continue
            if "bwd passes" in line:
                cols = line.split()[3:]  # after "bwd passes ms"
                continue
            w = line.split()
            if cols and len(w) == 2 + len(cols) and w[0] == "default" and "dq" not in out[conf]:
                for name, v in zip(cols, w[2:]):
                    out[conf][name] = float(v)
    return out, bits


def main():
    if len(sys.argv) != 3:
        print("usage: ab_attnx.py LOGDIR N", file=sys.stderr)
        return 2
    log, n = sys.argv[1], int(sys.argv[2])
    runs = {"a": [], "b": []}
    bits = {}
    for side in ("a", "b"):
        for r in range(1, n + 1):
            try:
                figs, b = parse(f"{log}/attnx-{side}-{r}.log")
            except OSError as e:
                print(f"ab_attnx.py: {e}", file=sys.stderr)
                return 1
            if not figs:
                print(f"ab_attnx.py: {log}/attnx-{side}-{r}.log: no configuration", file=sys.stderr)
                return 1
            runs[side].append(figs)
            bits.setdefault(side, b)
    print(f"{'configuration':16} {'figure':10} {'A ms':>8} {'B ms':>8} {'change':>8}  B faster")
    for conf in runs["a"][0]:
        for fig in ("fwd", "bwd", "dq", "ctx_dkv", "blk_dkv", "reduce"):
            a = [r[conf][fig] for r in runs["a"] if fig in r.get(conf, {})]
            b = [r[conf][fig] for r in runs["b"] if fig in r.get(conf, {})]
            if len(a) != n or len(b) != n:
                continue
            ma, mb = statistics.median(a), statistics.median(b)
            faster = sum(1 for x, y in zip(a, b) if y < x)
            change = 100 * (mb / ma - 1) if ma > 0 else float("nan")
            print(f"{conf:16} {fig:10} {ma:8.4f} {mb:8.4f} {change:+7.1f}%  {faster}/{n}")
    print("default bits equal (first runs):", "yes" if bits.get("a") == bits.get("b") else "no")
    return 0


if __name__ == "__main__":
    sys.exit(main())
