#!/usr/bin/env bash
# test_regenerate.sh SRCDIR WORKDIR - scripts/regenerate.py against tests/stub_openai_server.py
# (no GPU, no network: stubs on 127.0.0.1, Python 3 standard library). Asserts: the three input
# formats (and a file mixing them) become tokenize_chat.py's {"id","messages"} records with the
# stub's answers; multi-turn requests carry the regenerated (never the original) assistant turns;
# --thinking on/off/keep, model, temperature, max_tokens reach the server; reasoning_content /
# "reasoning" / inline <think> replies land where --reasoning says; two servers both get
# requests; a server failing its first requests is retried; a dead server, or one killed mid-run,
# is skipped while the other finishes; all servers down is a non-zero exit; kill -9 mid-run +
# rerun equals an uninterrupted run (each id once); a truncated last line is repaired; failed
# records (HTTP 400) go to OUT.failed.jsonl and are retried by the next run; finish_reason length
# drops the record (or --keep-truncated keeps it); other settings on the same OUT are refused;
# bad input exits non-zero naming file and line; the output feeds tokenize_chat.py.
# Exits 77 without python3.
set -u
SRC=$1 W=$2
command -v python3 >/dev/null 2>&1 || { echo "SKIP: python3 not found"; exit 77; }
PY=$(python3 -c 'import sys; print(sys.executable)')   # the interpreter itself, not a (slow) shim
REGEN=$SRC/scripts/regenerate.py
STUB=$SRC/tests/stub_openai_server.py
rm -rf "$W" && mkdir -p "$W"
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
T0=$(date +%s)

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT

# start_stub NAME [stub options]: a stub logging to W/NAME.log; sets URL_NAME and PID_NAME
start_stub() {
  local name=$1; shift
  rm -f "$W/$name.port" "$W/$name.log"
  "$PY" "$STUB" --port-file "$W/$name.port" --log "$W/$name.log" "$@" >"$W/$name.stdout" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  eval "PID_$name=$pid"
  for _ in $(seq 200); do [ -s "$W/$name.port" ] && break; sleep 0.05; done
  [ -s "$W/$name.port" ] || { echo "FATAL: stub $name did not start" >&2; cat "$W/$name.stdout" >&2; exit 1; }
  eval "URL_$name=http://127.0.0.1:$(cat "$W/$name.port")"
}
stop_stub() { local pid; eval "pid=\$PID_$1"; kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }

# regen ARGS...: regenerate.py with short backoffs; output in W/last.err, exit status in RC
regen() { "$PY" "$REGEN" --progress-every 0.5 --backoff 0.05 "$@" >"$W/last.err" 2>&1; RC=$?; }
show() { sed 's/^/    /' "$W/last.err" | tail -25 >&2; }
want_rc() { [ "$RC" = "$1" ] || { fail "$2: exit $RC (want $1)"; show; }; }
want_err() { grep -Eq -- "$1" "$W/last.err" || { fail "$2: output lacks /$1/"; show; }; }
check() { "$PY" "$W/check.py" "$@" || fail "check $*"; }
nchat() { "$PY" "$W/check.py" nchat "$@"; }

cat >"$W/check.py" <<'EOF'
"""Checks for test_regenerate.sh: an independent reading of the inputs and the stub's answers."""
import json, os, sys
sys.path.insert(0, os.environ["STUB_DIR"])
from stub_openai_server import reply_for, reasoning_for

SG = {"human": "user", "gpt": "assistant", "system": "system"}

def norm(obj):
    if "messages" in obj:
        return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                 else "".join(p["text"] for p in m["content"])} for m in obj["messages"]]
    if "conversations" in obj:
        return [{"role": SG[t["from"]], "content": t["value"]} for t in obj["conversations"]]
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": x} for i, x in enumerate(obj["data"])]

def read(path):
    with open(path) as f:
        return [(i, json.loads(l)) for i, l in enumerate(f, 1) if l.strip()]

