#!/usr/bin/env python3
"""make_fixtures.py - reference fixtures made with Hugging Face transformers itself.

Run where torch + transformers are (the GPU machine: torch 2.11, transformers 5.17):
    python3 scripts/make_fixtures.py --out DIR [--dump-src SRCDIR] [--variant tiny|big] [--seed-offset N]
Writes, for --variant tiny (the default; docs/FIXTURES.md describes every file and tensor):
    DIR/qwen3-tiny/       random-weight Qwen3ForCausalLM (bf16) + expected.safetensors (hidden states)
    DIR/qwen3_5-tiny/     random-weight Qwen3.5 (bf16, multimodal checkpoint layout when transformers
                          allows it) + expected.safetensors + README-names.txt
    DIR/gdn_ref.safetensors  HF's torch chunked and recurrent gated delta rule on random inputs
    DIR/tiny-qwen3/       the bundled demo model (= qwen3-tiny) + corpus.jsonl / eval.jsonl of its
                          own greedy continuations of random prompts
For --variant big (realistic head dims, for the GPU kernels; made live on the GPU machine, not committed):
    DIR/qwen3-big/        Qwen3, hidden 256, head_dim 128 + expected.safetensors
    DIR/qwen3_5-big/      Qwen3.5, hidden 256, head_dim 256, GDN 2 key / 6 value heads of dim 128
                          + expected.safetensors + README-names.txt  (only parts a, b exist for big)
--seed-offset N adds N to the weight seeds of both models and to the documents' seed (fresh random models).
Everything is seeded; weights are drawn on the CPU, forwards run on CUDA when present.
"""

import argparse
import json
import math
import os
import shutil
import struct
import sys
import time
import traceback
import zlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 512                   # both variants
ID_LO = 3                     # random ids are drawn from [ID_LO, VOCAB); 0..2 are left unused
INIT_STD = 0.125              # tiny: std of every matrix and embedding (1/sqrt(hidden): O(1) activations)
NORM_STD = 0.1                # norm weights: 1 + N(0, NORM_STD) (plain) or N(0, NORM_STD) (zero-centred)
CONV_STD = 0.35               # GDN depthwise conv taps
SEED_DOCS = 1234              # these three get --seed-offset added
SEED_QWEN3 = 1
SEED_QWEN3_5 = 2
SEED_GDN = 3
SEED_CORPUS = 100             # train prompts
SEED_EVAL = 200               # eval prompts
N_CORPUS, N_EVAL = 96, 32
PROMPT_MIN, PROMPT_MAX, NEW_TOKENS = 16, 48, 48

# Shapes of the two models and the documents, per --variant. "tiny" is the committed fixtures (tests/fixtures);
# "big" has the real models' head dims (and Qwen3.5's 1:3 GDN key:value head grouping) for the GPU kernels.
# init_std = 1/sqrt(hidden) keeps the residual stream O(1) (hs[0] = the embeddings has std init_std).
_Q35_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
VARIANTS = {
    "tiny": {
        "doc_lens": [37, 150, 1, 70],  # 150 = 3 GDN chunks of 64, the last partial
        "init_std": INIT_STD,
        "qwen3": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
        "qwen3_5": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=_Q35_LAYERS,
                        mrope_section=[2, 1, 1]),  # 8 rotary dims = 4 frequencies
    },
    "big": {
        "doc_lens": [300, 1, 129, 700],  # no multiple of 64; one of length 1; 700 > one 512-block
        "init_std": 1.0 / math.sqrt(256),  # 0.0625
        "qwen3": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=128, max_position_embeddings=4096),
        "qwen3_5": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=256, max_position_embeddings=4096,
                        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_num_key_heads=2, linear_num_value_heads=6, layer_types=_Q35_LAYERS,
                        mrope_section=[11, 11, 10]),  # 64 rotary dims = 32 frequencies (the real model's)
    },
}

torch = None  # imported in main()


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------- pure helpers

def distinct_fraction(seq, n=1):
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def corpus_line(prompt, completion):
    return json.dumps({"input_ids": list(prompt) + list(completion),
                       "loss_mask": [0] * len(prompt) + [1] * len(completion)}, separators=(",", ":"))


