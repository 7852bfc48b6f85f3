#!/usr/bin/env python3
"""stub_openai_server.py - a deterministic OpenAI-compatible chat server for tests (stdlib only).

Binds 127.0.0.1 on port 0 (or --port), prints "PORT <n>" on stdout and writes the port to
--port-file (atomically). Serves
  GET  /v1/models            {"object": "list", "data": [{"id": --model}]}
  POST /v1/chat/completions  a reply that depends only on the request's messages (reply_for()),
                             so every server instance answers the same conversation the same way.
Options make it misbehave: --fail-first N (the first N chat requests get --fail-status), --delay S
(sleep before answering), --length-if TEXT (finish_reason "length" when the last user message
contains TEXT), --bad-if TEXT (HTTP 400 then), --think-style (where the reasoning goes when
chat_template_kwargs.enable_thinking is not false: "field" -> "reasoning_content", "reasoning"
-> "reasoning" (newer vLLM), "inline" -> "<think>..</think>" in content (no reasoning parser),
"none"). --log FILE records every request it gets as one JSON line
{"path", "status", "body"} (written before the reply is sent).
"""

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def history_hash(messages):
    flat = [[m.get("role"), m.get("content")] for m in messages]
    return hashlib.sha256(json.dumps(flat, ensure_ascii=False).encode("utf-8")).hexdigest()[:12]


def last_user(messages):
    return next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")


def reply_for(messages):
    """The answer to a conversation: a function of its (role, content) history only."""
    return f"A[{history_hash(messages)}] re: {last_user(messages)[:32]}"


def reasoning_for(messages):
    return f"thinking about {history_hash(messages)}"


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.n_chat = 0


def make_handler(state):
    args = state.args

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def record(self, status, body):
            if args.log:
                with state.lock:
                    with open(args.log, "a", encoding="utf-8") as f:
                        f.write(json.dumps({"path": self.path, "status": status, "body": body}) + "\n")
                        f.flush()

        def send(self, status, obj):
            data = json.dumps(obj).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self.record(200, None)
                self.send(200, {"object": "list", "data": [{"id": args.model, "object": "model"}]})
            else:
                self.send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n)
            if self.path.rstrip("/") != "/v1/chat/completions":
                self.send(404, {"error": {"message": "not found"}})
                return
            try:
                body = json.loads(raw.decode("utf-8"))
                msgs = body["messages"]
                assert isinstance(msgs, list) and msgs
            except Exception as ex:
                self.record(400, None)
                self.send(400, {"error": {"message": f"bad request: {ex}"}})
                return
            with state.lock:
                state.n_chat += 1
                k = state.n_chat
            if k <= args.fail_first:
                self.record(args.fail_status, body)
                self.send(args.fail_status, {"error": {"message": f"stub failure {k}/{args.fail_first}"}})
                return
            if body.get("model") != args.model:
                self.record(404, body)
                self.send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                return
            lu = last_user(msgs)
            if args.bad_if and args.bad_if in lu:
                self.record(400, body)
                self.send(400, {"error": {"message": "stub: this prompt is refused (--bad-if)"}})
                return
            if args.delay:
                time.sleep(args.delay)
            content = reply_for(msgs)
            msg = {"role": "assistant", "content": content}
            kw = body.get("chat_template_kwargs") or {}
            reasoning = ""
            if args.think_style != "none" and kw.get("enable_thinking", True) is not False:
                reasoning = reasoning_for(msgs)
                if args.think_style == "field":
                    msg["reasoning_content"] = reasoning
                elif args.think_style == "reasoning":
                    msg["reasoning"] = reasoning
                else:
                    msg["content"] = "<think>\n" + reasoning + "\n</think>\n\n" + content
            finish = "length" if args.length_if and args.length_if in lu else "stop"
            prompt_tokens = sum(len((m.get("content") or "").split()) for m in msgs)
            completion_tokens = len(content.split()) + len(reasoning.split())
            self.record(200, body)
            self.send(200, {
                "id": f"chatcmpl-{k}", "object": "chat.completion", "created": 0, "model": args.model,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens},
            })

    return H


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    ap.add_argument("--log")
    ap.add_argument("--model", default="stub-model")
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--fail-status", type=int, default=500)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--length-if")
    ap.add_argument("--bad-if")
    ap.add_argument("--think-style", choices=("none", "field", "reasoning", "inline"), default="none")
    args = ap.parse_args()
    srv = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(State(args)))
    srv.daemon_threads = True
    port = srv.server_address[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, args.port_file)
    print(f"PORT {port}", flush=True)
    try:
        srv.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