def expected(inp, max_turns=0):
    """{id: [(role, content)] of the expected output, system + user turns, None for an answer}."""
    exp = {}
    for lineno, obj in read(inp):
        rid = obj.get("id", lineno)
        msgs, out, turns = norm(obj), [], 0
        if not any(m["role"] == "user" for m in msgs):
            continue
        for m in msgs:
            if m["role"] == "assistant":
                continue
            if m["role"] == "user":
                if max_turns and turns >= max_turns:
                    break
                turns += 1
                out += [("user", m["content"]), ("assistant", None)]
            else:
                out.append((m["role"], m["content"]))
        exp[json.dumps(rid)] = out
    return exp

def ids_once(path):
    recs = [r for _, r in read(path)]
    keys = [json.dumps(r["id"]) for r in recs]
    assert len(keys) == len(set(keys)), f"{path}: duplicate ids {sorted(k for k in keys if keys.count(k) > 1)[:5]}"
    return {json.dumps(r["id"]): r for r in recs}

def cmd_out(out, inp, *opts):
    """the output equals the input's user turns with the stub's answers; opts: max_turns=N,
    reasoning=field|inline|none, missing=ID,ID (records expected absent)"""
    o = dict(x.split("=", 1) for x in opts)
    exp = expected(inp, int(o.get("max_turns", 0)))
    for k in filter(None, o.get("missing", "").split(",")):
        exp.pop(json.dumps(json.loads(k)), None)
    got = ids_once(out)
    assert set(got) == set(exp), f"{out}: ids {sorted(got)} != expected {sorted(exp)}"
    mode = o.get("reasoning", "none")
    for k, rec in got.items():
        msgs = rec["messages"]
        assert set(rec) == {"id", "messages"}, rec.keys()
        assert [m["role"] for m in msgs] == [r for r, _ in exp[k]], (k, msgs)
        hist = []
        for m, (role, content) in zip(msgs, exp[k]):
            if role != "assistant":
                assert m == {"role": role, "content": content}, (k, m)
                hist.append(m)
                continue
            a, r = reply_for(hist), reasoning_for(hist)
            if mode == "field":
                assert m == {"role": "assistant", "content": a, "reasoning_content": r}, (k, m)
            elif mode == "inline":
                assert m == {"role": "assistant", "content": "<think>\n" + r + "\n</think>\n\n" + a}, (k, m)
            else:
                assert m == {"role": "assistant", "content": a}, (k, m)
            assert "ORIGINAL" not in json.dumps(m)
            hist.append({"role": "assistant", "content": a})

def chat_requests(log, since=0, status=None):
    if not os.path.exists(log):
        return []
    reqs = [r for _, r in read(log)][int(since):]
    return [r for r in reqs if r["path"] == "/v1/chat/completions" and (status is None or r["status"] == int(status))]

def cmd_nchat(log, status=None, since=0):
    print(len(chat_requests(log, since, None if status in (None, "any") else status)))

def cmd_history(log, min_multi):
    """every request's history holds the stub's own answers, never an original one"""
    multi = 0
    for r in chat_requests(log, 0, 200):
        msgs = r["body"]["messages"]
        assert msgs[-1]["role"] == "user", msgs
        for j, m in enumerate(msgs):
            assert "ORIGINAL" not in m["content"], f"an original answer was sent: {msgs}"
            assert set(m) == {"role", "content"}, f"history message with extra keys: {m}"
            if m["role"] == "assistant":
                assert m["content"] == reply_for(msgs[:j]), f"history turn {j} is not the regenerated answer: {msgs}"
        multi += any(m["role"] == "assistant" for m in msgs)
    assert multi >= int(min_multi), f"only {multi} multi-turn requests"

def cmd_fields(log, since, *kv):
    """every chat request since line SINCE has KEY=JSON (KEY=ABSENT: no such key)"""
    reqs = chat_requests(log, since, 200)
    assert reqs, "no requests"
    for r in reqs:
        b = r["body"]
        for x in kv:
            k, v = x.split("=", 1)
            if v == "ABSENT":
                assert k not in b, f"{k} sent: {b.get(k)}"
            else:
                assert b.get(k) == json.loads(v), f"{k}: {b.get(k)!r} != {v}"