def cu_seqlens(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def tensor_listing(path):
    h = safetensors_header(path)
    lines = []
    for k in sorted(x for x in h if x != "__metadata__"):
        lines.append(f"{k}\t{h[k]['dtype']}\t{h[k]['shape']}")
    return lines


# ------------------------------------------------------------------------------- torch helpers

def name_seed(seed, name):
    return (seed * 1000003 + zlib.crc32(name.encode())) % (2 ** 63)


def randomize(model, seed, zero_centred_classes=(), init_std=INIT_STD):
    """Gives every parameter a deterministic, non-trivial random value (drawn in fp32 on the CPU,
    one generator per tensor seeded by its name). Returns the list of (name, kind)."""
    kinds = []
    for name, p in sorted(model.named_parameters()):
        g = torch.Generator().manual_seed(name_seed(seed, name))
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        cls = type(owner).__name__
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(p.shape)
        randn = lambda: torch.randn(shape, generator=g, dtype=torch.float32)  # noqa: E731
        if leaf == "A_log":
            n = shape[0]
            base = torch.linspace(math.log(0.02), math.log(8.0), n)
            v, kind = base + 0.3 * torch.randn(n, generator=g), "A_log: log(A), A log-spaced 0.02..8 x noise"
        elif leaf == "dt_bias":
            v, kind = 0.5 * randn(), "dt_bias N(0,0.5)"
        elif "RMSNorm" in cls or "LayerNorm" in cls:
            if leaf == "bias":
                v, kind = 0.02 * randn(), "norm bias N(0,0.02)"
            elif cls in zero_centred_classes:
                if float(p.detach().float().abs().max()) != 0.0:
                    log(f"  note: {name} ({cls}) was not initialised to 0")
                v, kind = NORM_STD * randn(), f"zero-centred norm ({cls}) N(0,{NORM_STD})"
            else:
                v, kind = 1.0 + NORM_STD * randn(), f"plain norm ({cls}) 1+N(0,{NORM_STD})"
        elif "conv1d" in name and "visual" not in name:
            v, kind = CONV_STD * randn(), f"conv N(0,{CONV_STD})"
        else:
            v, kind = init_std * randn(), f"N(0,{init_std})"
        with torch.no_grad():
            p.copy_(v.to(p.dtype))
        kinds.append((name, kind))
    return kinds


def params_to_bf16(model):
    """Casts parameters only: buffers (RoPE inv_freq) stay fp32 (model.to(bf16) would round them)."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    try:
        model.config.dtype = torch.bfloat16
    except Exception:  # noqa: BLE001
        pass


def inv_freq_buffers(model):
    return {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}


def check_inv_freq(model, ref, what):
    """ref: the buffers of a model built in fp32. Restores them if loading changed them."""
    for n, b in inv_freq_buffers(model).items():
        r = ref.get(n)
        if r is None:
            log(f"  {what}: {n} has no reference; dtype {b.dtype}")
            continue
        same = b.dtype == torch.float32 and torch.equal(b.cpu(), r.cpu())
        log(f"  {what}: {n} dtype {b.dtype} numel {b.numel()} equal to fp32 construction: {same}")
        if not same:
            log(f"  WARNING {what}: {n} differs (rounded?): restoring the fp32 values")
            b.data = r.to(device=b.device, dtype=torch.float32)


def decoder_layers(model):
    for name, mod in model.named_modules():
        if name.endswith("layers") and "visual" not in name and isinstance(mod, torch.nn.ModuleList):
            return name, mod
    raise RuntimeError("no decoder layers found")


def final_norm(model, layers_name):
    parent = model.get_submodule(layers_name.rsplit(".", 1)[0])
    return parent.norm


def run_docs(model, docs, dev):
    """Runs each document separately (batch 1, no padding, positions 0..n-1); returns a list over
    hidden-state index of [T, hidden] fp32 CPU tensors (documents concatenated), plus checks."""
    lname, layers = decoder_layers(model)
    L = len(layers)
    prenorm = []
    hook = layers[-1].register_forward_hook(
        lambda m, a, o: prenorm.append((o[0] if isinstance(o, tuple) else o).detach()))
    norm = final_norm(model, lname)
    emb = model.get_input_embeddings()
    per_doc = []
    checks = {"n_hidden_states": None, "emb_equal": True, "last_is_norm_of_prenorm": True}
    try:
        for doc in docs:
            prenorm.clear()
            x = torch.tensor(doc, dtype=torch.long, device=dev)[None]
            with torch.no_grad():
                out = model(input_ids=x, output_hidden_states=True, use_cache=False)
                hs = out.hidden_states
                checks["n_hidden_states"] = len(hs)
                assert len(hs) == L + 1, f"expected {L + 1} hidden states, got {len(hs)}"
                if not torch.equal(hs[0], emb(x)):
                    checks["emb_equal"] = False
                if not torch.equal(norm(prenorm[-1]), hs[L]):
                    checks["last_is_norm_of_prenorm"] = False
            per_doc.append([h[0].float().cpu() for h in hs])
    finally:
        hook.remove()
    return [torch.cat([d[i] for d in per_doc], 0) for i in range(L + 1)], checks


def versions():
    import transformers

    return transformers.__version__, torch.__version__


def make_docs(doc_lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(ID_LO, VOCAB, (n,), generator=g).tolist() for n in doc_lens]


def reference_states(cls, mdir, docs, dev, ref_inv, name, extra_meta, run, load_kwargs=None):
    """Loads the saved model twice (bf16, fp32), runs the documents, writes expected.safetensors.
    run: the run settings (see main: doc_lens, doc_seed, variant, seed_offset)."""
    from safetensors.torch import save_file

    load_kwargs = load_kwargs or {}
    res = {}
    for tag, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        m = cls.from_pretrained(mdir, dtype=dt, **load_kwargs).to(dev).eval()
        check_inv_freq(m, ref_inv, f"{name} {tag}")
        attn = getattr(m.config, "_attn_implementation", None)
        pdt = {str(p.dtype) for p in m.parameters()}
        log(f"  {name} {tag}: class {type(m).__name__}, param dtypes {pdt}, attn_implementation {attn}")
        hs, checks = run_docs(m, docs, dev)
        log(f"  {name} {tag}: checks {checks}")
        res[tag] = hs
        if tag == "bf16":
            res["attn"] = attn
            try:  # eager attention, for information only
                me = cls.from_pretrained(mdir, dtype=dt, attn_implementation="eager", **load_kwargs).to(dev).eval()
                check_inv_freq(me, ref_inv, f"{name} bf16 eager")
                hse, _ = run_docs(me, docs, dev)
                log(f"  {name}: max |bf16 {attn} - bf16 eager| per index: "
                    + " ".join(f"{float((a - b).abs().max()):.3g}" for a, b in zip(hs, hse)))
                del me
            except Exception as ex:  # noqa: BLE001
                log(f"  {name}: eager comparison failed: {ex!r}")
        del m
    L1 = len(res["bf16"])
    log(f"  {name}: per hidden-state index: std(bf16)  max|x|(bf16)  max|bf16-fp32|  max|diff|/max|x|")
    for i in range(L1):
        a, b = res["bf16"][i], res["fp32"][i]
        d = float((a - b).abs().max())
        mx = float(b.abs().max())
        log(f"    hs[{i}]  {float(a.std()):.4f}  {float(a.abs().max()):.3f}  {d:.4g}  {d / max(mx, 1e-30):.3g}")
        if not (0.05 <= float(a.std()) <= 20):
            log(f"    WARNING: hs[{i}] std {float(a.std()):.4g} outside O(0.1..10)")
    tv, tov = versions()
    ids = [t for d in docs for t in d]
    tensors = {"input_ids": torch.tensor(ids, dtype=torch.int32),
               "cu_seqlens": torch.tensor(cu_seqlens([len(d) for d in docs]), dtype=torch.int32)}
    for i in range(L1):
        tensors[f"hs_bf16.{i}"] = res["bf16"][i].contiguous()
        tensors[f"hs_fp32.{i}"] = res["fp32"][i].contiguous()
    meta = {"transformers": tv, "torch": tov, "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
            "attn_implementation": str(res["attn"]), "doc_lens": ",".join(map(str, run["doc_lens"])),
            "doc_seed": str(run["doc_seed"]),
            "hidden_states": "index 0 = embeddings, i in 1..L-1 = output of layer i-1, L = final norm of layer L-1",
            "tf32": "off (torch.backends.cuda.matmul.allow_tf32 = cudnn.allow_tf32 = False)"}
    meta.update({k: str(v) for k, v in extra_meta.items()})
    if run["variant"] != "tiny" or run["seed_offset"]:  # (absent for the default run: fixtures unchanged)
        meta.update({"variant": run["variant"], "seed_offset": str(run["seed_offset"])})
    save_file(tensors, os.path.join(mdir, "expected.safetensors"), metadata=meta)
    return res


def print_param_stats(model, kinds, name):
    kd = dict(kinds)
    log(f"  {name}: per-tensor std (bf16 as saved):")
    for n, p in sorted(model.named_parameters()):
        x = p.detach().float()
        log(f"    {n:60s} {str(tuple(x.shape)):16s} std {float(x.std()) if x.numel() > 1 else 0.0:.4f} "
            f"mean {float(x.mean()):+.4f}  [{kd.get(n, '?')}]")


def write_names(mdir, title, notes):
    lines = [f"# {title}", ""] + notes + ["", "## tensors as saved in model.safetensors (name, dtype, shape)", ""]
    lines += tensor_listing(os.path.join(mdir, "model.safetensors"))
    lines += ["", "## config.json as saved", ""]
    lines += open(os.path.join(mdir, "config.json")).read().rstrip("\n").split("\n")
    with open(os.path.join(mdir, "README-names.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------- a. qwen3-{variant}

def make_qwen3(out, docs, dev, shape, run):
    """shape: VARIANTS[v]["qwen3"] (Qwen3Config sizes); run: the run settings (see main)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    name, seed, init_std = f"qwen3-{run['variant']}", run["seed_qwen3"], run["init_std"]
    kw = dict(vocab_size=VOCAB, **shape, hidden_act="silu", initializer_range=init_std, rms_norm_eps=1e-6,
              tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    try:
        cfg = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **kw)
    except Exception as ex:  # noqa: BLE001
        log(f"  Qwen3Config(rope_parameters=...) failed ({ex!r}); using rope_theta=")
        cfg = Qwen3Config(rope_theta=1e6, **kw)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)  # fp32
    kinds = randomize(model, seed, init_std=init_std)
    ref_inv = {n: b.clone() for n, b in inv_freq_buffers(model).items()}
    params_to_bf16(model)
    mdir = os.path.join(out, name)
    os.makedirs(mdir, exist_ok=True)
    model.save_pretrained(mdir)
    print_param_stats(model, kinds, name)
    log(f"  {name} config.json: " + open(os.path.join(mdir, "config.json")).read().replace("\n", " "))
    res = reference_states(Qwen3ForCausalLM, mdir, docs, dev, ref_inv, name,
                           {"model": name, "weights_seed": seed, "init_std": init_std,
                            "norm_std": NORM_STD}, run)
    write_names(mdir, f"{name}: tensor names", [f"class: {type(model).__name__}",
                                                 "layout: model.* + lm_head.weight (untied)"])
    return mdir, ref_inv, res


