#!/usr/bin/env python3
"""bench_flex_dflash.py - the baseline for tools/bench_dflash_attn: torch.compile(flex_attention)
with the DFlash drafter mask (docs/DRAFTER.md "Attention mask") at the same shape and the same
anchors.

  tools/bench_dflash_attn --anchors-out A.json --json-out OURS.json
  scripts/bench_flex_dflash.py --anchors A.json [--ours OURS.json]
  tools/bench_dflash_attn --anchors-1doc-out A1.json --json-out OURS.json
  scripts/bench_flex_dflash.py --anchors A1.json --ours OURS.json --ours-key layers_1doc --title 1doc

Queries: n_blocks*bs block tokens; keys: S context + n_blocks*bs block tokens (concatenated).
Context key j is visible to query (block b, offset qo) iff valid[b], doc_start[b] <= j < anchor[b]
(and j >= anchor[b] + qo - (W-1) on sliding layers); block key visible iff same block (and
causal within it on sliding layers). GQA via enable_gqa=True, bf16. Times fwd and fwd+bwd with CUDA
events (median of --reps after warm-up); TFLOP/s counts visible pairs like the C bench
(fwd 4*D per pair per head, bwd 2.5x that). Peak memory of one fwd+bwd (after the timing):
torch.cuda.max_memory_allocated, in total and above what was allocated before the call (its
transient memory); the totals hold q/k/v twice (the plain inputs and the copies the backward
differentiates). Ours (from --ours): the bench's tensors + workspace, all allocated up front, and
the workspace (its backward's transient memory). Prints one JSON line, and with --ours a table.
"""
import argparse
import json
import math

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def visible_pairs(a, W):
    n = 0
    for b in range(a["n_blocks"]):
        if not a["valid"][b]:
            continue
        anc, ds = a["anchor"][b], a["doc_start"][b]
        for qo in range(a["block_size"]):
            lo = ds
            if W > 0 and anc + qo - (W - 1) > lo:
                lo = anc + qo - (W - 1)
            n += max(anc - lo, 0) + (qo + 1 if W > 0 else a["block_size"])
    return n * a["nq"]


def median_ms(fn, reps, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchors", required=True)
    ap.add_argument("--ours", help="bench_dflash_attn --json-out file, for the comparison table")
    ap.add_argument("--ours-key", default="layers",
                    help="the rows of --ours with the same anchors: layers (3docs) or layers_1doc")
    ap.add_argument("--title", default="", help="a name for the layout, printed above the table")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernel-options", default="",
                    help="JSON passed as flex_attention's kernel_options (tile sizes, warps, stages), "
                         "e.g. the tiles a 99 KiB GPU gets; recorded in the JSON line")
    args = ap.parse_args()
    kopt = json.loads(args.kernel_options) if args.kernel_options else None
    a = json.load(open(args.anchors))
    S, NB, BS, NQ, NKV, D = (a[k] for k in ("S", "n_blocks", "block_size", "nq", "nkv", "head_dim"))
    dev = "cuda"
    anchor = torch.tensor(a["anchor"], dtype=torch.int32, device=dev)
    doc_start = torch.tensor(a["doc_start"], dtype=torch.int32, device=dev)
    valid = torch.tensor(a["valid"], dtype=torch.bool, device=dev)
    Lq, Lk = NB * BS, S + NB * BS
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, NQ, Lq, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, NKV, Lk, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, NKV, Lk, D, device=dev, dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, NQ, Lq, D, device=dev, dtype=torch.bfloat16, generator=g)
    scale = 1.0 / math.sqrt(D)
    flex = torch.compile(flex_attention)
    res = []
    for W in a.get("windows", [0, 2048]):
        def mask_mod(b, h, q_idx, kv_idx, W=W):
            blk = q_idx // BS
            qo = q_idx % BS
            anc = anchor[blk]
            ctx_ok = (kv_idx >= doc_start[blk]) & (kv_idx < anc)
            if W > 0:
                ctx_ok = ctx_ok & (kv_idx >= anc + qo - (W - 1))
            bj = kv_idx - S
            blk_ok = (bj >= 0) & (bj // BS == blk)
            if W > 0:
                blk_ok = blk_ok & (bj % BS <= qo)
            return valid[blk] & ((kv_idx < S) & ctx_ok | (kv_idx >= S) & blk_ok)

        bm = create_block_mask(mask_mod, 1, None, Lq, Lk, device=dev)
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True, kernel_options=kopt)

        def fwdbwd():
            o = flex(qg, kg, vg, block_mask=bm, scale=scale, enable_gqa=True, kernel_options=kopt)
            o.backward(do)

        tf = median_ms(fwd, args.reps)
        tfb = median_ms(fwdbwd, args.reps)
        # peak memory of one fwd+bwd (everything of the timed runs is allocated by now)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwdbwd()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        pairs = visible_pairs(a, W)
        ffl = 4.0 * D * pairs
        tb = tfb - tf
        res.append({"layer": "sliding" if W else "full", "window": W, "pairs": pairs,
                    "fwd_ms": round(tf, 4), "fwdbwd_ms": round(tfb, 4), "bwd_ms": round(tb, 4),
                    "fwd_tflops": round(ffl / tf * 1e-9, 2),
                    "bwd_tflops": round(2.5 * ffl / tb * 1e-9, 2) if tb > 0 else None,
                    "block_mask_sparsity": round(float(bm.sparsity()), 2),
                    "peak_fwdbwd_mib": round(peak / 2**20, 1),
                    "transient_fwdbwd_mib": round((peak - base) / 2**20, 1)})
    print(json.dumps({"bench": "flex_attention", "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name(), "kernel_options": kopt, "layers": res}))
    if args.ours:
        oj = json.load(open(args.ours))
        ours = {l["layer"]: l for l in oj[args.ours_key]}
        if args.title:
            print("ours against flex_attention, %s:" % args.title)
        print("%-8s %-5s %10s %10s %8s %10s %10s" %
              ("layer", "pass", "ours ms", "flex ms", "ours/flex", "ours TF/s", "flex TF/s"))
        for r in res:
            o = ours.get(r["layer"])
            if not o:
                continue
            for ps in ("fwd", "bwd"):
                print("%-8s %-5s %10.3f %10.3f %8.2f %10.1f %10.1f" %
                      (r["layer"], ps, o[ps + "_ms"], r[ps + "_ms"], o[ps + "_ms"] / r[ps + "_ms"],
                       o[ps + "_tflops"], r[ps + "_tflops"] or 0.0))
            print("%-8s %-5s %10.3f %10.3f %8.2f" %
                  (r["layer"], "f+b", o["fwd_ms"] + o["bwd_ms"], r["fwdbwd_ms"],
                   (o["fwd_ms"] + o["bwd_ms"]) / r["fwdbwd_ms"]))
        if "mem_tensors_workspace_mib" in oj:
            print("peak memory, MiB: ours %.1f in all (tensors + workspace), %.1f of it the backward's "
                  "workspace; flex fwd+bwd %s in all, %s of it transient" %
                  (oj["mem_tensors_workspace_mib"], oj["workspace_mib"],
                   " / ".join("%.1f (%s)" % (r["peak_fwdbwd_mib"], r["layer"]) for r in res),
                   " / ".join("%.1f (%s)" % (r["transient_fwdbwd_mib"], r["layer"]) for r in res)))


if __name__ == "__main__":
    main()