def cmd_same(a, b):
    ra, rb = ids_once(a), ids_once(b)
    assert set(ra) == set(rb), f"ids differ: {sorted(set(ra) ^ set(rb))[:5]}"
    for k in ra:
        assert ra[k] == rb[k], f"record {k} differs:\n {ra[k]}\n {rb[k]}"

def cmd_count(path, n):
    got = len(ids_once(path)) if os.path.exists(path) else 0
    assert got == int(n), f"{path}: {got} records, want {n}"

def cmd_lt(path, n):
    got = len(ids_once(path))
    assert 0 < got < int(n), f"{path}: {got} records (want 1..{int(n) - 1}: the kill came too late or too early)"

def cmd_make(w):
    def put(name, lines):
        with open(os.path.join(w, name), "w") as f:
            for l in lines:
                f.write((l if isinstance(l, str) else json.dumps(l)) + "\n")
    sg = lambda *t: [{"from": f, "value": v} for f, v in t]
    msg = lambda *t: [{"role": r, "content": c} for r, c in t]
    put("sharegpt.jsonl", [
        {"id": "sg-1", "conversations": sg(("system", "Be brief."), ("human", "What is 2+2?"), ("gpt", "ORIGINAL 4"),
                                           ("human", "And 3+3?"), ("gpt", "ORIGINAL 6"))},
        {"id": "sg-2", "conversations": sg(("human", "Hello there"), ("gpt", "ORIGINAL hi"))},
        {"conversations": sg(("human", "one"), ("gpt", "ORIGINAL 1"), ("human", "two"), ("gpt", "ORIGINAL 2"),
                             ("human", "three"), ("gpt", "ORIGINAL 3"))}])
    put("ultrachat.jsonl", [
        {"id": "uc-1", "data": ["Tell me a joke", "ORIGINAL joke", "Another one", "ORIGINAL joke 2"]},
        "",
        {"data": ["Only a question"]}])
    put("messages.jsonl", [
        {"id": 7, "messages": msg(("system", "You are terse."), ("user", "Name a color"), ("assistant", "ORIGINAL red"),
                                  ("user", "Another"), ("assistant", "ORIGINAL blue"))},
        {"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "from "},
                                                                  {"type": "text", "text": "parts"}]}]},
        {"id": "nouser", "messages": msg(("system", "no user turn here"))}])
    put("mixed.jsonl", [
        {"id": "m-sg", "conversations": sg(("human", "sharegpt q"), ("gpt", "ORIGINAL"), ("human", "q2"), ("gpt", "ORIGINAL"))},
        {"id": "m-uc", "data": ["ultrachat q", "ORIGINAL", "q2", "ORIGINAL"]},
        {"id": "m-msg", "messages": msg(("system", "sys"), ("user", "messages q"), ("assistant", "ORIGINAL"))}])
    big = []
    for i in range(40):
        n = 1 + i % 3
        qs = [f"question {i}.{t}" for t in range(n)]
        if i % 3 == 0:
            rec = {"id": f"big-{i}", "conversations": sum([sg(("human", q), ("gpt", "ORIGINAL")) for q in qs], [])}
        elif i % 3 == 1:
            rec = {"data": sum([[q, "ORIGINAL"] for q in qs], [])}
            if i % 2:
                rec["id"] = f"big-{i}"
        else:
            rec = {"id": 1000 + i, "messages": msg(("system", f"system {i}"), *sum([[("user", q), ("assistant", "ORIGINAL")]
                                                                          for q in qs], []))}
        big.append(rec)
    put("big.jsonl", big)
    put("bad-prompt.jsonl", [{"id": "ok-1", "data": ["fine"]}, {"id": "bad", "data": ["BADQ please"]},
                             {"id": "ok-2", "data": ["fine too", "ORIGINAL", "and BADQ here"]}])
    put("long.jsonl", [{"id": "l-1", "data": ["short"]}, {"id": "l-2", "data": ["short", "ORIGINAL", "LONGQ now"]},
                       {"id": "l-3", "data": ["LONGQ first"]}])
    put("bad-json.jsonl", [{"id": 1, "data": ["a"]}, "", '{"id": 2, "messages": ['])
    put("unknown.jsonl", [{"id": 1, "data": ["a"]}, {"id": 2, "text": "plain text"}])
    put("badrole.jsonl", [{"conversations": sg(("human", "a")) + [{"from": "robot", "value": "x"}]}])
    put("dup.jsonl", [{"id": "x", "data": ["a"]}, {"id": "x", "data": ["b"]}])

