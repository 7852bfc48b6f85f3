#!/usr/bin/env python3
"""make_demo_target.py OUT - the demo's small target, trained, and its own completions.

The README's first command trains a drafter on a bundled target. A drafter only shows learning
that transfers to held-out text if the target's text has structure, so the demo target is a tiny
Qwen3 (Qwen3ForCausalLM, same shape as data/tiny-qwen3: hidden 64, 4 layers, vocab 512; ~0.5 MB
in bf16) trained here on a synthetic code-like language, then asked for greedy completions of
held-out prompts of the same language. Writes OUT/{config.json, generation_config.json,
model.safetensors, corpus.jsonl, eval.jsonl, corpus_stats.json}.

The language (ids; 0..2 never appear, 1 is the drafter's mask token): 16 keywords, 17
punctuation marks (newline and indent among them), numbers 0..127, 348 identifiers. A program
draws a pool of 4-8 variable names and emits statements: assignments, binary expressions,
function definitions (def NAME ( a , b ) : NL INDENT return a OP b NL), calls of the functions
it defined, for-loops over arithmetic progressions, if/else blocks, and verbatim repeats of a
recent statement. What a drafter can learn from the target's completions: the syntax, the
counting, and copying names from context.

Reproducible: the language, the data and the initial weights come from fixed seeds; training
runs with torch's deterministic algorithms (CUBLAS_WORKSPACE_CONFIG set here), so the same torch,
transformers and GPU kind give the same weights. Needs torch and transformers (GPU optional: on a
CPU it takes a few minutes longer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

VOCAB = 512
KEYWORDS = ["def", "return", "for", "in", "if", "else", "while", "print", "class", "self", "import",
            "from", "as", "with", "yield", "lambda"]
PUNCT = ["(", ")", ",", ":", ";", "=", "+", "-", "*", "[", "]", "==", "<", ">", ".", "NL", "INDENT"]
KW = {k: 3 + i for i, k in enumerate(KEYWORDS)}
P = {p: 3 + len(KEYWORDS) + i for i, p in enumerate(PUNCT)}
NUM0 = 3 + len(KEYWORDS) + len(PUNCT)  # 36: the number 0
NUMS = 128
ID0 = NUM0 + NUMS  # 164
IDS = list(range(ID0, VOCAB))
OPS = [P["+"], P["-"], P["*"]]

SEED_DATA, SEED_INIT, SEED_CORPUS, SEED_EVAL = 7, 11, 1001, 2002
SEQ, BATCH, STEPS, LR, WARMUP = 256, 64, 4000, 3e-3, 200
POOL = 24000  # training programs (SEQ + 1 tokens each), drawn once
N_CORPUS, N_EVAL, NEW_TOKENS = 512, 64, 64
PROMPT_LENS = (24, 32, 40, 48, 56)
SHAPE = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def num(n):
    return NUM0 + (n % NUMS)


def program(rng, length):
    """One program of exactly `length` tokens (the last statement cut)."""
    pool = rng.sample(IDS, rng.randint(4, 8))
    funcs, stmts, out = [], [], []
    while len(out) < length:
        r = rng.random()
        if r < 0.15 and stmts:
            s = list(rng.choice(stmts[-6:]))
        elif r < 0.28:
            name = rng.choice(IDS)
            a, b = rng.sample(pool, 2)
            s = [KW["def"], name, P["("], a, P[","], b, P[")"], P[":"], P["NL"], P["INDENT"],
                 KW["return"], a, rng.choice(OPS), b, P["NL"]]
            funcs.append(name)
        elif r < 0.42 and funcs:
            s = [rng.choice(pool), P["="], rng.choice(funcs[-4:]), P["("], rng.choice(pool), P[","],
                 num(rng.randint(0, 99)), P[")"], P["NL"]]
        elif r < 0.58:
            v, start, step, k = rng.choice(pool), rng.randint(0, 100), rng.choice((1, 1, 2, 5)), rng.randint(3, 6)
            s = [KW["for"], v, KW["in"], P["["]]
            for i in range(k):
                s += ([P[","]] if i else []) + [num(start + i * step)]
            s += [P["]"], P[":"], P["NL"], P["INDENT"], KW["print"], P["("], v, P[")"], P["NL"]]
        elif r < 0.74:
            s = [rng.choice(pool), P["="], num(rng.randint(0, 127)), P["NL"]]
        elif r < 0.90:
            a, b = rng.sample(pool, 2)
            s = [rng.choice(pool), P["="], a, rng.choice(OPS), b, P["NL"]]
        else:
            a, b = rng.sample(pool, 2)
            s = [KW["if"], a, P["<"], b, P[":"], P["NL"], P["INDENT"], KW["print"], P["("], a, P[")"],
                 P["NL"], KW["else"], P[":"], P["NL"], P["INDENT"], KW["print"], P["("], b, P[")"], P["NL"]]
        out += s
        stmts.append(s)
    return out[:length]


def prompts(seed, n):
    rng = random.Random(seed)
    return [program(rng, rng.choice(PROMPT_LENS)) for _ in range(n)]


def corpus_line(prompt, completion):
    return json.dumps({"input_ids": prompt + completion,
                       "loss_mask": [0] * len(prompt) + [1] * len(completion)}, separators=(",", ":"))


def distinct_fraction(seq, n=1):
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--check-language", action="store_true",
                    help="print a program and the language's sizes, then stop (no torch needed)")
    a = ap.parse_args()
    if a.check_language:
        rng = random.Random(SEED_DATA)
        p = program(rng, 80)
        assert all(3 <= t < VOCAB for t in p) and len(p) == 80
        print(f"keywords {len(KEYWORDS)}, punctuation {len(PUNCT)}, numbers {NUMS} from id {NUM0}, "
              f"identifiers {len(IDS)} from id {ID0}")
        print(p)
        return 0

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(a.out, exist_ok=True)
    log = lambda *x: print("[make_demo_target]", *x, flush=True)  # noqa: E731
    t0 = time.time()

    rng = random.Random(SEED_DATA)
    data = torch.tensor([program(rng, SEQ + 1) for _ in range(POOL)], dtype=torch.long)
    hrng = random.Random(SEED_EVAL + 7)
    held = torch.tensor([program(hrng, SEQ + 1) for _ in range(64)], dtype=torch.long)
    log(f"{POOL} training programs of {SEQ + 1} tokens drawn in {time.time() - t0:.1f} s; device {dev}")

    kw = dict(vocab_size=VOCAB, **SHAPE, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6,
              tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    try:
        cfg = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **kw)
    except Exception:  # noqa: BLE001 - older transformers
        cfg = Qwen3Config(rope_theta=1e6, **kw)
    torch.manual_seed(SEED_INIT)
    model = Qwen3ForCausalLM(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(SEED_DATA)

    def lr_at(s):
        if s < WARMUP:
            return LR * (s + 1) / WARMUP
        return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / max(1, a.steps - WARMUP))))

    def held_loss():
        model.eval()
        with torch.no_grad():
            x = held.to(dev)
            out = model(input_ids=x[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))
            acc = (out.argmax(-1) == x[:, 1:]).float().mean()
        model.train()
        return loss.item(), acc.item()

    model.train()
    for s in range(a.steps):
        idx = torch.randint(0, POOL, (BATCH,), generator=g)
        x = data[idx].to(dev)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(s)
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (s + 1) % 500 == 0 or s == 0:
            hl, ha = held_loss()
            log(f"step {s + 1}: train loss {loss.item():.3f}, held-out loss {hl:.3f}, next-token acc {ha:.3f} "
                f"({time.time() - t0:.0f} s)")
    final_loss, final_acc = held_loss()

    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=2,
                                               bos_token_id=None)
    model.save_pretrained(a.out)

    gc = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=2,
                          bos_token_id=None)
    stats = {}
    for fname, seed, n in (("corpus.jsonl", SEED_CORPUS, N_CORPUS), ("eval.jsonl", SEED_EVAL, N_EVAL)):
        ps = prompts(seed, n)
        comps = [None] * n
        by_len = {}
        for i, p in enumerate(ps):
            by_len.setdefault(len(p), []).append(i)
        t1 = time.time()
        for L, idx in sorted(by_len.items()):
            x = torch.tensor([ps[i] for i in idx], dtype=torch.long, device=dev)
            with torch.no_grad():
                y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
            assert y.shape[1] == L + NEW_TOKENS, y.shape
            for j, i in enumerate(idx):
                comps[i] = y[j, L:].tolist()
        with open(os.path.join(a.out, fname), "w") as f:
            for p, c in zip(ps, comps):
                f.write(corpus_line(p, c) + "\n")
        d1 = [distinct_fraction(c, 1) for c in comps]
        d4 = [distinct_fraction(c, 4) for c in comps]
        stats[fname] = {"records": n, "seed": seed, "prompt_tokens": sum(map(len, ps)),
                        "completion_tokens": sum(map(len, comps)),
                        "distinct_token_fraction_mean": round(sum(d1) / n, 4),
                        "distinct_4gram_fraction_mean": round(sum(d4) / n, 4),
                        "completions_with_ids_0_1_2": sum(1 for c in comps if any(t < 3 for t in c)),
                        "generate_seconds": round(time.time() - t1, 2)}
        log(f"{fname}: {json.dumps(stats[fname])}")
    import transformers
    stats["target"] = {"steps": a.steps, "batch": BATCH, "seq": SEQ, "lr": LR, "warmup": WARMUP,
                       "held_out_loss": round(final_loss, 4), "held_out_next_token_acc": round(final_acc, 4),
                       "parameters": sum(p.numel() for p in model.parameters()),
                       "train_seconds": round(time.time() - t0, 1), "device": dev,
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "command": " ".join(sys.argv)}
    with open(os.path.join(a.out, "corpus_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
        f.write("\n")
    log(f"done in {time.time() - t0:.0f} s: held-out loss {final_loss:.3f}, next-token acc {final_acc:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
