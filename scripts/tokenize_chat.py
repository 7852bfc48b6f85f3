#!/usr/bin/env python3
"""tokenize_chat.py - chat conversations (JSONL) -> dflash corpus JSONL.

Input: one conversation per line, {"messages": [{"role": "...", "content": "..."}, ...]}
(extra keys of a message, e.g. "reasoning_content" or "tool_calls", are passed to the template).
Output: one record per line, {"input_ids":[...],"loss_mask":[...]} (compact JSON), tokenized with
the target's own tokenizer and chat template (AutoTokenizer.from_pretrained(--model)).
loss_mask is 1 exactly on the tokens of assistant turns: the turn's content and its end-of-turn
token (e.g. <|im_end|>); 0 on system/user/tool turns, on the role headers ("<|im_start|>assistant\\n")
and on anything a template puts after the end-of-turn token (the "\\n" after <|im_end|>).

Method (see docs/FIXTURES.md, "tokenize_chat.py"):
  F   = tokens of render(messages)                                  (the record)
  S_j = tokens of render(messages[:j], add_generation_prompt=True)  (everything before turn j's content)
  E_j = tokens of render(messages[:j+1])                            (everything up to the end of turn j)
For assistant message j, if S_j and E_j are both token-prefixes of F, turn j is F[len(S_j):len(E_j)];
the mask covers it up to and including its last end-of-turn token. This assumes the template is
"prefix-stable": rendering a prefix of a conversation gives a prefix of the full rendering.
Templates that render an assistant turn differently once later turns follow (Qwen3's and
Qwen3.5's templates drop <think> blocks of earlier turns, and give the last assistant turn an
empty "<think>\\n\\n</think>\\n\\n") break that for E_j. Such turns are detected and counted, then
handled by --on-unstable:
  eot-scan  (default) if S_j is still a prefix of F, the turn is F[len(S_j)] up to and including the
            first end-of-turn token; kept only if the message's text content occurs in the decoded
            span (else the turn is skipped, mask 0);
  skip-turn the turn gets mask 0;
  drop      the whole conversation is dropped.
Every way a turn was handled is counted in the stats printed at the end (stderr, and --stats FILE
as JSON).

--self-test builds a byte-level BPE tokenizer with the `tokenizers` library, attaches Qwen-style
chat templates (one prefix-stable, one Qwen3-like with think blocks) and asserts the masks.
"""

import argparse
import json
import os
import sys
import tempfile

DEFAULT_EOT_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class Stats:
    def __init__(self):
        self.c = {
            "conversations_read": 0,
            "records_written": 0,
            "dropped_bad_json": 0,
            "dropped_no_messages": 0,
            "dropped_no_assistant_tokens": 0,
            "dropped_unstable": 0,
            "dropped_too_long": 0,
            "truncated": 0,
            "assistant_turns": 0,
            "turns_exact": 0,
            "turns_eot_scan": 0,
            "turns_skipped_unstable": 0,
            "turns_without_eot": 0,
            "turns_empty": 0,
            "conversations_prefix_unstable": 0,
            "tokens_written": 0,
            "loss_tokens_written": 0,
            "max_len_written": 0,
        }
        self.unstable_examples = []  # (line number, turn index, what)

    def __getitem__(self, k):
        return self.c[k]

    def add(self, k, n=1):
        self.c[k] += n


def is_prefix(p, f):
    return len(p) <= len(f) and f[: len(p)] == p


def message_text(msg):
    """The text of a message's content, for the eot-scan check ('' if none)."""
    c = msg.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(x.get("text", "") for x in c if isinstance(x, dict))
    return ""


