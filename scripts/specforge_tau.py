#!/usr/bin/env python3
"""specforge_tau.py - real acceptance lengths (tau) of DFlash drafters, by speculative decoding.

What tau_hat (the trainer's teacher-forced estimate) stands for, measured for real: each drafter
runs SpecForge's own DFlashDraftModel.spec_generate (greedy) against the target (HF transformers),
and every verification of the target is scored exactly as spec_generate scores it:
acceptance = leading draft tokens equal to the target's argmax, tau = mean(acceptance + 1), the
tokens one target forward yields. Then the same decoded text is scored teacher-forced at every
position (one full-sequence target forward per prompt, one drafter forward per position): the plain
mean of the acceptance lengths (what the trainer's tau_hat estimates from evenly spread anchors),
their harmonic mean, and a walk from anchor to anchor as decoding goes (what the trainer's eval
tau_walk computes), which should give the measured tau back. Optionally it first trains a drafter with SpecForge's own
training code (OnlineDFlashModel: anchor sampling, block masks, decayed CE; BF16Optimizer: fp32
master AdamW, clip, warmup + cosine) on the same corpus, as the comparison issue 7 asks for.

GPU machine only (torch, transformers). Nothing of SpecForge is reimplemented: its files come
from --src (.anchors_src) through the loader of bench_dflash_torch.py, the PyTorch baseline of
SpecForge's DFlash step that scripts/bench-train.sh also runs (not part of this repository: give its
folder with --bench-dir or $BENCH_DIR; default .device/bench); it also builds the draft Qwen3Config
the way SpecForge does.

  --drafter NAME=DIR     our export (config.json + model.safetensors), repeatable. Loaded into
                         SpecForge's DFlashDraftModel with load_state_dict(strict=True): the
                         export's tensor names and shapes are checked against SpecForge's class.
  --train-corpus F       train a SpecForge drafter (named "specforge") of the first drafter's
                         architecture on F (JSONL or .xz: input_ids, loss_mask), --steps steps of
                         --batch records padded to one length (the corpus's longest, rounded up
                         to 128), --anchors anchors per record, target hidden states computed
                         online (HF output_hidden_states, the drafter's target_layer_ids with
                         SpecForge's offset 1: our extractor's convention).
  --eval-corpus F        prompts: the tokens of a record before its first loss_mask 1; the
                         first --prompts records that have one; up to --max-new-tokens each.

RoPE: our drafters keep an fp32 inv_freq in SpecForge's class (our trainer's numerics); the
SpecForge-trained one is cast to bf16 whole, as SpecForge's own code does (train and decode alike).

Sliding-window layers: spec_generate passes no mask, so a sliding layer attends like a full one
there (SpecForge's inference does the same); the script says so when a drafter has one. Train the
compared drafters with full layers for an exact comparison.

Prints one line per drafter and a JSON object last (--json-out writes it too). Exit status 0, 1
on failure, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import lzma
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's HF folder (e.g. qwen3-code-8m)")
    p.add_argument("--eval-corpus", required=True, help="JSONL(.xz) records with input_ids, loss_mask")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                   help="an exported drafter (config.json + model.safetensors); repeatable")
    p.add_argument("--train-corpus", default=None, help="also train a SpecForge drafter on this corpus")
    p.add_argument("--steps", type=int, default=2000, help="SpecForge training steps (default 2000)")
    p.add_argument("--batch", type=int, default=16, help="records per SpecForge step (default 16)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup", type=float, default=0.04, help="warmup fraction (default 0.04)")
    p.add_argument("--anchors", type=int, default=64,
                   help="num_anchors per record (default 64: about what our trainer's 512 per 4096-token "
                        "row of ~10 documents gives each document)")
    p.add_argument("--gamma", type=float, default=7.0, help="loss decay gamma (default 7)")
    p.add_argument("--prompts", type=int, default=64, help="eval prompts (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default 128)")
    p.add_argument("--src", default=None, help="SpecForge files (default: $ANCHORS_SRC, .anchors_src)")
    p.add_argument("--bench-dir", default=None,
                   help="folder of bench_dflash_torch.py (default: $BENCH_DIR, else .device/bench)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    for d in a.drafter:
        if "=" not in d or not d.split("=", 1)[0] or not d.split("=", 1)[1]:
            p.error(f"--drafter {d!r}: want NAME=DIR")
    if not a.drafter:
        p.error("at least one --drafter (the architecture a SpecForge drafter is trained with)")
    if a.steps < 1 or a.batch < 1 or a.prompts < 1 or a.max_new_tokens < 1:
        p.error("--steps, --batch, --prompts, --max-new-tokens must be >= 1")
    return a


def read_records(path):
    """input_ids / loss_mask lists of a JSONL file (xz-compressed when it ends in .xz)."""
    opener = lzma.open if str(path).endswith(".xz") else open
    out = []
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            ids = r["input_ids"]
            lm = r.get("loss_mask") or [1] * len(ids)
            if len(lm) != len(ids):
                raise SystemExit(f"{path}:{n}: loss_mask has {len(lm)} entries, input_ids {len(ids)}")
            out.append((ids, lm))
    return out


def load_bench(bench_dir):
    d = Path(bench_dir or os.environ.get("BENCH_DIR") or ROOT / ".device" / "bench")
    f = d / "bench_dflash_torch.py"
    if not f.is_file():
        raise SystemExit(f"specforge_tau: {f} not found: give the folder of bench_dflash_torch.py "
                         "(the SpecForge-step baseline, not part of this repository) with --bench-dir "
                         "DIR or BENCH_DIR=DIR")
    spec = importlib.util.spec_from_file_location("bench_dflash_torch", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def preset_from_export(cfg, target_cfg):
    """bench_dflash_torch's preset keys from our export's config.json."""
    dc = cfg.get("dflash_config", {})
    return dict(
        hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        rope_theta=float(cfg.get("rope_theta", 1e6)), rms_norm_eps=cfg["rms_norm_eps"],
        max_position_embeddings=max(cfg.get("max_position_embeddings", 0),
                                    target_cfg.get("max_position_embeddings", 0)),
        block_size=cfg.get("block_size", dc.get("block_size")), mask_token_id=dc["mask_token_id"],
        target_layer_ids=list(dc["target_layer_ids"]), num_target_layers=cfg["num_target_layers"],
        sliding_window=cfg.get("sliding_window") or 0, layer_types=list(cfg["layer_types"]),
    )


def main(argv=None):
    args = parse_args(argv)
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    bench = load_bench(args.bench_dir)
    src = bench.find_src(args.src)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    dflash_mod, fam_mod, opt_mod, _ = bench.load_specforge(src)
    dev = torch.device("cuda", torch.cuda.current_device())
    try:  # as SpecForge's package import chain (and bench_dflash_torch.py) does
        torch._dynamo.config.recompile_limit = 64
    except Exception:
        pass
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).to(dev).eval()
    target.requires_grad_(False)
    target_cfg = json.load(open(Path(args.target) / "config.json"))
    pad = target_cfg.get("pad_token_id")
    if pad is None:
        raise SystemExit(f"{args.target}: config.json has no pad_token_id (needed to pad batches)")

    def build(P, attn, rope_fp32):
        """SpecForge's draft model in bf16. rope_fp32: keep the RoPE inv_freq buffers fp32, as our
        trainer computes them (a bf16 inv_freq is off by up to ~0.4%: radians at position 400);
        SpecForge's own drafter gets what SpecForge does, .to(bf16) of everything."""
        cfg, _notes = bench.build_draft_config(dflash_mod.Qwen3Config, P, attn)
        with torch.device(dev):
            m = dflash_mod.DFlashDraftModel(cfg)
        keep = {n: b.detach().clone() for n, b in m.named_buffers() if n.endswith("inv_freq")}
        m = m.to(device=dev, dtype=torch.bfloat16)
        if rope_fp32:
            for n, b in keep.items():
                mod, _, leaf = n.rpartition(".")
                m.get_submodule(mod)._buffers[leaf] = b
        return m

    drafters, presets = {}, {}
    for spec in args.drafter:
        name, d = spec.split("=", 1)
        cfg = json.load(open(Path(d) / "config.json"))
        P = preset_from_export(cfg, target_cfg)
        m = build(P, "sdpa", rope_fp32=True)
        sd = load_file(str(Path(d) / "model.safetensors"), device=str(dev))
        missing, unexpected = m.load_state_dict(sd, strict=False)
        missing = [k for k in missing if "rotary_emb" not in k]  # buffers, not weights
        if missing or unexpected:
            raise SystemExit(f"{d}: not SpecForge's DFlashDraftModel layout: missing {missing[:8]}, "
                             f"unexpected {unexpected[:8]}")
        drafters[name], presets[name] = m, P
        print(f"[specforge_tau] {name}: {d} loaded into SpecForge's DFlashDraftModel "
              f"(every tensor name and shape matched; {len(sd)} tensors; layers {P['layer_types']})",
              flush=True)

    result = {"target": str(args.target), "specforge_src": str(src), "drafters": {}}

    if args.train_corpus:
        P = dict(presets[next(iter(presets))])
        recs = [r for r in read_records(args.train_corpus) if sum(r[1][1:]) > 0]
        draft = build(P, "flex_attention", rope_fp32=False)
        model = fam_mod.OnlineDFlashModel(
            draft_model=draft, target_lm_head=target.lm_head,
            target_embed_tokens=target.model.embed_tokens, mask_token_id=P["mask_token_id"],
            block_size=P["block_size"], attention_backend="flex_attention",
            num_anchors=args.anchors, loss_decay_gamma=args.gamma, objective_chunk_blocks=128,
            loss_type="dflash").to(device=dev, dtype=torch.bfloat16)
        model.train()
        optimizer = opt_mod.BF16Optimizer(model, lr=args.lr, max_grad_norm=1.0, total_steps=args.steps,
                                          warmup_ratio=args.warmup, lr_scheduler="cosine")
        # one padded length and (with --anchors below every record's candidates) one anchor
        # count: flex_attention is compiled for static shapes, a new shape recompiles
        S = (max(len(r[0]) for r in recs) + 127) // 128 * 128
        order, pos, epoch = [], 0, 0
        losses, accs = [], []
        t0 = time.perf_counter()
        for step in range(args.steps):
            batch = []
            while len(batch) < args.batch:
                if pos >= len(order):
                    order = list(range(len(recs)))
                    random.Random(args.seed * 1000003 + epoch).shuffle(order)
                    pos, epoch = 0, epoch + 1
                batch.append(recs[order[pos]])
                pos += 1
            ids = torch.full((len(batch), S), pad, dtype=torch.long)
            lm = torch.zeros((len(batch), S), dtype=torch.float32)
            for i, (x, m_) in enumerate(batch):
                ids[i, :len(x)] = torch.tensor(x)
                lm[i, :len(m_)] = torch.tensor(m_, dtype=torch.float32)
            ids, lm = ids.to(dev), lm.to(dev)
            with torch.no_grad():
                out = target(input_ids=ids, attention_mask=(ids != pad).long(), output_hidden_states=True)
                hs = dflash_mod.extract_context_feature(out.hidden_states, draft.target_layer_ids)
            loss, acc, _m = model(input_ids=ids, hidden_states=hs, loss_mask=lm)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            accs.append(float(acc.detach()))
            if (step + 1) % max(1, args.steps // 10) == 0 or step + 1 == args.steps:
                k = max(1, args.steps // 10)
                print(f"[specforge_tau] specforge train step {step + 1}/{args.steps}: loss "
                      f"{statistics.mean(losses[-k:]):.4f} acc {statistics.mean(accs[-k:]):.4f} "
                      f"epoch {epoch} ({time.perf_counter() - t0:.0f} s)", flush=True)
        draft.eval()
        draft.config._attn_implementation = "sdpa"
        drafters["specforge"] = draft
        presets["specforge"] = P
        result["specforge_train"] = dict(
            steps=args.steps, batch=args.batch, records=len(recs), padded_len=S, epochs=round(args.steps * args.batch / len(recs), 2),
            lr=args.lr, warmup=args.warmup, anchors=args.anchors, gamma=args.gamma,
            seconds=round(time.perf_counter() - t0, 1), final_loss=statistics.mean(losses[-50:]),
            final_acc=statistics.mean(accs[-50:]))
        del model, optimizer

    # Every decode-step verification of the target, scored as spec_generate scores it.
    accepted = []

    def verify_hook(module, a, kw, out):
        ids = a[0] if a else kw.get("input_ids")
        if ids is None or "logits_to_keep" in kw or out.logits.shape[1] != ids.shape[1]:
            return  # the prefill (logits_to_keep=1)
        post = out.logits.argmax(dim=-1)
        n = (ids[:, 1:] == post[:, :-1]).long().cumprod(dim=1).sum(dim=1)
        accepted.extend(int(x) for x in n)

    prompts = []
    for ids, lm in read_records(args.eval_corpus):
        first = next((i for i, v in enumerate(lm) if v), None)
        if first is not None and first > 0:
            prompts.append((ids[:first], ids[first:]))
        if len(prompts) == args.prompts:
            break
    @torch.inference_mode()
    def teacher_forced(m, seq, start):
        """Accepted drafts at every anchor a in [start, len(seq) - 1) of a decoded sequence, the
        drafter run as spec_generate runs it (context = the target's features before a, block =
        seq[a] + masks) on one full-sequence target forward: the acceptance each position would
        give, whether or not decoding put an anchor there."""
        ids = torch.tensor([seq], dtype=torch.long, device=dev)
        feats = dflash_mod.extract_context_feature(
            target(ids, output_hidden_states=True).hidden_states, m.target_layer_ids)
        bs, acc = m.block_size, {}
        for a in range(start, len(seq) - 1):
            blk = torch.full((1, bs), m.mask_token_id, dtype=torch.long, device=dev)
            blk[0, 0] = seq[a]
            h = m(target_hidden=feats[:, :a], noise_embedding=target.model.embed_tokens(blk),
                  position_ids=torch.arange(a + bs, device=dev).unsqueeze(0), is_causal=False)
            draft = target.lm_head(h[:, 1:, :]).argmax(dim=-1)[0].tolist()
            n = 0
            for x, y in zip(draft, seq[a + 1:a + bs]):
                if x != y:
                    break
                n += 1
            acc[a] = n
        return acc

    def save():  # after every drafter: a run cut short (a timeout) keeps the ones it finished
        if args.json_out:
            tmp = Path(args.json_out + ".tmp")
            tmp.write_text(json.dumps(result) + "\n")
            tmp.replace(args.json_out)

    handle = target.register_forward_hook(verify_hook, with_kwargs=True)
    status = 0
    try:
        for name, m in drafters.items():
            m.eval()
            sliding = "sliding_attention" in presets[name]["layer_types"]
            accepted.clear()
            same = total = 0
            decoded = []
            t0 = time.perf_counter()
            for p, completion in prompts:
                want = completion[:args.max_new_tokens]
                x = torch.tensor([p], dtype=torch.long, device=dev)
                out = m.spec_generate(target, x, max_new_tokens=len(want), stop_token_ids=None,
                                      temperature=0.0)
                got = out[0, len(p):].tolist()
                decoded.append((out[0].tolist(), len(p)))
                total += len(want)
                same += sum(1 for i, t in enumerate(want) if i < len(got) and got[i] == t)
                print(f"[specforge_tau] {name}: prompt {len(decoded)}/{len(prompts)} decoded, "
                      f"{len(accepted)} verifications, {time.perf_counter() - t0:.1f} s", flush=True)
            tau = 1 + statistics.mean(accepted) if accepted else float("nan")
            r = dict(tau=round(tau, 4), verifications=len(accepted), prompts=len(prompts),
                     new_tokens=total, match_corpus=round(same / max(1, total), 4),
                     seconds=round(time.perf_counter() - t0, 1), sliding_as_full=sliding)
            result["drafters"][name] = r  # (the teacher-forced figures below join it)
            save()
            # The same decoded text, teacher-forced at every position (hook off: these target
            # forwards are not verifications): the mean over evenly spread anchors (what
            # tau_hat estimates), its harmonic mean, and a walk that jumps from each anchor past
            # its accepted tokens, as decoding does (the eval's tau_walk; should give tau back).
            handle.remove()
            t1 = time.perf_counter()
            lens, walk_tok, walk_n = [], 0, 0
            for seq, start in decoded:
                acc = teacher_forced(m, seq, start)
                lens += [n + 1 for n in acc.values()]
                a = start
                while a in acc:
                    walk_tok += acc[a] + 1
                    walk_n += 1
                    a += acc[a] + 1
            handle = target.register_forward_hook(verify_hook, with_kwargs=True)
            if lens:
                r.update(tf_anchors=len(lens), tf_tau_mean=round(statistics.mean(lens), 4),
                         tf_tau_harmonic=round(len(lens) / sum(1 / x for x in lens), 4),
                         tf_tau_walk=round(walk_tok / max(1, walk_n), 4),
                         tf_seconds=round(time.perf_counter() - t1, 1))
            result["drafters"][name] = r
            save()
            print(f"[specforge_tau] {name}: tau {r['tau']:.3f} over {r['verifications']} verifications "
                  f"({r['prompts']} prompts, {r['new_tokens']} tokens; the corpus's greedy completion "
                  f"matched {100 * r['match_corpus']:.1f}%)"
                  + ("; sliding layers ran as full (spec_generate passes no mask)" if sliding else ""),
                  flush=True)
            if lens:
                print(f"[specforge_tau] {name}: teacher-forced on the decoded text, every position "
                      f"({r['tf_anchors']} anchors): mean {r['tf_tau_mean']:.3f} (tau_hat's kind), "
                      f"harmonic {r['tf_tau_harmonic']:.3f}, walk {r['tf_tau_walk']:.3f} "
                      f"(tau_walk's kind: decoding's anchors; {r['tf_seconds']:.0f} s)",
                      flush=True)
    except Exception as ex:  # the JSON still says what ran
        result["error"] = repr(ex)
        print(f"[specforge_tau] FAILED: {ex!r}", file=sys.stderr)
        status = 1
    finally:
        handle.remove()
    save()
    print(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main())
