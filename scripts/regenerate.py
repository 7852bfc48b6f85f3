#!/usr/bin/env python3
"""regenerate.py - regenerate the assistant turns of a chat dataset with the target model.

A drafter trained on the target's own answers accepts more of them (the DFlash recipe). This
script sends every conversation of a chat dataset, user turn by user turn, to the target served
by any OpenAI-compatible server (SGLang, vLLM) and writes the conversation with the target's
answers in place of the original ones, as the JSONL that scripts/tokenize_chat.py reads:
  {"id": ..., "messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
Python 3 standard library only.

Input (JSONL, the format detected per record):
  ShareGPT   {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}
  UltraChat  {"data": ["user text", "assistant text", "user text", ...]}
  messages   {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
The record's "id" is kept when present (else its line number; --ids line: always the line number).
For each user turn in order, the conversation so far (system turns, user turns and the
*regenerated* assistant turns; the original assistant turns are never sent) goes to
POST {server}/v1/chat/completions and the reply becomes the assistant turn.

Thinking (Qwen3, Qwen3.5, Qwen3.6): --thinking on|off sends
"chat_template_kwargs": {"enable_thinking": true|false}, which SGLang and vLLM pass to the chat
template; keep sends nothing (the template's default: thinking on for Qwen3.x). It MUST match how
the target will be served with the drafter: a drafter trained on thinking-off answers and served
with thinking on (or the reverse) trains well and accepts little. Tokenize with the same setting
(tokenize_chat.py --template-kwargs '{"enable_thinking": false}' for off).
Reasoning: when a reply carries the reasoning separately ("reasoning_content", or "reasoning" in
newer vLLM: the server runs a reasoning parser, e.g. --reasoning-parser qwen3), or the content
holds "...</think>" (no parser), --reasoning field (default) writes it as the assistant message's
"reasoning_content" key next to "content": tokenize_chat.py passes it to the chat template, and
Qwen3/3.5/3.6 templates render it as "<think>\\nR\\n</think>\\n\\n" + content (for the turns after
the last user message; earlier turns' reasoning is dropped by those templates, as at serving
time). --reasoning inline writes "<think>\\nR\\n</think>\\n\\n" + answer into "content" (templates
that do not read reasoning_content); drop discards it. Only the answer ("content") is sent back
as history for the next turn.

Output and resume: OUT is appended to line by line (flushed per line, fsync'd per batch). Rerun
the same command after a crash: records whose id is in OUT are skipped; a truncated last line
(a crash mid-write) is dropped first (the file rewritten without it, atomically). Besides OUT:
  OUT.failed.jsonl     records whose generation failed after the retries, with the error
                       (retried by the next run; exit status 3 when there are any);
  OUT.truncated.jsonl  records dropped because a reply hit --max-tokens (finish_reason "length");
                       skipped by later runs unless --keep-truncated or a larger --max-tokens;
  OUT.settings.json    the generation settings; a rerun with other settings is refused (mixing
                       thinking modes, models or temperatures in one dataset is the mistake to
                       avoid): use another --out.
Servers: --server is repeatable; requests go to the least-loaded server that is up. A failing
server (connection error, timeout, HTTP 5xx/429, bad reply) is retried after a backoff that
doubles per failure (--backoff, at most 60 s); after --down-after consecutive failures it is
skipped with a warning and probed again now and then. A request is tried at most 1 + --retries
times (on any server). All servers down: an error and exit status 1 (rerun to resume).
Progress (stderr): records done / total, generated tokens/s (the replies' "usage"), ETA.

Exit status: 0 done; 1 bad input, I/O error or all servers down; 2 bad usage or settings that
differ from OUT's; 3 finished, but some records failed (OUT.failed.jsonl; rerun to retry them).
"""

import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

PROG = "regenerate"

SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system",
}
MESSAGE_ROLES = ("system", "user", "assistant")
SETTINGS_KEYS = ("model", "thinking", "temperature", "top_p", "max_tokens", "max_turns", "reasoning",
                 "extra_body")


def log(msg):
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


class InputError(Exception):
    pass


def die(msg, code=1):
    log(f"error: {msg}")
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# input