# ------------------------------------------------------------------------------- b. qwen3_5-{variant}

def make_qwen3_5(out, docs, dev, shape, run):
    """shape: VARIANTS[v]["qwen3_5"] (Qwen3_5TextConfig sizes + layer_types + mrope_section)."""
    import transformers.models.qwen3_5 as q35pkg
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    log("  transformers.models.qwen3_5 exports: " + ", ".join(n for n in dir(q35pkg) if n.startswith("Qwen")))
    log("  modeling_qwen3_5 names: " + ", ".join(n for n in dir(q35) if n.startswith(("Qwen", "torch_"))))
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig

    name, seed, init_std = f"qwen3_5-{run['variant']}", run["seed_qwen3_5"], run["init_std"]
    shape = dict(shape)
    mrope_section = shape.pop("mrope_section")
    shape["layer_types"] = list(shape["layer_types"])
    assert len(shape["layer_types"]) == shape["num_hidden_layers"], shape
    assert 2 * sum(mrope_section) == int(shape["head_dim"] * 0.25), (mrope_section, shape["head_dim"])
    tkw = dict(vocab_size=VOCAB, **shape, hidden_act="silu", initializer_range=init_std, rms_norm_eps=1e-6,
               tie_word_embeddings=False, attention_bias=False,
               rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": mrope_section, "mrope_interleaved": True})
    tc = Qwen3_5TextConfig(**tkw)
    for k, v in (("full_attention_interval", 4), ("attn_output_gate", True)):
        try:
            setattr(tc, k, v)
        except Exception as ex:  # noqa: BLE001
            log(f"  could not set text_config.{k}: {ex!r}")
    log(f"  Qwen3_5TextConfig: rope_parameters {tc.rope_parameters}, layer_types {tc.layer_types}")
    zc = ("Qwen3_5RMSNorm",)
    mdir = os.path.join(out, name)
    os.makedirs(mdir, exist_ok=True)

    # Preferred: the real checkpoint layout (Qwen3_5ForConditionalGeneration: model_type qwen3_5,
    # text_config, model.language_model.*, a tiny model.visual.*). Fallback: Qwen3_5ForCausalLM.
    layout, model, cls, kinds = None, None, None, None
    vis_base = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
                    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=shape["hidden_size"],
                    num_position_embeddings=16)
    for vis in (vis_base, dict(vis_base, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})):
        try:
            Qwen3_5ForConditionalGeneration = q35.Qwen3_5ForConditionalGeneration
            cfg = Qwen3_5Config(text_config=tc, vision_config=vis, tie_word_embeddings=False)
            torch.manual_seed(seed)
            model = Qwen3_5ForConditionalGeneration(cfg)
            cls, layout = Qwen3_5ForConditionalGeneration, "multimodal"
            break
        except Exception:  # noqa: BLE001
            log("  Qwen3_5ForConditionalGeneration failed:\n" + traceback.format_exc())
    if model is None:
        Qwen3_5ForCausalLM = q35.Qwen3_5ForCausalLM
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(tc)
        cls, layout = Qwen3_5ForCausalLM, "text-only"
    log(f"  {name} layout: {layout} ({cls.__name__})")
    kinds = randomize(model, seed, zero_centred_classes=zc, init_std=init_std)
    ref_inv = {n: b.clone() for n, b in inv_freq_buffers(model).items()}
    for n, b in ref_inv.items():
        log(f"  {n}: {b.numel()} frequencies (rotary dims {2 * b.numel()}) {b.tolist()}")
    params_to_bf16(model)
    model.save_pretrained(mdir)
    print_param_stats(model, kinds, name)
    log(f"  {name} config.json: " + open(os.path.join(mdir, "config.json")).read().replace("\n", " "))
    res = reference_states(cls, mdir, docs, dev, ref_inv, name,
                           {"model": name, "layout": layout, "weights_seed": seed,
                            "init_std": init_std, "norm_std": NORM_STD, "conv_std": CONV_STD,
                            "gdn_backend": "transformers torch fallback (no flash-linear-attention)"}, run)

    # Cross-check: the text-only class on the same weights gives the same states.
    alt = None
    try:
        Qwen3_5ForCausalLM = q35.Qwen3_5ForCausalLM
        if layout == "multimodal":
            text = Qwen3_5ForCausalLM(tc)
            sd = model.state_dict()
            new = {}
            for k in text.state_dict():
                src = k if k.startswith("lm_head") else "model.language_model." + k[len("model."):]
                new[k] = sd[src]
            missing = text.load_state_dict(new, strict=False)
            log(f"  text-only copy: {missing}")
            params_to_bf16(text)
            check_inv_freq(text, {n.replace('model.language_model.', 'model.'): b for n, b in ref_inv.items()},
                           "text-only copy")
            text = text.to(dev).eval()
            hs_t, _ = run_docs(text, docs, dev)
            alt = max(float((a - b).abs().max()) for a, b in zip(hs_t, res["bf16"]))
            log(f"  Qwen3_5ForCausalLM on the same weights vs {cls.__name__}: max |diff| over all states {alt}")
            try:
                from transformers import AutoModelForCausalLM

                am = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16)
                log(f"  AutoModelForCausalLM.from_pretrained(multimodal dir) -> {type(am).__name__}")
                am = am.to(dev).eval()
                hs_a, _ = run_docs(am, docs, dev)
                log("  ... its max |diff| vs reference: "
                    f"{max(float((a - b).abs().max()) for a, b in zip(hs_a, res['bf16']))}")
            except Exception as ex:  # noqa: BLE001
                log(f"  AutoModelForCausalLM on the multimodal dir failed: {ex!r}")
    except Exception:  # noqa: BLE001
        log("  text-only cross-check failed:\n" + traceback.format_exc())

    text_inv = [b for n, b in ref_inv.items() if "visual" not in n and not n.endswith("original_inv_freq")]
    rot_dims = 2 * text_inv[0].numel() if text_inv else "?"
    notes = [f"class: {cls.__name__}; layout: {layout}",
             "text tensors under model.language_model. (multimodal layout) or model. (text-only layout);",
             "model.visual.* is a tiny random vision tower, unused by text (skip it); lm_head.weight at top level.",
             "GDN layers: layers.N.linear_attn.*, attention layers: layers.N.self_attn.* (q_proj rows per head: [q | gate]).",
             "Norms: input_layernorm, post_attention_layernorm, final norm, q_norm, k_norm are zero-centred (x*(1+w));",
             "linear_attn.norm is plain (w*x) then * silu(z).",
             f"RoPE: {rot_dims} rotary dims of head_dim {shape['head_dim']} "
             "(partial_rotary_factor 0.25), theta 1e7."]
    write_names(mdir, f"{name}: tensor names", notes)
    return mdir, res, layout