def build_record(messages, render, encode, decode, eot_ids, on_unstable, stats, lineno=0):
    """Returns (input_ids, loss_mask) or None (dropped; stats say why).

    render(msgs, add_generation_prompt) -> str; encode(str) -> list[int]; decode(list[int]) -> str;
    eot_ids: set of end-of-turn token ids."""
    full = encode(render(messages, False))
    mask = [0] * len(full)
    unstable = False
    cache = {}

    def enc_prefix(j, gen):
        key = (j, gen)
        if key not in cache:
            cache[key] = encode(render(messages[:j], gen)) if j > 0 or gen else []
        return cache[key]

    for j, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        stats.add("assistant_turns")
        s = enc_prefix(j, True)
        e = enc_prefix(j + 1, False)
        if is_prefix(s, full) and is_prefix(e, full) and len(e) >= len(s):
            a, b = len(s), len(e)
            last = max((i for i in range(a, b) if full[i] in eot_ids), default=-1)
            if b == a:
                stats.add("turns_empty")
                continue
            if last < 0:
                stats.add("turns_without_eot")
                last = b - 1
            for i in range(a, last + 1):
                mask[i] = 1
            stats.add("turns_exact")
            continue
        # Prefix-unstable template for this turn.
        unstable = True
        what = "S_j not a prefix" if not is_prefix(s, full) else "E_j not a prefix"
        if len(stats.unstable_examples) < 5:
            stats.unstable_examples.append((lineno, j, what))
        if on_unstable == "drop":
            continue
        if on_unstable == "eot-scan" and is_prefix(s, full):
            a = len(s)
            end = next((i for i in range(a, len(full)) if full[i] in eot_ids), -1)
            text = message_text(msg).strip()
            if end >= 0 and text in decode(full[a : end + 1]):
                for i in range(a, end + 1):
                    mask[i] = 1
                stats.add("turns_eot_scan")
                continue
        stats.add("turns_skipped_unstable")
    if unstable:
        stats.add("conversations_prefix_unstable")
        if on_unstable == "drop":
            stats.add("dropped_unstable")
            return None
    return full, mask


def finish_record(ids, mask, max_len, overlong, stats):
    if max_len and len(ids) > max_len:
        if overlong == "drop":
            stats.add("dropped_too_long")
            return None
        ids, mask = ids[:max_len], mask[:max_len]
        stats.add("truncated")
    if not any(mask):
        stats.add("dropped_no_assistant_tokens")
        return None
    stats.add("records_written")
    stats.add("tokens_written", len(ids))
    stats.add("loss_tokens_written", sum(mask))
    stats.c["max_len_written"] = max(stats.c["max_len_written"], len(ids))
    return ids, mask


def record_json(ids, mask):
    return json.dumps({"input_ids": ids, "loss_mask": mask}, separators=(",", ":"))


def eot_ids_of(tok, names):
    ids = set()
    unk = getattr(tok, "unk_token_id", None)
    vocab = tok.get_vocab()
    for n in names:
        if n in vocab:
            i = vocab[n]
            if i != unk:
                ids.add(i)
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(tok.eos_token_id)
    return ids


def make_fns(tok, template_kwargs):
    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **template_kwargs)

    def encode(text):
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)

    return render, encode, decode


def process(tok, in_f, out_f, args, stats, log=sys.stderr):
    tk = json.loads(args.template_kwargs) if args.template_kwargs else {}
    render, encode, decode = make_fns(tok, tk)
    eot = eot_ids_of(tok, args.eot or DEFAULT_EOT_TOKENS)
    if not eot:
        raise SystemExit("tokenize_chat: no end-of-turn token found in the tokenizer; name one with --eot")
    vocab_n = len(tok)
    for lineno, line in enumerate(in_f, 1):
        if not line.strip():
            continue
        stats.add("conversations_read")
        try:
            obj = json.loads(line)
            messages = obj["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ValueError("'messages' is not a list of objects")
        except (ValueError, KeyError, TypeError) as ex:
            if not args.skip_bad:
                raise SystemExit(f"tokenize_chat: {args.inp}:{lineno}: bad conversation: {ex}")
            stats.add("dropped_bad_json")
            continue
        if not messages:
            stats.add("dropped_no_messages")
            continue
        r = build_record(messages, render, encode, decode, eot, args.on_unstable, stats, lineno)
        if r is None:
            continue
        r = finish_record(r[0], r[1], args.max_len, args.overlong, stats)
        if r is None:
            continue
        assert max(r[0]) < vocab_n
        out_f.write(record_json(*r) + "\n")


def print_stats(stats, eot_names, log=sys.stderr):
    c = stats.c
    print("tokenize_chat: stats", file=log)
    for k, v in c.items():
        print(f"  {k:32s} {v}", file=log)
    if c["tokens_written"]:
        print(f"  {'loss_fraction':32s} {c['loss_tokens_written'] / c['tokens_written']:.4f}", file=log)
    if c["records_written"]:
        print(f"  {'mean_len_written':32s} {c['tokens_written'] / c['records_written']:.1f}", file=log)
    if stats.unstable_examples:
        print("  prefix-unstable turns (line, message index, what), first few:", file=log)
        for ex in stats.unstable_examples:
            print(f"    {ex}", file=log)


# ---------------------------------------------------------------------------------------------
# self-test (needs transformers + tokenizers; runs on the GPU machine, no GPU used)

QWEN_STYLE_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3-like: the last assistant turn after the last user message gets an (empty) think block, so
# rendering a prefix that ends in an earlier assistant turn is not a prefix of the full rendering.
QWEN3_THINK_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SELFTEST_CONVS = [
    {"messages": [{"role": "user", "content": "Hello, how are you?"},
                  {"role": "assistant", "content": "I am fine, thank you. How can I help?"}]},
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Write a short poem about the sea."},
                  {"role": "assistant", "content": "The sea is wide,\nthe sea is deep;\nit sings the shore to sleep."},
                  {"role": "user", "content": "Now one about the sky."},
                  {"role": "assistant", "content": "The sky is blue and very high."}]},
    {"messages": [{"role": "user", "content": "Only a question, no answer."}]},
    {"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "user", "content": "Count: one two three four five six seven eight nine ten "
                                              "eleven twelve thirteen fourteen fifteen."},
                  {"role": "assistant", "content": "one two three four five six seven eight nine ten eleven "
                                                   "twelve thirteen fourteen fifteen sixteen seventeen"}]},
]