def text_of(content, where):
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise InputError(f"{where}: only text content parts are supported, got {json.dumps(p)[:80]}")
        return "".join(parts)
    if content is None:
        return ""
    raise InputError(f"{where}: content is {type(content).__name__}, not a string")


def normalize(obj):
    """A parsed input record -> (format name, [{"role", "content"}, ...]); InputError if unknown."""
    if not isinstance(obj, dict):
        raise InputError(f"a record must be a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list):
            raise InputError("'messages' is not a list")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m:
                raise InputError(f"messages[{i}] is not an object with a 'role'")
            role = m["role"]
            if role not in MESSAGE_ROLES:
                raise InputError(f"messages[{i}]: role {role!r} is not supported (only {', '.join(MESSAGE_ROLES)})")
            out.append({"role": role, "content": text_of(m.get("content"), f"messages[{i}]")})
        return "messages", out
    if "conversations" in obj:
        conv = obj["conversations"]
        if not isinstance(conv, list):
            raise InputError("'conversations' is not a list")
        out = []
        for i, t in enumerate(conv):
            if not isinstance(t, dict) or "from" not in t or "value" not in t:
                raise InputError(f"conversations[{i}] is not an object with 'from' and 'value'")
            role = SHAREGPT_ROLES.get(str(t["from"]).lower())
            if role is None:
                raise InputError(f"conversations[{i}]: 'from' {t['from']!r} is not supported "
                                 f"(human, gpt, system or one of {', '.join(sorted(SHAREGPT_ROLES))})")
            out.append({"role": role, "content": text_of(t["value"], f"conversations[{i}]")})
        return "sharegpt", out
    if "data" in obj:
        data = obj["data"]
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise InputError("'data' is not a list of strings (UltraChat)")
        return "ultrachat", [{"role": "user" if i % 2 == 0 else "assistant", "content": x} for i, x in enumerate(data)]
    keys = ", ".join(sorted(obj)[:8]) or "none"
    raise InputError("unknown record format: expected 'conversations' (ShareGPT), 'data' (UltraChat) or "
                     f"'messages'; its keys: {keys}")


def id_key(v):
    return json.dumps(v, sort_keys=True, ensure_ascii=False)


def record_id(obj, lineno, ids_mode):
    if ids_mode == "line" or not isinstance(obj, dict) or "id" not in obj:
        return lineno
    v = obj["id"]
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        raise InputError(f"'id' must be a string or an integer, got {json.dumps(v)[:40]}")
    return v


def read_input(path, ids_mode, limit):
    """Yields (lineno, obj) for each non-blank line; InputError names the file and line."""
    n = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if limit and n >= limit:
                    return
                try:
                    obj = json.loads(line)
                except ValueError as ex:
                    raise InputError(f"{path}:{lineno}: not valid JSON: {ex}")
                n += 1
                yield lineno, obj
    except UnicodeDecodeError as ex:
        raise InputError(f"{path}: not UTF-8: {ex}")


def scan_input(path, ids_mode, limit):
    """First pass: validate every record. Returns (ids in order, {key: lineno}, format counts,
    keys of records without a user turn)."""
    order, lines, fmts, no_user = [], {}, {}, set()
    for lineno, obj in read_input(path, ids_mode, limit):
        try:
            fmt, msgs = normalize(obj)
            rid = record_id(obj, lineno, ids_mode)
        except InputError as ex:
            raise InputError(f"{path}:{lineno}: {ex}")
        k = id_key(rid)
        if k in lines:
            raise InputError(f"{path}:{lineno}: id {k} already used at line {lines[k]} (resume needs unique "
                             "ids; --ids line numbers the records by line instead)")
        lines[k] = lineno
        order.append(k)
        fmts[fmt] = fmts.get(fmt, 0) + 1
        if not any(m["role"] == "user" for m in msgs):
            no_user.add(k)
    return order, lines, fmts, no_user


# ---------------------------------------------------------------------------------------------
# output files

def fsync_dir(path):
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_jsonl_repair(path, what, pick=lambda r: r["id"]):
    """pick(record) for each record of an append-only JSONL file we write, read line by line. A
    last line that is cut short (no newline, or not valid JSON: a crash mid-write) is dropped: the
    file is rewritten without it (a copy, fsync'd, renamed over it). A bad line elsewhere is an
    error."""
    if not os.path.exists(path):
        return []
    out = []
    good = 0          # bytes up to the end of the last good line
    bad = None        # (line number, bytes) of a bad line
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            if bad is not None:
                raise InputError(f"{path}:{bad[0]}: not a record this script wrote; use another --out")
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("no newline")
                r = json.loads(raw.decode("utf-8"))
                if not isinstance(r, dict) or "id" not in r:
                    raise ValueError("not a record with an id")
                out.append(pick(r))
                good += len(raw)
            except (ValueError, UnicodeDecodeError):
                bad = (i, len(raw))
    if bad is not None:
        tmp = path + ".repair.tmp"
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            left = good
            while left:
                chunk = src.read(min(left, 1 << 24))
                if not chunk:
                    break
                dst.write(chunk)
                left -= len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
        fsync_dir(path)
        log(f"{what}: dropped a truncated last line (line {bad[0]}, {bad[1]} bytes: a crash mid-write); "
            f"{len(out)} records kept")
    return out


class Appender:
    """Append-only JSONL: each line written whole and flushed, fsync'd every `every` lines or
    `secs` seconds (and on close)."""

    def __init__(self, path, every=64, secs=2.0):
        self.path, self.every, self.secs = path, every, secs
        self.f = None
        self.pending = 0
        self.last_sync = time.monotonic()

    def write(self, obj):
        if self.f is None:
            self.f = open(self.path, "a", encoding="utf-8")
        self.f.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n")
        self.f.flush()
        self.pending += 1
        if self.pending >= self.every or time.monotonic() - self.last_sync >= self.secs:
            self.sync()

    def sync(self):
        if self.f is not None and self.pending:
            os.fsync(self.f.fileno())
            self.pending = 0
        self.last_sync = time.monotonic()

    def close(self):
        if self.f is not None:
            self.sync()
            self.f.close()
            self.f = None


# ---------------------------------------------------------------------------------------------
# servers

class ServerError(Exception):
    """The server failed (connection, timeout, 5xx, 429, unusable reply): retry elsewhere/later."""


class RequestError(Exception):
    """The server refused this request (4xx): retrying will not help."""


class AllDown(Exception):
    pass


class Aborted(Exception):
    pass


class Server:
    def __init__(self, url):
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.consec = 0        # consecutive failed backoff rounds
        self.epoch = 0         # bumped on every counted failure: failures of requests sent before it don't count again
        self.retry_at = 0.0
        self.down = False
        self.probing = False
        self.inflight = 0
        self.ok = 0
        self.failures = 0
        self.last_error = ""


class Pool:
    def __init__(self, urls, backoff, down_after, abort):
        self.servers = [Server(u) for u in urls]
        self.backoff, self.down_after, self.abort = backoff, down_after, abort
        self.lock = threading.Lock()
        self.rr = 0
        self.all_down = threading.Event()

    def acquire(self, avoid=None):
        """(server, epoch) to send to, or (None, seconds to wait)."""
        with self.lock:
            now = time.monotonic()
            ready = [s for s in self.servers if s.retry_at <= now and not (s.down and s.probing)]
            if len(ready) > 1 and avoid is not None:
                ready = [s for s in ready if s is not avoid] or ready
            if not ready:
                return None, max(0.01, min(s.retry_at for s in self.servers) - now)
            self.rr += 1
            n = len(ready)
            s = min((ready[(self.rr + i) % n] for i in range(n)), key=lambda x: x.inflight)
            s.inflight += 1
            if s.down:
                s.probing = True
            return s, s.epoch

    def release(self, s, epoch, err=None):
        with self.lock:
            s.inflight -= 1
            if s.down:
                s.probing = False
            if err is None:
                s.ok += 1
                if s.down:
                    log(f"server {s.url} answers again: using it")
                s.down, s.consec = False, 0
                return
            s.failures += 1
            s.last_error = str(err)
            if epoch != s.epoch:  # sent before the failure that started the current backoff
                return
            s.epoch += 1
            s.consec += 1
            s.retry_at = time.monotonic() + min(self.backoff * 2 ** (s.consec - 1), 60.0)
            if s.consec >= self.down_after and not s.down:
                s.down = True
                log(f"warning: server {s.url} is down after {s.consec} consecutive failures (last: {err}); "
                    "skipping it, probing it again now and then")
                if all(x.down for x in self.servers):
                    self.all_down.set()

    def mark_down(self, s, err):
        s.down, s.consec, s.last_error = True, self.down_after, str(err)
        s.retry_at = time.monotonic() + min(self.backoff * 2 ** (self.down_after - 1), 60.0)


def http_json(url, body, timeout, api_key):
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", "Bearer " + api_key)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        try:
            detail = e.read().decode("utf-8", "replace")[:300]
        except Exception:
            detail = ""
        msg = f"HTTP {e.code}: {detail.strip() or e.reason}"
        if e.code >= 500 or e.code in (408, 429):
            raise ServerError(msg)
        raise RequestError(msg)
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, reset, timeout, bad URL
        reason = getattr(e, "reason", None) or e
        raise ServerError(f"{type(reason).__name__}: {reason}")
    except Exception as e:  # http.client.HTTPException (RemoteDisconnected, IncompleteRead, ...)
        raise ServerError(f"{type(e).__name__}: {e}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ServerError(f"reply is not JSON: {e}: {raw[:100]!r}")


def probe_servers(pool, args):
    """GET /v1/models on every server; returns the model name to use."""
    served = {}
    for s in pool.servers:
        try:
            r = http_json(s.url + "/v1/models", None, min(args.timeout, 30.0), args.api_key)
            ids = [m.get("id") for m in r.get("data", []) if isinstance(m, dict)]
            served[s.url] = ids
        except (ServerError, RequestError, AttributeError) as e:
            pool.mark_down(s, e)
            log(f"warning: server {s.url} does not answer GET /v1/models ({e}); skipping it for now")
    if not served:
        die("no server answers: " + "; ".join(f"{s.url}: {s.last_error}" for s in pool.servers))
    model = args.model
    if model is None:
        first = next(iter(served.values()))
        if not first:
            die(f"{next(iter(served))}/v1/models lists no model; give --model")
        model = first[0]
        log(f"model: {model} (from {next(iter(served))}/v1/models)")
    for url, ids in served.items():
        if ids and model not in ids:
            die(f"server {url} serves {', '.join(map(str, ids))}, not --model {model}", 2)
    return model


# ---------------------------------------------------------------------------------------------
# generation

def split_reply(msg, split_think=True):
    """(answer, reasoning) of a chat completion message."""
    content = msg.get("content") or ""
    if not isinstance(content, str):
        content = text_of(content, "reply content")
    reasoning = msg.get("reasoning_content")
    if not isinstance(reasoning, str) or not reasoning:
        reasoning = msg.get("reasoning") if isinstance(msg.get("reasoning"), str) else ""
    if split_think and not reasoning and "</think>" in content:  # no reasoning parser on the server
        head, content = content.split("</think>", 1)
        reasoning = head.split("<think>", 1)[-1].strip("\n")
        content = content.lstrip("\n")
    return content, reasoning


class Generator:
    def __init__(self, pool, args, model, stats):
        self.pool, self.args, self.model, self.stats = pool, args, model, stats
        self.abort = pool.abort
        self.base = {"model": model, "temperature": args.temperature, "stream": False}
        if args.max_tokens:
            self.base["max_tokens"] = args.max_tokens
        if args.top_p is not None:
            self.base["top_p"] = args.top_p
        if args.thinking != "keep":
            self.base["chat_template_kwargs"] = {"enable_thinking": args.thinking == "on"}
        if args.extra_body:
            self.base.update(args.extra_body)

    def chat(self, history):
        body = dict(self.base, messages=history)
        attempts, last, err = 0, None, None
        while True:
            if self.abort.is_set():
                raise Aborted()
            s, ep = self.pool.acquire(avoid=last)
            if s is None:
                if self.pool.all_down.is_set():
                    raise AllDown()
                self.abort.wait(min(ep, 0.5))
                continue
            try:
                r = http_json(s.url + "/v1/chat/completions", body, self.args.timeout, self.args.api_key)
                try:
                    ch = r["choices"][0]
                    msg, finish = ch["message"], ch.get("finish_reason")
                    if not isinstance(msg, dict):
                        raise TypeError("message is not an object")
                except (KeyError, IndexError, TypeError) as e:
                    raise ServerError(f"reply without choices[0].message ({e}): {json.dumps(r)[:120]}")
            except ServerError as e:
                self.pool.release(s, ep, e)
                self.stats.add("request_failures")
                attempts += 1
                last, err = s, f"{s.url}: {e}"
                if self.pool.all_down.is_set():
                    raise AllDown()
                if attempts > self.args.retries:
                    raise RequestError(f"{attempts} attempts failed; last: {err}")
                continue
            except RequestError as e:
                self.pool.release(s, ep, None)
                raise RequestError(f"{s.url}: {e}")
            self.pool.release(s, ep, None)
            self.stats.add("requests")
            u = r.get("usage") or {}
            self.stats.add("prompt_tokens", int(u.get("prompt_tokens") or 0))
            self.stats.add("completion_tokens", int(u.get("completion_tokens") or 0))
            content, reasoning = split_reply(msg, self.args.thinking != "off")
            return content, reasoning, finish, int(u.get("completion_tokens") or 0)

    def regenerate(self, rid, lineno, messages):
        """-> ("ok", (record, replies cut by max_tokens)) | ("truncated", info) | ("failed", info)."""
        args = self.args
        sent, out = [], []
        turns = truncated = 0
        for m in messages:
            if m["role"] == "system":
                sent.append(m)
                out.append(dict(m))
                continue
            if m["role"] == "assistant":
                continue  # the original answer: replaced
            if args.max_turns and turns >= args.max_turns:
                break
            sent.append(m)
            out.append(dict(m))
            turns += 1
            try:
                content, reasoning, finish, ntok = self.chat(list(sent))
            except RequestError as e:
                return "failed", {"id": rid, "line": lineno, "turn": turns, "error": str(e)}
            if finish == "length":
                truncated += 1
                if not args.keep_truncated:
                    return "truncated", {"id": rid, "line": lineno, "turn": turns, "max_tokens": args.max_tokens,
                                         "completion_tokens": ntok}
            a = {"role": "assistant", "content": content}
            if reasoning and args.reasoning == "field":
                a["reasoning_content"] = reasoning
            elif reasoning and args.reasoning == "inline":
                a["content"] = "<think>\n" + reasoning + "\n</think>\n\n" + content
            sent.append({"role": "assistant", "content": content})
            out.append(a)
        while out and out[-1]["role"] == "system":  # after the last kept turn (--max-turns)
            out.pop()
        return "ok", ({"id": rid, "messages": out}, truncated)


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {"requests": 0, "request_failures": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def add(self, k, n=1):
        with self.lock:
            self.c[k] = self.c.get(k, 0) + n

    def get(self, k):
        with self.lock:
            return self.c.get(k, 0)


def fmt_secs(s):
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


# ---------------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(prog="regenerate.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, metavar="URL",
                    help="OpenAI-compatible server, e.g. http://127.0.0.1:30000 (repeatable: requests are spread "
                    "over them)")
    ap.add_argument("--in", dest="inp", required=True, metavar="IN", help="input JSONL (ShareGPT, UltraChat or messages)")
    ap.add_argument("--out", required=True, help="output JSONL (appended to; rerun to resume)")
    ap.add_argument("--thinking", required=True, choices=("on", "off", "keep"),
                    help="send chat_template_kwargs {\"enable_thinking\": true|false}, or nothing (keep: the "
                    "template's default). Must match how the target will be served with the drafter")
    ap.add_argument("--model", help="model name sent in requests (default: the first of the server's /v1/models)")
    ap.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    ap.add_argument("--top-p", type=float, help="sent only when given")
    ap.add_argument("--max-tokens", type=int, default=16384,
                    help="per reply (default 16384; 0: not sent, the server's limit)")
    ap.add_argument("--extra-body", help='JSON object merged into every request, e.g. \'{"top_k": 20, "seed": 0}\'')
    turns = ap.add_mutually_exclusive_group()
    turns.add_argument("--max-turns", type=int, default=0,
                       help="regenerate at most N user turns per conversation; the record ends after the N-th "
                       "answer (default 0: all)")
    turns.add_argument("--first-turn-only", action="store_true", help="same as --max-turns 1")
    ap.add_argument("--reasoning", choices=("field", "inline", "drop"), default="field",
                    help="where a reply's reasoning goes: field (default): the message's \"reasoning_content\" "
                    "key, which tokenize_chat.py passes to the chat template; inline: "
                    "\"<think>\\nR\\n</think>\\n\\n\" + answer in \"content\"; drop: discarded")
    ap.add_argument("--keep-truncated", action="store_true",
                    help="keep records with a reply cut by --max-tokens (finish_reason length; default: drop "
                    "the record, listed in OUT.truncated.jsonl)")
    ap.add_argument("--concurrency", type=int, default=16, help="conversations in flight (default 16)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request (default 1800)")
    ap.add_argument("--retries", type=int, default=5,
                    help="retries of a failed request, on any server (default 5)")
    ap.add_argument("--backoff", type=float, default=1.0,
                    help="first backoff of a failing server in seconds, doubled per failure up to 60 (default 1)")
    ap.add_argument("--down-after", type=int, default=5,
                    help="consecutive failures after which a server is skipped (default 5)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as 'Authorization: Bearer' (default: $OPENAI_API_KEY if set)")
    ap.add_argument("--ids", choices=("auto", "line"), default="auto",
                    help="record ids: the input's \"id\" else the line number (auto), or always the line number")
    ap.add_argument("--limit", type=int, default=0, help="only the first N input records (default: all)")
    ap.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines (default 10)")
    ap.add_argument("--sync-every", type=int, default=64, help="fsync OUT every N lines (and every 2 s; default 64)")
    args = ap.parse_args(argv)
    if args.first_turn_only:
        args.max_turns = 1
    for u in args.server:
        if not u.startswith(("http://", "https://")):
            ap.error(f"--server {u}: give a URL, e.g. http://127.0.0.1:30000")
    for k in ("concurrency", "down_after", "sync_every"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    for k in ("max_turns", "max_tokens", "retries", "limit"):
        if getattr(args, k) < 0:
            ap.error(f"--{k.replace('_', '-')} must be >= 0")
    if args.timeout <= 0 or args.backoff < 0 or args.progress_every <= 0:
        ap.error("--timeout and --progress-every must be > 0, --backoff >= 0")
    if args.extra_body:
        try:
            args.extra_body = json.loads(args.extra_body)
            if not isinstance(args.extra_body, dict):
                raise ValueError("not an object")
        except ValueError as ex:
            ap.error(f"--extra-body: {ex}")
    return args


def check_settings(path, settings):
    """Refuses settings that differ from OUT's (a key missing from `settings` is not compared);
    records them for a new OUT."""
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, ValueError) as ex:
            die(f"{path}: unreadable ({ex}); delete it only if OUT was made with the current settings")
        diff = [f"{k}: {json.dumps(old.get(k))} then, {json.dumps(settings[k])} now"
                for k in SETTINGS_KEYS if k in settings and old.get(k) != settings[k]]
        if diff:
            die(f"{path}: OUT was made with other generation settings ({'; '.join(diff)}); one dataset should "
                "have one setting: use another --out", 2)
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path)


def main(argv=None):
    args = parse_args(argv)
    out_path = args.out
    failed_path, trunc_path, settings_path = out_path + ".failed.jsonl", out_path + ".truncated.jsonl", \
        out_path + ".settings.json"
    t_start = time.monotonic()

    # 1. the input, validated whole before any request
    try:
        order, lines, fmts, no_user = scan_input(args.inp, args.ids, args.limit)
    except OSError as ex:
        die(f"{args.inp}: {ex.strerror or ex}")
    except InputError as ex:
        die(str(ex))
    total = len(order)
    if total == 0:
        die(f"{args.inp}: no records")

    # 2. what earlier runs did
    try:
        done = set(load_jsonl_repair(out_path, out_path, lambda r: id_key(r["id"])))
        truncs = load_jsonl_repair(trunc_path, trunc_path, lambda r: r)
        old_failed = load_jsonl_repair(failed_path, failed_path)
    except InputError as ex:
        die(str(ex))
    except OSError as ex:
        die(f"{ex.filename}: {ex.strerror}")
    skip_trunc = set()
    if not args.keep_truncated:
        for r in truncs:
            mt = r.get("max_tokens") or 0
            if args.max_tokens and mt and args.max_tokens <= mt:
                skip_trunc.add(id_key(r["id"]))
    stray = len(done - set(lines))
    if stray:
        log(f"warning: {stray} records of {out_path} have ids that are not in {args.inp}")
    todo_keys = [k for k in order if k not in done and k not in skip_trunc and k not in no_user]
    n_done_before = sum(1 for k in order if k in done)
    n_skip_trunc = sum(1 for k in order if k in skip_trunc and k not in done)
    log(f"{args.inp}: {total} records ({', '.join(f'{v} {k}' for k, v in sorted(fmts.items()))}); "
        f"{n_done_before} already in {out_path}"
        + (f", {n_skip_trunc} dropped as truncated before" if n_skip_trunc else "")
        + (f", {len(no_user)} without a user turn (skipped)" if no_user else "")
        + (f", {len(old_failed)} failed last time (retrying)" if old_failed else "")
        + f"; {len(todo_keys)} to do")

    settings = {"model": args.model, "thinking": args.thinking, "temperature": args.temperature,
                "top_p": args.top_p, "max_tokens": args.max_tokens, "max_turns": args.max_turns,
                "reasoning": args.reasoning, "extra_body": args.extra_body}
    if not todo_keys:
        if os.path.exists(settings_path):
            if args.model is None:
                del settings["model"]
            check_settings(settings_path, settings)
        log(f"nothing to do: {out_path} is complete")
        sys.exit(0)

    # 3. servers and settings
    abort = threading.Event()
    pool = Pool(args.server, args.backoff, args.down_after, abort)
    settings["model"] = model = probe_servers(pool, args)
    try:
        check_settings(settings_path, settings)
    except OSError as ex:
        die(f"{settings_path}: {ex.strerror or ex}")
    log(f"thinking {args.thinking}, temperature {args.temperature}, max_tokens {args.max_tokens or 'server'}, "
        f"{len(pool.servers)} server(s), concurrency {args.concurrency}")

    stats = Stats()
    gen = Generator(pool, args, model, stats)
    out = Appender(out_path, args.sync_every)
    failed_out = Appender(failed_path, 1, 0.0)
    trunc_out = Appender(trunc_path, 1, 0.0)
    if os.path.exists(failed_path):
        os.unlink(failed_path)  # this run's failures only; the last run's are retried (not in OUT)

    todo = set(todo_keys)
    tasks = queue.Queue(maxsize=2 * args.concurrency)
    results = queue.Queue()
    feeder_error = []
    fed = [0]
    feeder_done = threading.Event()

    def feeder():
        try:
            for lineno, obj in read_input(args.inp, args.ids, args.limit):
                rid = record_id(obj, lineno, args.ids)
                if id_key(rid) not in todo:
                    continue
                _, msgs = normalize(obj)
                while not abort.is_set():
                    try:
                        tasks.put((rid, lineno, msgs), timeout=0.2)
                        fed[0] += 1
                        break
                    except queue.Full:
                        pass
                if abort.is_set():
                    return
        except (InputError, OSError) as ex:  # the file changed under us
            feeder_error.append(str(ex))
            abort.set()
        finally:
            feeder_done.set()

    def worker():
        while not abort.is_set():
            try:
                item = tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                results.put(gen.regenerate(*item))
            except AllDown:
                abort.set()
                results.put(("alldown", None))
                return
            except Aborted:
                return
            except Exception as ex:  # a bug: report it, keep the others going
                results.put(("failed", {"id": item[0], "line": item[1], "error": f"{type(ex).__name__}: {ex}"}))

    threads = [threading.Thread(target=feeder, daemon=True)]
    threads += [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
    for t in threads:
        t.start()

    n_ok = n_failed = n_trunc_dropped = n_trunc_kept = 0
    received = 0
    t_run = time.monotonic()
    next_progress = t_run + args.progress_every
    status = 0

    def progress():
        el = max(time.monotonic() - t_run, 1e-6)
        d = n_ok + n_failed + n_trunc_dropped
        rate = d / el
        left = len(todo_keys) - d
        eta = fmt_secs(left / rate) if rate > 0 and left > 0 else ("-" if left > 0 else "0s")
        tok = stats.get("completion_tokens")
        log(f"{n_done_before + n_ok}/{total} records ({100.0 * (n_done_before + n_ok) / total:.1f}%), "
            f"{n_failed} failed, {n_trunc_dropped + n_trunc_kept} truncated | {tok / el:,.0f} tok/s generated, "
            f"{rate:.2f} records/s | ETA {eta}")

    try:
        while not (feeder_done.is_set() and received >= fed[0]) and not abort.is_set():
            try:
                kind, val = results.get(timeout=0.2)
            except queue.Empty:
                kind = None
            if kind is not None:
                received += 1
                if kind == "ok":
                    rec, ntr = val
                    out.write(rec)
                    n_ok += 1
                    n_trunc_kept += ntr
                elif kind == "truncated":
                    trunc_out.write(val)
                    n_trunc_dropped += 1
                elif kind == "failed":
                    failed_out.write(val)
                    n_failed += 1
                    if n_failed <= 3:
                        log(f"warning: record {json.dumps(val['id'])} (line {val['line']}) failed: {val['error']}")
            if time.monotonic() >= next_progress:
                progress()
                next_progress = time.monotonic() + args.progress_every
        # results that arrived with an abort (all servers down): keep what is finished
        while True:
            try:
                kind, val = results.get_nowait()
            except queue.Empty:
                break
            if kind == "ok":
                out.write(val[0])
                n_ok += 1
                n_trunc_kept += val[1]
            elif kind == "truncated":
                trunc_out.write(val)
                n_trunc_dropped += 1
            elif kind == "failed":
                failed_out.write(val)
                n_failed += 1
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # finish writing what is done
        status = 130
        log("interrupted: rerun the same command to resume")
    finally:
        abort.set()
        out.close()
        failed_out.close()
        trunc_out.close()
    progress()

    el = time.monotonic() - t_run
    if feeder_error:
        log(f"error: {feeder_error[0]}")
        status = 1
    elif pool.all_down.is_set() and n_ok + n_failed + n_trunc_dropped < len(todo_keys):
        log("error: all servers are down: " + "; ".join(f"{s.url} ({s.last_error})" for s in pool.servers)
            + f"; {n_ok} records written this run; rerun the same command to resume")
        status = 1
    elif status == 0 and n_failed:
        status = 3
    # summary
    c = stats.c
    print(f"{PROG}: summary", file=sys.stderr)
    rows = [
        ("input records", f"{total}"),
        ("already done (skipped)", f"{n_done_before}"),
        ("written this run", f"{n_ok}"),
        ("in " + os.path.basename(out_path), f"{n_done_before + n_ok}"),
        ("truncated, dropped", f"{n_trunc_dropped}" + (f" (+{n_skip_trunc} from earlier runs)" if n_skip_trunc else "")
         + (f" -> {os.path.basename(trunc_path)}" if n_trunc_dropped or n_skip_trunc else "")),
        ("truncated replies kept", f"{n_trunc_kept}"),
        ("without a user turn (skipped)", f"{len(no_user)}"),
        ("failed", f"{n_failed}" + (f" -> {os.path.basename(failed_path)} (rerun to retry)" if n_failed else "")),
        ("not done (interrupted)", f"{len(todo_keys) - n_ok - n_failed - n_trunc_dropped}"),
        ("requests ok / failed attempts", f"{c['requests']} / {c['request_failures']}"),
        ("prompt / completion tokens", f"{c['prompt_tokens']} / {c['completion_tokens']}"),
        ("generated tokens/s", f"{c['completion_tokens'] / max(el, 1e-6):,.0f}"),
        ("elapsed", f"{fmt_secs(time.monotonic() - t_start)}"),
    ]
    for k, v in rows:
        print(f"  {k:30s} {v}", file=sys.stderr)
    for s in pool.servers:
        print(f"  server {s.url}: {s.ok} ok, {s.failures} failed" + (" (down)" if s.down else ""), file=sys.stderr)
    sys.stderr.flush()
    if n_failed == 0 and os.path.exists(failed_path) and os.path.getsize(failed_path) == 0:
        os.unlink(failed_path)
    # daemon threads may still hold requests to dead servers: do not wait for them
    os._exit(status)


if __name__ == "__main__":
    main()