def cmd_tokenize(out, scripts_dir, mode):
    """out -> tokenize_chat.process() with a stand-in char-level Qwen-style tokenizer: every record
    is kept and its loss-masked spans are exactly the assistant turns (reasoning included)."""
    sys.path.insert(0, scripts_dir)
    import argparse, io, tokenize_chat as tc
    SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

    def render_msg(m):
        c = m["content"]
        if m["role"] == "assistant" and m.get("reasoning_content"):
            c = "<think>\n" + m["reasoning_content"] + "\n</think>\n\n" + c
        return "<|im_start|>" + m["role"] + "\n" + c + "<|im_end|>\n"

    class Tok:
        unk_token_id, eos_token_id = None, 2
        def get_vocab(self): return {s: i for i, s in enumerate(SPECIALS)}
        def __len__(self): return 0x110000 + len(SPECIALS)
        def __call__(self, text, add_special_tokens=False):
            ids, i = [], 0
            while i < len(text):
                for k, s in enumerate(SPECIALS):
                    if text.startswith(s, i):
                        ids.append(k); i += len(s); break
                else:
                    ids.append(ord(text[i]) + len(SPECIALS)); i += 1
            return {"input_ids": ids}
        def decode(self, ids, skip_special_tokens=False):
            return "".join(SPECIALS[t] if t < len(SPECIALS) else chr(t - len(SPECIALS)) for t in ids)
        def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False, **kw):
            return "".join(render_msg(m) for m in msgs) + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    tok = Tok()
    args = argparse.Namespace(template_kwargs=None, eot=None, on_unstable="eot-scan", skip_bad=False, inp=out,
                              max_len=0, overlong="drop")
    st, buf = tc.Stats(), io.StringIO()
    with open(out) as f:
        tc.process(tok, f, buf, args, st)
    recs = [json.loads(l) for l in buf.getvalue().splitlines()]
    src = [r for _, r in read(out)]
    assert st["records_written"] == len(src) == len(recs), st.c
    nreason = 0
    for r, s in zip(recs, src):
        spans, cur = [], []
        for t, m in zip(r["input_ids"], r["loss_mask"]):
            if m:
                cur.append(t)
            elif cur:
                spans.append(cur); cur = []
        if cur:
            spans.append(cur)
        want = [render_msg(m)[len("<|im_start|>assistant\n"):-1] for m in s["messages"] if m["role"] == "assistant"]
        assert [tok.decode(x) for x in spans] == want, ([tok.decode(x) for x in spans], want)
        nreason += sum("reasoning_content" in m for m in s["messages"])
    if mode == "reasoning":
        assert nreason > 0, "no reasoning_content in the output"
    print(f"tokenize_chat.process: {len(recs)} records, {st['assistant_turns']} assistant turns, "
          f"{nreason} with reasoning_content: masks ok")

getattr(sys.modules[__name__], "cmd_" + sys.argv[1])(*sys.argv[2:])
EOF
export STUB_DIR=$SRC/tests
"$PY" "$W/check.py" make "$W" || { echo "FATAL: could not write the inputs" >&2; exit 1; }