def _selftest_tokenizer(tmp):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=1, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for c in SELFTEST_CONVS for m in c["messages"]] + [
        "The quick brown fox jumps over the lazy dog.", "user assistant system", "hello world\n" * 3]
    tk.train_from_iterator(corpus * 4, trainer)
    # the specials are already added (special) tokens of `tk`: the trainer adds them
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN_STYLE_TEMPLATE
    fast.save_pretrained(tmp)
    return AutoTokenizer.from_pretrained(tmp)  # the loading path --model uses


def self_test():
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        mdir = os.path.join(tmp, "tok")
        tok = _selftest_tokenizer(mdir)
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        im_start = tok.convert_tokens_to_ids("<|im_start|>")
        print(f"self-test: tokenizer vocab {len(tok)}, <|im_start|>={im_start}, <|im_end|>={im_end}")
        enc = tok("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)["input_ids"]
        assert enc[0] == im_start and im_end in enc, enc

        def check(tok, template, on_unstable, expect_unstable):
            tok.chat_template = template
            render, encode, decode = make_fns(tok, {})
            eot = eot_ids_of(tok, DEFAULT_EOT_TOKENS)
            st = Stats()
            n_ok = 0
            for ci, conv in enumerate(SELFTEST_CONVS):
                msgs = conv["messages"]
                r = build_record(msgs, render, encode, decode, eot, on_unstable, st, ci + 1)
                if r is None:
                    continue
                ids, mask = r
                assert len(ids) == len(mask)
                # the masked tokens, split into runs, must decode to "content<|im_end|>" of each
                # non-empty assistant message, in order
                runs, cur = [], []
                for t, m in zip(ids, mask):
                    if m:
                        cur.append(t)
                    elif cur:
                        runs.append(cur)
                        cur = []
                if cur:
                    runs.append(cur)
                last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
                want = [m["content"] + "<|im_end|>" for i, m in enumerate(msgs) if m["role"] == "assistant"
                        and not (on_unstable == "skip-turn" and expect_unstable and i < last_user)]
                got = [tok.decode(x, skip_special_tokens=False) for x in runs]
                if template == QWEN3_THINK_TEMPLATE:
                    # exact path on the last turn includes the think block the model generates
                    got = [g.replace("<think>\n\n</think>\n\n", "") for g in got]
                assert got == want, (ci, on_unstable, got, want)
                # every masked run ends with <|im_end|> and is followed by an unmasked "\n"
                for i in range(len(ids)):
                    if mask[i] and (i + 1 == len(ids) or not mask[i + 1]):
                        assert ids[i] == im_end, (ci, i)
                # header tokens are never masked
                assert all(m == 0 for t, m in zip(ids, mask) if t == im_start)
                n_ok += 1
            return st, n_ok

        st, n = check(tok, QWEN_STYLE_TEMPLATE, "eot-scan", False)
        assert st["conversations_prefix_unstable"] == 0 and st["turns_exact"] == 5 and st["turns_empty"] == 0, st.c
        print(f"self-test: prefix-stable template: {n} conversations, masks exact: ok")
        st, n = check(tok, QWEN3_THINK_TEMPLATE, "eot-scan", True)
        assert st["conversations_prefix_unstable"] == 1 and st["turns_eot_scan"] == 1, st.c
        print(f"self-test: Qwen3-like template: unstable detected ({st.unstable_examples}), eot-scan: ok")
        st, n = check(tok, QWEN3_THINK_TEMPLATE, "skip-turn", True)
        assert st["turns_skipped_unstable"] == 1, st.c
        st, n = check(tok, QWEN3_THINK_TEMPLATE, "drop", True)
        assert st["dropped_unstable"] == 1, st.c
        print("self-test: skip-turn and drop policies: ok")

        # CLI end to end: files, --max-len, stats JSON
        tok.chat_template = QWEN_STYLE_TEMPLATE
        tok.save_pretrained(mdir)
        inp = os.path.join(tmp, "in.jsonl")
        with open(inp, "w") as f:
            for c in SELFTEST_CONVS:
                f.write(json.dumps(c) + "\n")
        lens = []
        render, encode, _ = make_fns(tok, {})
        for c in SELFTEST_CONVS:
            lens.append(len(encode(render(c["messages"], False))))
        max_len = sorted(lens)[-2]  # the longest conversation is over the limit
        for overlong in ("drop", "truncate"):
            out = os.path.join(tmp, f"out-{overlong}.jsonl")
            sj = os.path.join(tmp, f"stats-{overlong}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--model", mdir, "--in", inp, "--out", out,
                   "--max-len", str(max_len), "--overlong", overlong, "--stats", sj]
            p = subprocess.run(cmd, capture_output=True, text=True)
            assert p.returncode == 0, p.stderr
            s = json.load(open(sj))
            recs = [json.loads(l) for l in open(out)]
            assert len(recs) == s["records_written"], (overlong, s)
            if overlong == "drop":  # 4 conversations have assistant turns, the longest is dropped
                assert s["dropped_too_long"] == 1 and s["records_written"] == 3, s
            else:
                assert s["truncated"] == 1 and s["records_written"] + s["dropped_no_assistant_tokens"] == 5, s
            for r in recs:
                assert set(r) == {"input_ids", "loss_mask"} and len(r["input_ids"]) == len(r["loss_mask"])
                assert len(r["input_ids"]) <= max_len and set(r["loss_mask"]) <= {0, 1}
            print(f"self-test: CLI --overlong {overlong}: {len(recs)} records, stats {s['dropped_too_long']} "
                  f"dropped / {s['truncated']} truncated (lengths {lens}, max-len {max_len}): ok")
        # a bad line is a clear error naming the line
        with open(inp, "a") as f:
            f.write("{not json\n")
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--model", mdir, "--in", inp, "--out",
                            os.path.join(tmp, "x.jsonl")], capture_output=True, text=True)
        assert p.returncode != 0 and f"{inp}:6" in p.stderr, p.stderr
        print("self-test: bad line -> error naming file:line: ok")
    print("self-test: ALL OK")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Method and caveats: see the module docstring and docs/FIXTURES.md.")
    ap.add_argument("--model", help="HF model or tokenizer folder (tokenizer + chat template)")
    ap.add_argument("--in", dest="inp", help="input JSONL, one {\"messages\": [...]} per line")
    ap.add_argument("--out", help="output corpus JSONL")
    ap.add_argument("--max-len", type=int, default=0, help="longest record in tokens (0: no limit)")
    ap.add_argument("--overlong", choices=("drop", "truncate"), default="drop",
                    help="what to do with records over --max-len (default drop)")
    ap.add_argument("--on-unstable", choices=("eot-scan", "skip-turn", "drop"), default="eot-scan",
                    help="assistant turns whose template rendering is not prefix-stable (default eot-scan)")
    ap.add_argument("--eot", action="append",
                    help="end-of-turn token (repeatable; default: the tokenizer's eos plus any of "
                    + ", ".join(DEFAULT_EOT_TOKENS) + " present)")
    ap.add_argument("--template-kwargs", help='JSON object passed to apply_chat_template, e.g. {"enable_thinking": false}')
    ap.add_argument("--skip-bad", action="store_true", help="skip malformed lines (default: error)")
    ap.add_argument("--stats", help="also write the stats as JSON to this file")
    ap.add_argument("--self-test", action="store_true", help="run the built-in test (needs transformers)")
    args = ap.parse_args(argv)
    if args.self_test:
        self_test()
        return 0
    if not (args.model and args.inp and args.out):
        ap.error("--model, --in and --out are required")
    if args.max_len < 0:
        ap.error("--max-len must be >= 0")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    if not getattr(tok, "chat_template", None):
        raise SystemExit(f"tokenize_chat: {args.model}: the tokenizer has no chat template")
    stats = Stats()
    tmp_out = args.out + ".tmp"
    with open(args.inp, encoding="utf-8") as fi, open(tmp_out, "w", encoding="utf-8") as fo:
        try:
            process(tok, fi, fo, args, stats)
        except BaseException:
            fo.close()
            os.unlink(tmp_out)
            raise
    os.replace(tmp_out, args.out)
    print_stats(stats, args.eot)
    if args.stats:
        with open(args.stats, "w") as f:
            json.dump(stats.c, f, indent=1)
    if stats["records_written"] == 0:
        print("tokenize_chat: warning: no records written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
