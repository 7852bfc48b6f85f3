#!/usr/bin/env python3
"""bench_sdpa_fa2.py - a yardstick for the portable (mma.sync) attention: PyTorch's built-in
FlashAttention-2 (scaled_dot_product_attention restricted to SDPBackend.FLASH_ATTENTION) on
dense attention at the drafter's head shape (32 query / 8 KV heads x 128, bf16).

FlashAttention-2 runs mma.sync on every GPU from sm_80 on, so its TFLOP/s on a GPU is what a
"FlashAttention-2-class" kernel reaches there. Dense attention is its best case: the DFlash mask
(16-query blocks, each with its own context span) only adds work per visible pair.

TFLOP/s count visible pairs like tools/bench_dflash_attn: forward 4*D FLOPs per pair per query
head, backward 2.5x that (backward = fwd+bwd minus fwd, medians of --reps with CUDA events).
Prints the kernels one fwd+bwd launched (so the backend is seen, not assumed), then one line per
shape and a JSON line.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_flex_dflash import median_ms  # (the same timing as the flex baseline)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nq", type=int, default=32)
    ap.add_argument("--nkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--shapes", default="4x4096c,2x4096n,2x8192c,8x2048c",
                    help="BATCHxLEN then c (causal) or n (no mask), comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = "cuda"
    NQ, NKV, D = args.nq, args.nkv, args.head_dim
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    rows = []
    for spec in args.shapes.split(","):
        bl, kind = spec[:-1], spec[-1]
        B, L = (int(x) for x in bl.split("x"))
        causal = kind == "c"
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, NQ, L, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, NKV, L, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, NKV, L, D, device=dev, dtype=torch.bfloat16, generator=g)
        dout = torch.randn(B, NQ, L, D, device=dev, dtype=torch.bfloat16, generator=g)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

        def fwd():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        def fwdbwd():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=True)
            o.backward(dout)

        if not rows:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fwdbwd()
                torch.cuda.synchronize()
            names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
            print("kernels of one fwd+bwd:")
            for n in names:
                print("  ", n[:160])
        tf = median_ms(fwd, args.reps)
        tfb = median_ms(fwdbwd, args.reps)
        tb = tfb - tf
        pairs = B * NQ * (L * (L + 1) // 2 if causal else L * L)
        ffl = 4.0 * D * pairs
        r = {"batch": B, "len": L, "causal": causal, "fwd_ms": round(tf, 4), "bwd_ms": round(tb, 4),
             "fwd_tflops": round(ffl / tf * 1e-9, 1), "bwd_tflops": round(2.5 * ffl / tb * 1e-9, 1)}
        rows.append(r)
        print(f"{B}x{L} {'causal' if causal else 'full  '}: fwd {tf:.3f} ms {r['fwd_tflops']:6.1f} TFLOP/s"
              f"   bwd {tb:.3f} ms {r['bwd_tflops']:6.1f} TFLOP/s")
        del q, k, v, dout, qg, kg, vg
        torch.cuda.empty_cache()
    print(json.dumps({"sdpa_fa2": rows, "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
