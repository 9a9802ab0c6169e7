"""SFT data from the scripted expert, token-exact: the expert's turns rendered by a model's own chat
format, served over loopback with the token-id protocol, and recorded through the real harness.

`ExpertTokenServer` answers like composer-serve with `return_token_ids`: prompts are the checkpoint's
`ChatFormat.render_ids(messages, tools)`; the completion is the text the chat template itself renders
for the expert's assistant message (so a later prompt extends it token for token), tokenized. The
sessions that `composer-agent eval` (or `composer-train expert-data`) records against it are what
`composer-train sft` trains on. Log-probs are reported as 0.0: the expert is not a distribution.
"""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from agent.tasks.expert import expert_turn, plans
from agent.tasks.spec import Task
from serve.chat_format import ChatFormat


class ExpertTokenServer:
    def __init__(self, model_dir: str | Path, tasks: list[Task], name: str = "expert", version: int = 0,
                 mistakes: float = 0.0):
        self.chat = ChatFormat(model_dir)
        self.plans = plans(tasks, mistakes)
        self.name, self.version = name, version
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> ExpertTokenServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def completion_text(self, messages: list[dict[str, Any]], tools, turn: dict[str, Any]) -> str:
        """The text the template renders for the expert's message, up to and including the end token."""
        message: dict[str, Any] = {"role": "assistant", "content": turn.get("content", "")}
        if turn.get("reasoning") and self.chat.reasoning:
            message["reasoning_content"] = turn["reasoning"]
        if turn.get("tool_calls"):
            message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                     for i, c in enumerate(turn["tool_calls"])]
        before = self.chat.render(messages, tools, True)
        after = self.chat.render(messages + [message], tools, False)
        if not after.startswith(before):
            raise ValueError("the chat template is not append-only for this conversation")
        text = after[len(before):]
        end = self.chat.special_tokens.get("eos_token") or "<|im_end|>"
        return text[: text.rindex(end) + len(end)] if end in text else text

    def completion(self, messages: list[dict[str, Any]], tools) -> str:
        """The raw completion text for this request (subclasses may answer otherwise)."""
        return self.completion_text(messages, tools, expert_turn(self.plans, messages, tools))

    def logprobs(self, ids: list[int]) -> list[float]:
        return [0.0] * len(ids)

    def choice_extras(self, body: dict[str, Any], prompt: list[int], ids: list[int]) -> dict[str, Any]:
        """More fields for the answer's choice (subclasses; the expert has none)."""
        return {}

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
                card = {"id": server.name, "object": "model", "max_model_len": 65536,
                        "policy_version": server.version}
                self._send(200, json.dumps({"object": "list", "data": [card]}).encode(), "application/json")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                messages, tools = body.get("messages") or [], body.get("tools")
                try:
                    prompt = server.chat.render_ids(messages, tools)
                    text = server.completion(messages, tools)
                except ValueError as e:
                    self._send(400, json.dumps({"error": {"message": str(e), "type": "invalid_request_error"}})
                               .encode(), "application/json")
                    return
                ids = server.chat.encode(text)
                end = server.chat.special_tokens.get("eos_token") or "<|im_end|>"
                parsed = server.chat.parse(text.removesuffix(end), tools)
                delta: dict[str, Any] = {"role": "assistant", "content": parsed.content}
                if parsed.reasoning:
                    delta["reasoning_content"] = parsed.reasoning
                if parsed.tool_calls:
                    delta["tool_calls"] = [{"index": i, "id": "call_" + secrets.token_hex(6), "type": "function",
                                            "function": {"name": c.name, "arguments": c.arguments}}
                                           for i, c in enumerate(parsed.tool_calls)]
                lps = {"content": [{"token": "", "logprob": lp, "bytes": []} for lp in server.logprobs(ids)]}
                base = {"id": "expert", "object": "chat.completion.chunk", "model": server.name,
                        "policy_version": server.version}
                finish = "tool_calls" if parsed.tool_calls else "stop"
                chunks = [base | {"prompt_token_ids": prompt, "choices": [
                              {"index": 0, "delta": delta, "token_ids": ids, "logprobs": lps, "finish_reason": finish,
                               **server.choice_extras(body, prompt, ids)}]},
                          base | {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                                           "total_tokens": len(prompt) + len(ids)}}]
                data = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
                self._send(200, data, "text/event-stream")

        return Handler


def record(model_dir: str | Path, tasks: list[Task], out: str | Path, concurrency: int = 4,
           vary_environment: bool = False, mistakes: float = 0.0) -> dict[str, Any]:
    """Run the expert on `tasks` through the real harness with token recording; sessions land in
    OUT/sessions (ready for `composer-train sft`), the eval report in OUT/report.json. `vary_environment`:
    each episode in another folder, git state and date (agent/tasks/variation.py). `mistakes`: the share of
    one-edit tasks where the expert first makes a failed edit and recovers (SFT trains on the recovery only)."""
    from agent.config import Config
    from agent.tasks.eval import EvalConfig, run_eval

    with ExpertTokenServer(model_dir, tasks, mistakes=mistakes) as srv:
        config = Config(base_url=srv.base_url, model=srv.name, record_tokens=True)
        ecfg = EvalConfig(concurrency=concurrency, sandbox=False, vary_environment=vary_environment)
        return run_eval(tasks, config, ecfg, out)
