"""A scripted model server that speaks the token-id protocol, for harness tests without an LLM.

It behaves as composer-serve does, with the sampler replaced by a script of raw model texts: prompts are
rendered with the checkpoint's real chat format (`ChatFormat.render_ids`), the scripted text is
tokenized into the completion ids, split into reasoning / content / tool calls by the real parser, and
streamed as OpenAI chunks with `prompt_token_ids`, per-chunk `token_ids`, logprobs and
`policy_version`. Requests without tools (the loop's summary requests) take the next summary text.
"""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from serve.chat_format import ChatFormat


class TokenScriptServer:
    def __init__(self, model_dir, turns: list[str], summaries: list[str], version: int = 7):
        self.chat = ChatFormat(model_dir)
        self.turns, self.summaries, self.version = list(turns), list(summaries), version
        self.requests: list[dict[str, Any]] = []
        self.completions: list[list[int]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> TokenScriptServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _next(self, tools) -> str:
        with self.lock:
            return (self.turns if tools else self.summaries).pop(0)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                card = {"id": "scripted", "object": "model", "max_model_len": 65536, "policy_version": server.version}
                self._send(200, json.dumps({"object": "list", "data": [card]}).encode(), "application/json")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                tools = body.get("tools")
                prompt = server.chat.render_ids(body["messages"], tools)
                raw = server._next(tools)
                ids = server.chat.encode(raw)
                server.completions.append(ids)
                parsed = server.chat.parse(raw.removesuffix("<|im_end|>"), tools)
                delta: dict[str, Any] = {"role": "assistant", "content": parsed.content}
                if parsed.reasoning:
                    delta["reasoning_content"] = parsed.reasoning
                if parsed.tool_calls:
                    delta["tool_calls"] = [{"index": i, "id": "call_" + secrets.token_hex(4), "type": "function",
                                            "function": {"name": c.name, "arguments": c.arguments}}
                                           for i, c in enumerate(parsed.tool_calls)]
                lps = [{"token": "", "logprob": -0.25 - 0.001 * i, "bytes": []} for i in range(len(ids))]
                base = {"id": "x", "object": "chat.completion.chunk", "model": "scripted",
                        "policy_version": server.version}
                chunks = [base | {"prompt_token_ids": prompt, "choices": [
                              {"index": 0, "delta": delta, "token_ids": ids[:-1], "logprobs": {"content": lps[:-1]},
                               "finish_reason": None}]},
                          base | {"choices": [{"index": 0, "delta": {}, "token_ids": ids[-1:],
                                               "logprobs": {"content": lps[-1:]},
                                               "finish_reason": "tool_calls" if parsed.tool_calls else "stop"}]},
                          base | {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                                           "total_tokens": len(prompt) + len(ids)}}]
                data = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
                self._send(200, data, "text/event-stream")

        return Handler
