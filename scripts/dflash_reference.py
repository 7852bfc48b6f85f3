#!/usr/bin/env python3
"""dflash_reference.py - an independent PyTorch implementation of the DFlash drafter
(docs/DRAFTER.md) for checking our C drafter: forward, loss and every gradient
(autograd) of one packed row with explicit anchors, in float64.

    python3 scripts/dflash_reference.py --out tests/fixtures/drafter_ref.safetensors
    python3 scripts/dflash_reference.py --config c --bf16 --out drafter_ref_c.safetensors

It writes the inputs (features, positions, anchors, block tokens, labels, loss weights, the
frozen embedding and head, every drafter weight by its docs/DRAFTER.md name) and the outputs
("loss", "grad.<name>" for every weight, "argmax") as F32/I32 tensors, the drafter config as
JSON in the metadata. tests/test_drafter_ref.c runs our CPU drafter on the same inputs.

The mask is built densely from docs/DRAFTER.md's rules (not from our code): for a query at offset
q of the block with anchor p (document [d0, d1)):
  context key j visible iff d0 <= j < p, and for sliding layers j >= p + q - (W - 1);
  block key (b', k) visible iff b' == b, and for sliding layers k <= q;
padding blocks see nothing (output 0). Labels/weights follow the recipe: position k >= 1
predicts ids[p + k] inside the document, w = loss_mask[p+k] * exp(-(k-1)/gamma).

Configs: a and b are small CPU shapes (odd head_dim, tiny vocab). c is a shape the CUDA drafter
runs (head_dim 64): hidden 256, GQA 4/2, intermediate 512, a sliding layer (W=24) then a full
one, block 8, vocab 1000, 3 target features, a packed row of 300 tokens in 3 documents (one of
14 tokens), 22 anchors (document starts, last tokens, near document ends, deep in a document where
the window cuts the context) + 2 padding blocks, loss mask zero on several spans. c's linear
weights are N(0, 1/fan_in) (unit gain, realistic activation scales) and every input (features,
embedding, head, weights) is bfloat16-representable, so a bf16 run sees exactly these values and
the comparison below measures arithmetic only, not input rounding.

--bf16 (for tests/test_gpu_drafter.c; KERNELS.md's tolerance rule: our bf16 error vs an fp64
reference at most ~2x the error of the same math done naively in bf16): besides the float64
results, the SAME step is run again "naively in bf16" and stored as "bf16.loss" [1] and
"bf16.grad.<name>" (F32 holding the bf16 values). Naive bf16 means: every tensor (weights,
features, embedding, head, loss weights) is cast to torch.bfloat16 and the identical code runs
on those tensors, so every op is PyTorch's own bf16 op and every intermediate result (each
matmul/einsum output, each RMSNorm step, RoPE, the scores, softmax, SiLU, logits, the CE, the
weighted sums) is a bf16 tensor; nothing is upcast by us (PyTorch's kernels may still accumulate
internally in fp32, e.g. a bf16 GEMM, a sum or a log_softmax, and round their output to bf16,
as any naive bf16 code gets). Autograd's backward likewise runs in bf16 (each gradient bf16,
contributions summed in bf16). Only RoPE's angles stay fp32 (inv_freq as HF computes it),
cast to bf16 after cos/sin. It runs on the CPU (deterministic), after the float64 step.
"""
import argparse
import json
import math

import torch
from safetensors.torch import save_file

torch.set_default_dtype(torch.float64)


