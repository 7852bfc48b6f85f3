#!/usr/bin/env python3
"""portable_table.py LOGDIR - issue 30's table from one bench-portable.sh attn stage: the drafter
attention's forward and backward (ms) per layout and layer with the default kernels, the portable
ones (DFLASH_PORTABLE=1), torch.compile(flex_attention) as compiled for the GPU (Triton's wgmma on
Hopper), with Triton's Hopper MMA off (DISABLE_MMA_V3=1: mma.sync, what an sm_120 GPU runs) and,
where flex-sm120f.log / flex-sm120b.log are there, mma.sync with the tiles torch picks for an
sm_120 (bench-portable.sh's sm120f for the forward, sm120b for the backward; on Hopper Triton
otherwise takes Hopper's tiles and up to 227 KiB, which the portable path may not use);
the portable path against both flex builds and against the goal (1.5x flex as compiled); and,
where mma-peak.log is there (tools/bench_mma_peak), the portable backward's TFLOP/s as a share of
mma.sync's ceiling on the same GPU; and where fa2.log is there (scripts/bench_sdpa_fa2.py), the
portable path's TFLOP/s and the goal's against FlashAttention-2's on each layout's dense analog
(12 x 1365 causal for 3 documents, 4 x 4096 causal for 1): what an FA2-class mma.sync kernel
reaches on this GPU.

Reads LOGDIR/attn-default.json, attn-portable.json (bench_dflash_attn --json-out), flex-*.log
(default / portable, mma2, sm120f, sm120b)
(scripts/bench_flex_dflash.py: one JSON line per layout, 3docs first) and mma-peak.log. Missing
parts print as "-". Prints markdown.
"""
import json
import os
import re
import sys


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def flex_runs(path):
    """the flex_attention JSON lines of a log, in order (3docs, then 1doc)"""
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{") and '"flex_attention"' in line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def rows_of(doc, key):
    return {r["layer"]: r for r in doc.get(key, [])} if doc else {}


def mma_ceiling(path):
    """the largest TFLOP/s of each (kind, operands) in bench_mma_peak's table"""
    best = {}
    try:
        with open(path) as f:
            for line in f:
                m = re.match(r"^(\S+ -> \S+)\s+(registers|ldmatrix\.x4 per 2 mma)\s+(\d+)\s+(\d+)\s+([\d.]+)",
                             line)
                if m:
                    k = m.group(1) + ", " + m.group(2)
                    best[k] = max(best.get(k, 0.0), float(m.group(5)))
    except OSError:
        pass
    return best


def fa2_rates(path):
    """{(batch, len): row} of bench_sdpa_fa2.py's JSON line"""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("{") and '"sdpa_fa2"' in line:
                    return {(r["batch"], r["len"]): r for r in json.loads(line)["sdpa_fa2"] if r["causal"]}
    except (OSError, ValueError, KeyError):
        pass
    return {}


def ms(r, k):
    return "%.3f" % r[k] if r and r.get(k) is not None else "-"


def ratio(a, b, k):
    if not a or not b or not a.get(k) or not b.get(k):
        return "-"
    return "%.2f" % (a[k] / b[k])


def main():
    if len(sys.argv) != 2:
        sys.stderr.write("usage: portable_table.py LOGDIR\n")
        return 2
    d = sys.argv[1]
    ours = {v: load_json(os.path.join(d, "attn-%s.json" % v)) for v in ("default", "portable")}
    flex = {}
    for v, files in (("wgmma", ("flex-portable.log", "flex-default.log")), ("mma", ("flex-mma2.log",)),
                     ("sm120f", ("flex-sm120f.log",)), ("sm120b", ("flex-sm120b.log",))):
        for fn in files:
            runs = flex_runs(os.path.join(d, fn))
            if runs:
                flex[v] = runs
                break
    ceil = mma_ceiling(os.path.join(d, "mma-peak.log"))
    fa2 = fa2_rates(os.path.join(d, "fa2.log"))
    gpu = next((r[0].get("gpu") for r in flex.values() if r), None)
    print("drafter attention, ms (fwd / bwd)%s" % (", " + gpu if gpu else ""))
    print()
    print("| layout | layer | default | portable | flex (wgmma) | flex (mma.sync) | flex (mma.sync, sm_120 "
          "tiles) | portable / flex wgmma (fwd, bwd) | portable / flex mma.sync (fwd, bwd) | portable / "
          "flex sm_120 tiles (fwd, bwd) | goal: portable <= (fwd, bwd) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    share = []
    fa2_rows = {}
    for li, (layout, key) in enumerate((("3docs", "layers"), ("1doc", "layers_1doc"))):
        od, op = rows_of(ours["default"], key), rows_of(ours["portable"], key)
        fw = {r["layer"]: r for r in flex["wgmma"][li]["layers"]} if len(flex.get("wgmma", [])) > li else {}
        fm = {r["layer"]: r for r in flex["mma"][li]["layers"]} if len(flex.get("mma", [])) > li else {}
        f1 = {r["layer"]: r for r in flex["sm120f"][li]["layers"]} if len(flex.get("sm120f", [])) > li else {}
        f2 = {r["layer"]: r for r in flex["sm120b"][li]["layers"]} if len(flex.get("sm120b", [])) > li else {}
        # the sm_120 tiles: the forward from sm120f's run, the backward from sm120b's
        fs = {k: {"fwd_ms": f1.get(k, {}).get("fwd_ms"), "bwd_ms": f2.get(k, {}).get("bwd_ms")}
              for k in set(f1) | set(f2)}
        for layer in ("full", "sliding"):
            if layer not in od and layer not in op and layer not in fw:
                continue
            a, b, c, e, f = od.get(layer), op.get(layer), fw.get(layer), fm.get(layer), fs.get(layer)
            goal = "%.3f, %.3f" % (c["fwd_ms"] / 1.5, c["bwd_ms"] / 1.5) if c else "-"
            print("| %s | %s | %s / %s | %s / %s | %s / %s | %s / %s | %s / %s | %s, %s | %s, %s | %s, %s | %s |" % (
                layout, layer, ms(a, "fwd_ms"), ms(a, "bwd_ms"), ms(b, "fwd_ms"), ms(b, "bwd_ms"),
                ms(c, "fwd_ms"), ms(c, "bwd_ms"), ms(e, "fwd_ms"), ms(e, "bwd_ms"), ms(f, "fwd_ms"),
                ms(f, "bwd_ms"), ratio(b, c, "fwd_ms"), ratio(b, c, "bwd_ms"), ratio(b, e, "fwd_ms"),
                ratio(b, e, "bwd_ms"), ratio(b, f, "fwd_ms"), ratio(b, f, "bwd_ms"), goal))
            if b and c and b.get("bwd_ms") and c.get("fwd_tflops"):
                bwd_flop = 2.5 * c["fwd_tflops"] * 1e12 * c["fwd_ms"] * 1e-3  # (flex's count of pairs)
                tf = bwd_flop / (b["bwd_ms"] * 1e-3) / 1e12
                gl = bwd_flop / (c["bwd_ms"] / 1.5 * 1e-3) / 1e12
                share.append((layout, layer, tf, gl))
            if b and c and layer == "full":
                fa2_rows[layout] = (b, c)
    analog = {"3docs": (12, 1365), "1doc": (4, 4096)}
    if fa2 and fa2_rows:
        print()
        print("TFLOP/s (fwd / bwd) against FlashAttention-2 (PyTorch's, mma.sync) on each layout's dense "
              "analog:")
        for layout, (b, c) in fa2_rows.items():
            r = fa2.get(analog[layout])
            if not r:
                continue
            ffl = c["fwd_tflops"] * c["fwd_ms"]  # flex's count of visible pairs, as FLOP / 1e9
            gf, gb = ffl / (c["fwd_ms"] / 1.5), 2.5 * ffl / (c["bwd_ms"] / 1.5)
            pf, pb = ffl / b["fwd_ms"], 2.5 * ffl / b["bwd_ms"]
            print("- %s full: FA2 at %dx%d causal %.1f / %.1f; the portable path %.1f / %.1f (%.2fx / %.2fx "
                  "FA2); the goal needs %.1f / %.1f (%.2fx / %.2fx FA2)" % (
                      layout, r["batch"], r["len"], r["fwd_tflops"], r["bwd_tflops"], pf, pb,
                      pf / r["fwd_tflops"], pb / r["bwd_tflops"], gf, gb, gf / r["fwd_tflops"],
                      gb / r["bwd_tflops"]))
    if ceil and share:
        print()
        print("mma.sync's ceiling here (tools/bench_mma_peak): %s TFLOP/s" %
              "; ".join("%s: %.1f" % (k, v) for k, v in sorted(ceil.items())))
        ref = ceil.get("bf16 -> f32, ldmatrix.x4 per 2 mma") or ceil.get("bf16 -> f32, registers")
        if not ref:
            return 0
        for layout, layer, tf, gl in share:
            print("- %s %s: the portable backward %.1f TFLOP/s (%.0f%% of bf16's ldmatrix ceiling); the goal "
                  "needs %.1f (%.0f%%)" % (layout, layer, tf, 100 * tf / ref, gl, 100 * gl / ref))
    return 0


if __name__ == "__main__":
    sys.exit(main())