# ------------------------------------------------------------------------------- c. GDN reference

def gdn_f64(q, k, v, g, beta, hk, hv, dk, dv):
    """Plain fp64 recurrence (q/k l2norm with eps 1e-6, q / sqrt(dk), value head h uses q/k head
    h // (hv/hk)), an independent check of HF's two functions."""
    T = q.shape[0]
    q = q.double().view(T, hk, dk)
    k = k.double().view(T, hk, dk)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    v = v.double().view(T, hv, dv)
    out = torch.zeros(T, hv, dv, dtype=torch.float64)
    rep = hv // hk
    for h in range(hv):
        S = torch.zeros(dk, dv, dtype=torch.float64)
        for t in range(T):
            kt, qt = k[t, h // rep], q[t, h // rep]
            S = S * math.exp(float(g[t, h]))
            delta = (v[t, h] - S.T @ kt) * float(beta[t, h])
            S = S + torch.outer(kt, delta)
            out[t, h] = S.T @ qt
    return out.reshape(T, hv * dv)


def make_gdn(out):
    from safetensors.torch import save_file

    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                                  torch_recurrent_gated_delta_rule)
        src = "transformers.models.qwen3_5.modeling_qwen3_5"
    except ImportError:
        from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                        torch_recurrent_gated_delta_rule)
        src = "transformers.models.qwen3_next.modeling_qwen3_next"
    T, hk, hv, dk, dv = 150, 2, 4, 16, 16
    g_ = torch.Generator().manual_seed(SEED_GDN)
    q = torch.randn(T, hk * dk, generator=g_)
    k = torch.randn(T, hk * dk, generator=g_)
    v = torch.randn(T, hv * dv, generator=g_)
    a = torch.randn(T, hv, generator=g_)
    A_log = torch.linspace(math.log(0.02), math.log(8.0), hv) + 0.3 * torch.randn(hv, generator=g_)
    dt_bias = 0.5 * torch.randn(hv, generator=g_)
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    beta = torch.sigmoid(torch.randn(T, hv, generator=g_))
    rep = hv // hk
    qh = q.view(1, T, hk, dk).repeat_interleave(rep, dim=2)
    kh = k.view(1, T, hk, dk).repeat_interleave(rep, dim=2)
    vh = v.view(1, T, hv, dv)
    oc, sc = torch_chunk_gated_delta_rule(qh, kh, vh, g=g.view(1, T, hv), beta=beta.view(1, T, hv),
                                          chunk_size=64, initial_state=None, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    orc, sr = torch_recurrent_gated_delta_rule(qh, kh, vh, g=g.view(1, T, hv), beta=beta.view(1, T, hv),
                                               initial_state=None, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    oc = oc.reshape(T, hv * dv).float()
    orc = orc.reshape(T, hv * dv).float()
    ref = gdn_f64(q, k, v, g, beta, hk, hv, dk, dv)
    d_cr = float((oc - orc).abs().max())
    log(f"  GDN ({src}): max |out_chunk - out_recurrent| = {d_cr:.3g}; "
        f"vs fp64: chunk {float((oc.double() - ref).abs().max()):.3g}, "
        f"recurrent {float((orc.double() - ref).abs().max()):.3g}; max|out| {float(ref.abs().max()):.3g}; "
        f"g range [{float(g.min()):.3g}, {float(g.max()):.3g}]; final state |chunk-rec| "
        f"{float((sc - sr).abs().max()):.3g}")
    tv, tov = versions()
    i32 = lambda x: torch.tensor([x], dtype=torch.int32)  # noqa: E731
    tensors = {"q": q, "k": k, "v": v, "g": g.contiguous(), "beta": beta, "out_chunk": oc.contiguous(),
               "out_recurrent": orc.contiguous(), "out_ref64": ref.float().contiguous(),
               "final_state": sr[0].float().contiguous(),
               "A_log": A_log, "dt_bias": dt_bias, "a": a,
               "hk": i32(hk), "hv": i32(hv), "dk": i32(dk), "dv": i32(dv)}
    meta = {"transformers": tv, "torch": tov, "command": " ".join(sys.argv), "source": src, "seed": str(SEED_GDN),
            "device": "cpu", "chunk_size": "64", "use_qk_l2norm_in_kernel": "True",
            "grouping": "value head h uses q/k head h // (hv/hk) (repeat_interleave before the call)",
            "max_abs_chunk_minus_recurrent": f"{d_cr:.6g}"}
    save_file(tensors, os.path.join(out, "gdn_ref.safetensors"), metadata=meta)


# ------------------------------------------------------------------------------- d. tiny-qwen3

def make_prompts(seed, n):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(PROMPT_MIN, PROMPT_MAX + 1, (1,), generator=g))
        out.append(torch.randint(ID_LO, VOCAB, (L,), generator=g).tolist())
    return out


def greedy(model, prompts, dev):
    """Greedy continuations; prompts of one length go in one batch (no padding)."""
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=2,
                          bos_token_id=None)
    res = [None] * len(prompts)
    by_len = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for L, idx in sorted(by_len.items()):
        x = torch.tensor([prompts[i] for i in idx], dtype=torch.long, device=dev)
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
        assert y.shape[1] == L + NEW_TOKENS, y.shape
        for j, i in enumerate(idx):
            res[i] = y[j, L:].tolist()
    return res