# --- 1. the three input formats, and a file mixing them (stub A: plain answers)
start_stub A
for f in sharegpt ultrachat messages mixed; do
  regen --server "$URL_A" --in "$W/$f.jsonl" --out "$W/out-$f.jsonl" --thinking off
  want_rc 0 "format $f"
  check out "$W/out-$f.jsonl" "$W/$f.jsonl"
done
want_err "1 messages, 1 sharegpt, 1 ultrachat" "mixed formats detected per record"
regen --server "$URL_A" --in "$W/messages.jsonl" --out "$W/out-messages.jsonl" --thinking off
want_rc 0 "rerun of a complete output"
want_err "nothing to do" "rerun of a complete output"
# --first-turn-only / --max-turns
regen --server "$URL_A" --in "$W/sharegpt.jsonl" --out "$W/out-first.jsonl" --thinking off --first-turn-only
want_rc 0 "--first-turn-only"
check out "$W/out-first.jsonl" "$W/sharegpt.jsonl" max_turns=1
regen --server "$URL_A" --in "$W/sharegpt.jsonl" --out "$W/out-two.jsonl" --thinking off --max-turns 2
want_rc 0 "--max-turns 2"
check out "$W/out-two.jsonl" "$W/sharegpt.jsonl" max_turns=2
# --- 2. multi-turn: the history sent holds the regenerated answers, never the originals
check history "$W/A.log" 8

# --- 3. thinking on/off/keep, model, temperature, max_tokens reach the server; reasoning placement
start_stub T --think-style field
regen --server "$URL_T" --in "$W/mixed.jsonl" --out "$W/think-on.jsonl" --thinking on
want_rc 0 "--thinking on"
check fields "$W/T.log" 0 'chat_template_kwargs={"enable_thinking": true}' 'model="stub-model"' temperature=0.0 \
  max_tokens=16384 stream=false
check out "$W/think-on.jsonl" "$W/mixed.jsonl" reasoning=field
n=$(wc -l <"$W/T.log")
regen --server "$URL_T" --in "$W/mixed.jsonl" --out "$W/think-off.jsonl" --thinking off --model stub-model \
  --temperature 0.7 --max-tokens 99 --extra-body '{"top_k": 20}'
want_rc 0 "--thinking off"
check fields "$W/T.log" "$n" 'chat_template_kwargs={"enable_thinking": false}' 'model="stub-model"' \
  temperature=0.7 max_tokens=99 top_k=20
check out "$W/think-off.jsonl" "$W/mixed.jsonl" reasoning=none
n=$(wc -l <"$W/T.log")
regen --server "$URL_T" --in "$W/mixed.jsonl" --out "$W/think-keep.jsonl" --thinking keep --max-tokens 0
want_rc 0 "--thinking keep"
check fields "$W/T.log" "$n" chat_template_kwargs=ABSENT max_tokens=ABSENT
check out "$W/think-keep.jsonl" "$W/mixed.jsonl" reasoning=field
regen --server "$URL_T" --in "$W/mixed.jsonl" --out "$W/think-inline.jsonl" --thinking on --reasoning inline
want_rc 0 "--reasoning inline"
check out "$W/think-inline.jsonl" "$W/mixed.jsonl" reasoning=inline
regen --server "$URL_T" --in "$W/mixed.jsonl" --out "$W/think-drop.jsonl" --thinking on --reasoning drop
want_rc 0 "--reasoning drop"
check out "$W/think-drop.jsonl" "$W/mixed.jsonl" reasoning=none
start_stub TI --think-style inline   # a server without a reasoning parser: "<think>..</think>" in content
regen --server "$URL_TI" --in "$W/mixed.jsonl" --out "$W/think-split.jsonl" --thinking on
want_rc 0 "reply with inline <think>"
check out "$W/think-split.jsonl" "$W/mixed.jsonl" reasoning=field
start_stub TR --think-style reasoning   # newer vLLM: "reasoning"
regen --server "$URL_TR" --in "$W/mixed.jsonl" --out "$W/think-vllm.jsonl" --thinking on
want_rc 0 "reply with 'reasoning'"
check out "$W/think-vllm.jsonl" "$W/mixed.jsonl" reasoning=field
stop_stub TI; stop_stub TR
# other settings on the same OUT are refused
regen --server "$URL_T" --in "$W/mixed.jsonl" --out "$W/think-on.jsonl" --thinking off
want_rc 2 "other --thinking on an existing OUT"
want_err "thinking" "other --thinking on an existing OUT"
# --server .../v1 is accepted; --model that the server does not serve is an error
regen --server "$URL_T/v1" --in "$W/mixed.jsonl" --out "$W/x.jsonl" --thinking off --model other-model
want_rc 2 "--model not served"
want_err "not --model other-model" "--model not served"