def rmsnorm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    # x [T, heads, D], NeoX rotate-half over all D dims; angles in float32 as HF computes
    # inv_freq (then used in float64 here: the difference is far below the tolerance).
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    rot = torch.cat([-x2, x1], -1)
    return x * cos + rot * sin


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--config", choices=["a", "b", "c"], default="a",
                    help="a: 2 layers (sliding W=3, full), GQA 4/2, block 4, 2 documents; "
                         "b: 3 layers (full, sliding W=6, full), GQA 8/2, block 5, 3 documents; "
                         "c: a GPU shape: hidden 256, head_dim 64, 2 layers (sliding W=24, full), "
                         "GQA 4/2, block 8, vocab 1000, 300 tokens in 3 documents, 24 blocks")
    ap.add_argument("--bf16", action="store_true",
                    help="also run the step naively in bfloat16 (see the docstring): "
                         "bf16.loss, bf16.grad.<name>")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(a.seed)

    if a.config == "a":
        H, K, V, BS, NQ, NKV, D, F, W = 32, 2, 61, 4, 4, 2, 8, 48, 3
        layer_types = ["sliding_attention", "full_attention"]
        doc_bounds = [(0, 14), (14, 24)]
        anchors = [0, 5, 12, 14, 21, -1]   # -1 = padding block
    elif a.config == "b":
        H, K, V, BS, NQ, NKV, D, F, W = 24, 3, 53, 5, 8, 2, 6, 40, 6
        layer_types = ["full_attention", "sliding_attention", "full_attention"]
        doc_bounds = [(0, 9), (9, 10), (10, 31)]
        # the last token of a document (no label at all), a one-token document's
        # only token, anchors deep in a long document (the window cuts the context)
        anchors = [3, 8, 9, 10, 17, 26, 29, -1, -1]
    else:
        H, K, V, BS, NQ, NKV, D, F, W = 256, 3, 1000, 8, 4, 2, 64, 512, 24
        layer_types = ["sliding_attention", "full_attention"]
        doc_bounds = [(0, 136), (136, 150), (150, 300)]
        # document starts (0, 136, 150), near document ends (129: the last label falls
        # outside; 133, 146, 296), last tokens (135, 149: no label at all), the token after
        # a start (151), deep in the documents (the window W=24 cuts the context), 2 padding
        anchors = [0, 17, 30, 58, 77, 96, 110, 129, 133, 135,
                   136, 140, 146, 149,
                   150, 151, 175, 203, 240, 271, 292, 296, -1, -1]
    L = len(layer_types)
    gamma, eps, theta, mask_id = 7.0, 1e-6, 10000.0, 1
    S = doc_bounds[-1][1]
    NB = len(anchors)

    ids = torch.randint(2, V, (S,), generator=g)
    loss_mask = torch.ones(S, dtype=torch.long)
    loss_mask[2:4] = 0
    loss_mask[17] = 0
    if a.config == "c":
        loss_mask[20:34] = 0      # inside blocks 17 and 30
        loss_mask[143] = 0        # the short document
        loss_mask[180:200] = 0    # the tail of block 175
        loss_mask[298] = 0
    ctx_pos = torch.zeros(S, dtype=torch.long)
    doc_of = torch.zeros(S, dtype=torch.long)
    for di, (s0, s1) in enumerate(doc_bounds):
        ctx_pos[s0:s1] = torch.arange(s1 - s0)
        doc_of[s0:s1] = di

    anchor, doc_start, valid = [], [], []
    block_ids, block_pos, labels, weights = [], [], [], []
    for p in anchors:
        if p < 0:
            anchor.append(0); doc_start.append(0); valid.append(0)
            for k in range(BS):
                block_ids.append(mask_id); block_pos.append(k); labels.append(-1); weights.append(0.0)
            continue
        d0, d1 = doc_bounds[int(doc_of[p])]
        anchor.append(p); doc_start.append(d0); valid.append(1)
        for k in range(BS):
            block_ids.append(int(ids[p]) if k == 0 else mask_id)
            block_pos.append(int(ctx_pos[p]) + k)
            if k >= 1 and p + k < d1:
                labels.append(int(ids[p + k]))
                weights.append(float(loss_mask[p + k]) * math.exp(-(k - 1) / gamma))
            else:
                labels.append(-1); weights.append(0.0)
    N = NB * BS
    block_ids_t = torch.tensor(block_ids)
    block_pos_t = torch.tensor(block_pos)
    labels_t = torch.tensor(labels)
    weights_t = torch.tensor(weights)

    # every input is float32-representable, so the C side sees exactly these values
    # (config c: bfloat16-representable, so a bf16 run sees them exactly too)
    f32 = lambda t: t.float().double()
    if a.config == "c":
        f32 = lambda t: t.to(torch.bfloat16).double()
        weights_t = f32(weights_t)
    # linear weights N(0, 0.2^2) (a, b) or N(0, 1/fan_in) (c); head 0.5 (a, b) or 0.2 (c)
    lin_std = (lambda i: 0.2) if a.config != "c" else (lambda i: 1.0 / math.sqrt(i))
    head_std = 0.5 if a.config != "c" else 0.2
    feat = f32(torch.randn(S, K * H, generator=g))
    embed = f32(0.5 * torch.randn(V, H, generator=g))
    head = f32(head_std * torch.randn(V, H, generator=g))

    params = {}
    def lin(name, o, i):
        params[name] = f32(lin_std(i) * torch.randn(o, i, generator=g)).requires_grad_()
    def norm(name, n):
        params[name] = f32(1.0 + 0.2 * torch.randn(n, generator=g)).requires_grad_()
    lin("fc.weight", H, K * H)
    norm("hidden_norm.weight", H)
    for l in range(L):
        pre = f"layers.{l}."
        norm(pre + "input_layernorm.weight", H)
        lin(pre + "self_attn.q_proj.weight", NQ * D, H)
        lin(pre + "self_attn.k_proj.weight", NKV * D, H)
        lin(pre + "self_attn.v_proj.weight", NKV * D, H)
        lin(pre + "self_attn.o_proj.weight", H, NQ * D)
        norm(pre + "self_attn.q_norm.weight", D)
        norm(pre + "self_attn.k_norm.weight", D)
        norm(pre + "post_attention_layernorm.weight", H)
        lin(pre + "mlp.gate_proj.weight", F, H)
        lin(pre + "mlp.up_proj.weight", F, H)
        lin(pre + "mlp.down_proj.weight", H, F)
    norm("norm.weight", H)

    # the mask [N, S + N] per layer type
    def build_mask(window):
        m = torch.zeros(N, S + N, dtype=torch.bool)
        for b in range(NB):
            if not valid[b]:
                continue
            p, d0 = anchor[b], doc_start[b]
            for q in range(BS):
                i = b * BS + q
                for j in range(d0, p):
                    if window == 0 or j >= p + q - (window - 1):
                        m[i, j] = True
                for k in range(BS):
                    if window == 0 or k <= q:
                        m[i, S + b * BS + k] = True
        return m
    masks = {w: build_mask(w) for w in {W if t == "sliding_attention" else 0 for t in layer_types}}

    # One step: forward, loss, backward (gradients land in P[name].grad). Everything is
    # computed in the dtype of the tensors passed in (float64, or bfloat16 for --bf16).
    def step(P, feat, embed, head, weights_t):
        C = rmsnorm(feat @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
        x = embed[block_ids_t].clone()
        for l in range(L):
            pre = f"layers.{l}."
            window = W if layer_types[l] == "sliding_attention" else 0
            mask = masks[window]
            a_ = rmsnorm(x, P[pre + "input_layernorm.weight"], eps)
            q = (a_ @ P[pre + "self_attn.q_proj.weight"].T).view(N, NQ, D)
            q = rope(rmsnorm(q, P[pre + "self_attn.q_norm.weight"], eps), block_pos_t, theta)
            kc = (C @ P[pre + "self_attn.k_proj.weight"].T).view(S, NKV, D)
            kb = (a_ @ P[pre + "self_attn.k_proj.weight"].T).view(N, NKV, D)
            kc = rope(rmsnorm(kc, P[pre + "self_attn.k_norm.weight"], eps), ctx_pos, theta)
            kb = rope(rmsnorm(kb, P[pre + "self_attn.k_norm.weight"], eps), block_pos_t, theta)
            vc = (C @ P[pre + "self_attn.v_proj.weight"].T).view(S, NKV, D)
            vb = (a_ @ P[pre + "self_attn.v_proj.weight"].T).view(N, NKV, D)
            k = torch.cat([kc, kb], 0).repeat_interleave(NQ // NKV, dim=1)   # [S+N, NQ, D]
            v = torch.cat([vc, vb], 0).repeat_interleave(NQ // NKV, dim=1)
            scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(D)
            # a large finite fill instead of -inf, and rows that see nothing (padding
            # blocks) multiplied by 0: output 0 and zero gradients, no NaN anywhere
            scores = scores.masked_fill(~mask[None], -1e30)
            probs = torch.softmax(scores, -1) * mask.any(-1)[None, :, None]
            o = torch.einsum("hij,jhd->ihd", probs, v).reshape(N, NQ * D)
            x = x + o @ P[pre + "self_attn.o_proj.weight"].T
            bb = rmsnorm(x, P[pre + "post_attention_layernorm.weight"], eps)
            gg = bb @ P[pre + "mlp.gate_proj.weight"].T
            uu = bb @ P[pre + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gg) * uu) @ P[pre + "mlp.down_proj.weight"].T
        h = rmsnorm(x, P["norm.weight"], eps)
        logits = h @ head.T
        lab = labels_t.clamp(min=0)
        ce = torch.nn.functional.cross_entropy(logits, lab, reduction="none")
        wt = weights_t * (labels_t >= 0)
        loss = (wt * ce).sum() / wt.sum()
        loss.backward()
        return loss, logits, wt

    loss, logits, wt = step(params, feat, embed, head, weights_t)
    print(f"loss {loss.item():.8f}, sum of weights {wt.sum().item():.6f}")

    cfg = {"hidden_size": H, "num_target_features": K, "vocab_size": V, "block_size": BS,
           "num_attention_heads": NQ, "num_key_value_heads": NKV, "head_dim": D,
           "intermediate_size": F, "num_hidden_layers": L, "sliding_window": W,
           "layer_types": layer_types, "rms_norm_eps": eps, "rope_theta": theta,
           "mask_token_id": mask_id, "gamma": gamma}
    out = {
        "feat": feat.float(), "ctx_pos": ctx_pos.int(), "anchor": torch.tensor(anchor).int(),
        "doc_start": torch.tensor(doc_start).int(), "valid": torch.tensor(valid).int(),
        "block_ids": block_ids_t.int(), "block_pos": block_pos_t.int(), "labels": labels_t.int(),
        "weights": weights_t.float(), "embed": embed.float(), "head": head.float(),
        "loss": loss.detach().reshape(1).float(), "argmax": logits.argmax(-1).int(),
    }
    for n, t in params.items():
        out["param." + n] = t.detach().float()
        out["grad." + n] = t.grad.float()

    if a.bf16:
        # the same step, naively in bf16 (see the docstring); inputs cast, nothing upcast
        bf = lambda t: t.detach().to(torch.bfloat16)
        P16 = {n: bf(t).requires_grad_() for n, t in params.items()}
        loss16, _, _ = step(P16, bf(feat), bf(embed), bf(head), bf(weights_t))
        assert loss16.dtype == torch.bfloat16
        print(f"bf16 loss {loss16.item():.8f} (fp64 {loss.item():.8f}, "
              f"|diff| {abs(loss16.item() - loss.item()):.3e})")
        out["bf16.loss"] = loss16.detach().reshape(1).float()
        for n, t in P16.items():
            assert t.grad is not None and t.grad.dtype == torch.bfloat16, n
            out["bf16.grad." + n] = t.grad.float()

    made_by = "scripts/dflash_reference.py --config %s --seed %d" % (a.config, a.seed)
    if a.bf16:
        made_by += " --bf16"
    meta = {"config": json.dumps(cfg), "torch": torch.__version__, "made_by": made_by}
    save_file({k: v.contiguous() for k, v in out.items()}, a.out, metadata=meta)
    print("wrote", a.out, len(out), "tensors")


if __name__ == "__main__":
    main()