def teacher_forced_agreement(model, prompts, comps, dev):
    ok = tot = 0
    for p, c in zip(prompts, comps):
        x = torch.tensor([p + c], dtype=torch.long, device=dev)
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits[0]
        pred = logits[len(p) - 1: len(p) + len(c) - 1].argmax(-1).tolist()
        ok += sum(int(a == b) for a, b in zip(pred, c))
        tot += len(c)
    return ok, tot


def make_tiny_corpus(out, qwen3_dir, dev):
    from transformers import Qwen3ForCausalLM

    tdir = os.path.join(out, "tiny-qwen3")
    os.makedirs(tdir, exist_ok=True)
    for f in sorted(os.listdir(qwen3_dir)):
        if f in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(os.path.join(qwen3_dir, f), os.path.join(tdir, f))
    m = Qwen3ForCausalLM.from_pretrained(tdir, dtype=torch.bfloat16).to(dev).eval()
    m32 = Qwen3ForCausalLM.from_pretrained(tdir, dtype=torch.float32).to(dev).eval()
    stats = {}
    for fname, seed, n in (("corpus.jsonl", SEED_CORPUS, N_CORPUS), ("eval.jsonl", SEED_EVAL, N_EVAL)):
        prompts = make_prompts(seed, n)
        t0 = time.time()
        comps = greedy(m, prompts, dev)
        t1 = time.time()
        with open(os.path.join(tdir, fname), "w") as f:
            for p, c in zip(prompts, comps):
                f.write(corpus_line(p, c) + "\n")
        ok, tot = teacher_forced_agreement(m, prompts, comps, dev)
        ok32, _ = teacher_forced_agreement(m32, prompts, comps, dev)
        d1 = [distinct_fraction(c, 1) for c in comps]
        d4 = [distinct_fraction(c, 4) for c in comps]
        st = {"records": n, "seed": seed, "prompt_tokens": sum(map(len, prompts)),
              "completion_tokens": sum(map(len, comps)),
              "distinct_token_fraction_mean": sum(d1) / n, "distinct_token_fraction_min": min(d1),
              "distinct_token_fraction_max": max(d1), "distinct_4gram_fraction_mean": sum(d4) / n,
              "completions_with_ids_0_1_2": sum(1 for c in comps if any(t < ID_LO for t in c)),
              "teacher_forced_argmax_agreement_bf16": ok / tot,
              "teacher_forced_argmax_agreement_fp32": ok32 / tot, "generate_seconds": round(t1 - t0, 2)}
        stats[fname] = st
        log(f"  tiny-qwen3 {fname}: {json.dumps(st)}")
    tv, tov = versions()
    stats["made_with"] = {"transformers": tv, "torch": tov, "command": " ".join(sys.argv),
                          "generate": f"do_sample=False, max_new_tokens={NEW_TOKENS}, bf16, no eos, "
                                      "prompts of equal length batched (no padding)",
                          "prompts": f"uniform length {PROMPT_MIN}..{PROMPT_MAX}, ids uniform {ID_LO}..{VOCAB - 1}"}
    with open(os.path.join(tdir, "corpus_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
        f.write("\n")


# ------------------------------------------------------------------------------- main

def dump_sources(dst):
    import transformers

    os.makedirs(dst, exist_ok=True)
    base = os.path.dirname(transformers.__file__)
    for rel in ("models/qwen3_5/modeling_qwen3_5.py", "models/qwen3_5/configuration_qwen3_5.py",
                "models/qwen3/modeling_qwen3.py", "utils/output_capturing.py",
                "models/qwen3_next/modeling_qwen3_next.py"):
        p = os.path.join(base, rel)
        if os.path.exists(p):
            shutil.copy(p, os.path.join(dst, rel.replace("/", "__")))


def main():
    global torch
    ap = argparse.ArgumentParser(description="Make the HF-transformers reference fixtures (see docs/FIXTURES.md).")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--dump-src", help="also copy the transformers sources used (qwen3, qwen3_5) here")
    ap.add_argument("--only", default=None,
                    help="comma list of parts a,b,c,d (d needs a); default a,b,c,d (tiny), a,b (big: c, d are "
                         "tiny-only)")
    ap.add_argument("--variant", default="tiny", choices=sorted(VARIANTS),
                    help="model/document shapes: tiny (the committed fixtures, default) or big (realistic head "
                         "dims: DIR/qwen3-big, DIR/qwen3_5-big)")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="added to both models' weight seeds and the documents' seed (default 0)")
    args = ap.parse_args()
    var = VARIANTS[args.variant]
    if args.only is None:
        args.only = "a,b,c,d" if args.variant == "tiny" else "a,b"
    parts = set(args.only.split(","))
    if parts - {"a", "b", "c", "d"}:
        ap.error(f"--only: unknown parts {sorted(parts - {'a', 'b', 'c', 'd'})}")
    if args.variant != "tiny" and parts & {"c", "d"}:
        ap.error(f"--only: parts c, d are made for --variant tiny only (got {args.only})")
    if args.seed_offset < 0:
        ap.error("--seed-offset must be >= 0")
    run = {"variant": args.variant, "seed_offset": args.seed_offset, "doc_lens": list(var["doc_lens"]),
           "doc_seed": SEED_DOCS + args.seed_offset, "seed_qwen3": SEED_QWEN3 + args.seed_offset,
           "seed_qwen3_5": SEED_QWEN3_5 + args.seed_offset, "init_std": var["init_std"]}
    import torch as _torch

    torch = _torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"make_fixtures: transformers {transformers.__version__}, torch {torch.__version__}, device {dev}"
        + (f" ({torch.cuda.get_device_name(0)})" if dev == "cuda" else "")
        + f", python {sys.version.split()[0]}")
    try:
        import fla  # noqa: F401

        log("  WARNING: flash-linear-attention is installed: HF may not use its torch GDN fallback")
    except ImportError:
        log("  flash-linear-attention: not installed (HF uses its torch GDN fallback)")
    os.makedirs(args.out, exist_ok=True)
    if args.dump_src:
        dump_sources(args.dump_src)
    log(f"variant {args.variant}, seed offset {args.seed_offset}: doc seed {run['doc_seed']}, weight seeds "
        f"{run['seed_qwen3']} (qwen3) {run['seed_qwen3_5']} (qwen3_5), init std {run['init_std']}")
    docs = make_docs(run["doc_lens"], run["doc_seed"])
    log(f"documents: lengths {run['doc_lens']}, first ids {[d[:4] for d in docs]}")
    t0 = time.time()
    failed = []
    steps = [("a", f"qwen3-{args.variant}", lambda: make_qwen3(args.out, docs, dev, var["qwen3"], run)),
             ("b", f"qwen3_5-{args.variant}", lambda: make_qwen3_5(args.out, docs, dev, var["qwen3_5"], run)),
             ("c", "gdn_ref", lambda: make_gdn(args.out)),
             ("d", "tiny-qwen3", lambda: make_tiny_corpus(args.out, os.path.join(args.out, "qwen3-tiny"), dev))]
    for key, what, fn in steps:
        if key not in parts:
            continue
        log(f"== {key}. {what}")
        try:
            fn()
        except Exception:  # noqa: BLE001  (go on with the other parts; exit non-zero at the end)
            log(f"FAILED {key}. {what}:\n" + traceback.format_exc())
            failed.append(what)
        log(f"   ({time.time() - t0:.1f} s)")
    total = 0
    for root, _, files in os.walk(args.out):
        for f in sorted(files):
            p = os.path.join(root, f)
            total += os.path.getsize(p)
            log(f"  {os.path.getsize(p):>9d}  {os.path.relpath(p, args.out)}")
    log(f"  total {total} bytes; done in {time.time() - t0:.1f} s")
    if failed:
        log(f"make_fixtures: FAILED parts: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