# --- 4. the reference: big.jsonl (40 records, all formats, 1-3 turns) in one uninterrupted run
regen --server "$URL_A" --in "$W/big.jsonl" --out "$W/ref.jsonl" --thinking off --concurrency 4
want_rc 0 "reference run"
check out "$W/ref.jsonl" "$W/big.jsonl"
want_err "40/40 records" "progress line"
want_err "tok/s" "progress line"

# --- 5. two servers both get requests
start_stub B --delay 0.02
start_stub C --delay 0.02
regen --server "$URL_B" --server "$URL_C" --in "$W/big.jsonl" --out "$W/two.jsonl" --thinking off --concurrency 4
want_rc 0 "two servers"
check same "$W/two.jsonl" "$W/ref.jsonl"
nb=$(nchat "$W/B.log" 200) nc=$(nchat "$W/C.log" 200)
{ [ "$nb" -ge 10 ] && [ "$nc" -ge 10 ]; } || fail "two servers: requests $nb and $nc (want both >= 10)"
stop_stub B

# --- 6. a server failing its first 3 requests (HTTP 500) is retried
start_stub F --fail-first 3
regen --server "$URL_F" --in "$W/big.jsonl" --out "$W/flaky.jsonl" --thinking off --concurrency 2 --retries 5 \
  --down-after 10
want_rc 0 "failing first requests"
check same "$W/flaky.jsonl" "$W/ref.jsonl"
[ "$(nchat "$W/F.log" 500)" = 3 ] || fail "failing first requests: $(nchat "$W/F.log" 500) 500s logged, want 3"
want_err "failed attempts +[0-9]+ / 3" "failing first requests: the summary counts 3 failed attempts"
stop_stub F

# --- 7. a dead server next to a live one; one killed mid-run
DEAD=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
regen --server "http://127.0.0.1:$DEAD" --server "$URL_C" --in "$W/big.jsonl" --out "$W/dead.jsonl" --thinking off \
  --concurrency 4
want_rc 0 "one dead server"
want_err "127.0.0.1:$DEAD does not answer" "one dead server: warning"
check same "$W/dead.jsonl" "$W/ref.jsonl"
start_stub D1 --delay 0.05
start_stub D2 --delay 0.05
"$PY" "$REGEN" --server "$URL_D1" --server "$URL_D2" --in "$W/big.jsonl" --out "$W/midkill.jsonl" --thinking off \
  --concurrency 4 --backoff 0.05 --down-after 2 --progress-every 0.5 >"$W/midkill.err" 2>&1 &
rp=$!
for _ in $(seq 200); do [ "$(grep -c chat/completions "$W/D2.log" 2>/dev/null)" -ge 4 ] 2>/dev/null && break; sleep 0.05; done
stop_stub D2
wait "$rp"; RC=$?
cp "$W/midkill.err" "$W/last.err"
want_rc 0 "a server killed mid-run"
want_err "server $URL_D2 is down" "a server killed mid-run: warning"
check same "$W/midkill.jsonl" "$W/ref.jsonl"
stop_stub D1

# --- 8. all servers down: a clear error, non-zero exit
regen --server "http://127.0.0.1:$DEAD" --in "$W/big.jsonl" --out "$W/alldead.jsonl" --thinking off
want_rc 1 "the only server dead"
want_err "no server answers" "the only server dead"
start_stub E --fail-first 1000000
regen --server "$URL_E" --in "$W/big.jsonl" --out "$W/alldown.jsonl" --thinking off --down-after 2 --retries 10
want_rc 1 "the only server failing every request"
want_err "all servers are down" "the only server failing every request"
stop_stub E

# --- 9. resume: kill -9 mid-run (slow stub), rerun: each id once, equal to the uninterrupted run
start_stub S --delay 0.1
"$PY" "$REGEN" --server "$URL_S" --in "$W/big.jsonl" --out "$W/resume.jsonl" --thinking off --concurrency 4 \
  >"$W/resume.err" 2>&1 &
rp=$!
for _ in $(seq 400); do [ -f "$W/resume.jsonl" ] && [ "$(wc -l <"$W/resume.jsonl")" -ge 8 ] && break; sleep 0.05; done
kill -9 "$rp"; wait "$rp" 2>/dev/null
check lt "$W/resume.jsonl" 40
regen --server "$URL_S" --in "$W/big.jsonl" --out "$W/resume.jsonl" --thinking off --concurrency 8
want_rc 0 "resume after kill -9"
want_err "[0-9]+ already in" "resume after kill -9"
check same "$W/resume.jsonl" "$W/ref.jsonl"
stop_stub S
# a truncated last line (a crash mid-write) is dropped and the file repaired
head -n 10 "$W/ref.jsonl" >"$W/cut.jsonl"
sed -n 11p "$W/ref.jsonl" | head -c 37 >>"$W/cut.jsonl"
regen --server "$URL_A" --in "$W/big.jsonl" --out "$W/cut.jsonl" --thinking off
want_rc 0 "truncated last line"
want_err "dropped a truncated last line" "truncated last line"
check same "$W/cut.jsonl" "$W/ref.jsonl"
ls "$W"/cut.jsonl.*tmp >/dev/null 2>&1 && fail "truncated last line: a temporary file was left"
# a bad line elsewhere is an error, not silently dropped
{ echo "garbage"; cat "$W/ref.jsonl"; } >"$W/corrupt.jsonl"
regen --server "$URL_A" --in "$W/big.jsonl" --out "$W/corrupt.jsonl" --thinking off
want_rc 1 "corrupt output line"
want_err "corrupt.jsonl:1" "corrupt output line"

# --- 10. failed records (HTTP 400) -> OUT.failed.jsonl, retried by the next run
start_stub G --bad-if BADQ
regen --server "$URL_G" --in "$W/bad-prompt.jsonl" --out "$W/failed.jsonl" --thinking off
want_rc 3 "a refused request"
check count "$W/failed.jsonl" 1
check count "$W/failed.jsonl.failed.jsonl" 2
grep -q "HTTP 400" "$W/failed.jsonl.failed.jsonl" || fail "failed.jsonl lacks the error"
stop_stub G
regen --server "$URL_A" --in "$W/bad-prompt.jsonl" --out "$W/failed.jsonl" --thinking off
want_rc 0 "retry of failed records"
want_err "2 failed last time" "retry of failed records"
check out "$W/failed.jsonl" "$W/bad-prompt.jsonl"
[ -e "$W/failed.jsonl.failed.jsonl" ] && fail "failed.jsonl.failed.jsonl left after a clean run"

# --- 11. finish_reason length: dropped by default (and not asked again), kept with --keep-truncated
start_stub L --length-if LONGQ
regen --server "$URL_L" --in "$W/long.jsonl" --out "$W/long.jsonl.out" --thinking off
want_rc 0 "truncated replies"
want_err "truncated, dropped +2" "truncated replies: summary"
check out "$W/long.jsonl.out" "$W/long.jsonl" 'missing="l-2","l-3"'
check count "$W/long.jsonl.out.truncated.jsonl" 2
n=$(nchat "$W/L.log")
regen --server "$URL_L" --in "$W/long.jsonl" --out "$W/long.jsonl.out" --thinking off
want_rc 0 "truncated replies, rerun"
[ "$(nchat "$W/L.log")" = "$n" ] || fail "truncated replies: the rerun asked again"
regen --server "$URL_L" --in "$W/long.jsonl" --out "$W/long.jsonl.out" --thinking off --keep-truncated
want_rc 0 "--keep-truncated"
want_err "truncated replies kept +2" "--keep-truncated: summary"
check out "$W/long.jsonl.out" "$W/long.jsonl"
stop_stub L

# --- 12. bad input: non-zero exit naming the file and line, no request sent
n=$(nchat "$W/A.log")
regen --server "$URL_A" --in "$W/bad-json.jsonl" --out "$W/x1.jsonl" --thinking off
want_rc 1 "invalid JSON"
want_err "bad-json.jsonl:3: not valid JSON" "invalid JSON"
regen --server "$URL_A" --in "$W/unknown.jsonl" --out "$W/x2.jsonl" --thinking off
want_rc 1 "unknown format"
want_err "unknown.jsonl:2: unknown record format" "unknown format"
regen --server "$URL_A" --in "$W/badrole.jsonl" --out "$W/x3.jsonl" --thinking off
want_rc 1 "unknown ShareGPT role"
want_err "badrole.jsonl:1: .*robot" "unknown ShareGPT role"
regen --server "$URL_A" --in "$W/dup.jsonl" --out "$W/x4.jsonl" --thinking off
want_rc 1 "duplicate ids"
want_err "dup.jsonl:2: id .* already used at line 1" "duplicate ids"
regen --server "$URL_A" --in "$W/missing.jsonl" --out "$W/x5.jsonl" --thinking off
want_rc 1 "missing input"
regen --server "$URL_A" --in "$W/big.jsonl" --out "$W/x6.jsonl"
want_rc 2 "no --thinking"
[ "$(nchat "$W/A.log")" = "$n" ] || fail "bad input: requests were sent"
ls "$W"/x[1-6].jsonl >/dev/null 2>&1 && fail "bad input: an output file was written"

# --- 13. the output feeds scripts/tokenize_chat.py
"$PY" "$W/check.py" tokenize "$W/ref.jsonl" "$SRC/scripts" plain || fail "tokenize_chat.py on ref.jsonl"
"$PY" "$W/check.py" tokenize "$W/think-on.jsonl" "$SRC/scripts" reasoning || fail "tokenize_chat.py on think-on.jsonl"
if "$PY" -c 'import transformers, tokenizers' >/dev/null 2>&1; then
  "$PY" - "$SRC/scripts" "$W/tok" <<'EOF' || fail "tokenize_chat.py CLI setup"
import sys
sys.path.insert(0, sys.argv[1])
import tokenize_chat
tokenize_chat._selftest_tokenizer(sys.argv[2])
EOF
  for f in ref think-on; do
    "$PY" "$SRC/scripts/tokenize_chat.py" --model "$W/tok" --in "$W/$f.jsonl" --out "$W/$f.corpus.jsonl" \
      --stats "$W/$f.stats.json" >"$W/last.err" 2>&1 || { fail "tokenize_chat.py CLI on $f.jsonl"; show; }
    "$PY" -c 'import json, sys; s = json.load(open(sys.argv[1])); n = sum(1 for l in open(sys.argv[2]) if l.strip()); assert s["records_written"] == n, (s, n)' \
      "$W/$f.stats.json" "$W/$f.jsonl" || fail "tokenize_chat.py CLI on $f.jsonl: records lost"
  done
else
  echo "SKIP (one assertion): tokenize_chat.py's command line with a real tokenizer needs transformers, not installed" \
    "(and data/ bundles no tokenizer); its reader and masking (process()) were checked above with a stand-in tokenizer"
fi

echo "test_regenerate: $(($(date +%s) - T0)) s"
if [ "$fails" -ne 0 ]; then
  echo "test_regenerate: $fails failure(s)"
  exit 1
fi
echo "test_regenerate: all passed"
