"""Scripted models for tests and demos: no LLM, the same interfaces as a real one.

A script is a list of turns, each a dict (JSON-friendly, so scripts can live in files):

    {"content": "text", "reasoning": "…",
     "tool_calls": [{"name": "read_file", "arguments": {"path": "a.py"}}, …],
     "text_tool_calls": "hermes" | "qwen3_coder",   # write the calls into content instead
     "status": 500,                                  # answer this request with an HTTP error instead
     "delay_s": 0.01,                                # pause between streamed chunks
     "prefill_s": 3.0,                               # think this long before the first chunk (a slow prefill)
     "prompt_tokens": 300,                           # report this prompt count (a real tokenizer's) in usage
     "headers_late": true,                           # … and send no response headers before it either
     "no_stream": true,                              # answer with one JSON body, as if stream were ignored
     "drop": true,                                   # break the connection after the calls, mid-stream
     "cut": true,                                    # end the stream cleanly there: no finish_reason, no [DONE]
     "stream_error": "engine died"}                  # end it with an in-stream error object instead

`DeterministicModel` replays a script in-process through the loop's `Model` interface.
`ScriptedServer` replays it over real HTTP on loopback as an OpenAI-compatible server (SSE streaming,
structured tool-call deltas, usage), recording every request it receives. Both honour `max_tokens` as
a server would: an answer longer than that (4 characters a token) is cut there, finish_reason "length".
A request without `tools` (how the loop asks for a summary) is answered from `summaries` instead of the script.

    python -m agent.scripted SCRIPT.json [--port 8000]     # serve a script for demos
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agent.client import ModelTurn, StreamCallbacks, estimate_tokens
from agent.protocol import Message, Usage
from agent.tools.executor import ToolCall

DEFAULT_SUMMARY = ("## Goal\nContinue the task.\n## Discoveries\nNone recorded.\n## Done\nSome steps.\n"
                   "## Next steps\nFinish the task.")


def render_text_calls(calls: list[dict[str, Any]], fmt: str) -> str:
    """Tool calls written as text, the way some servers leave them in `content`."""
    out = []
    for c in calls:
        if fmt == "hermes":
            out.append("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c.get("arguments", {})})
                       + "\n</tool_call>")
        else:
            params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                             for k, v in c.get("arguments", {}).items())
            out.append(f"<tool_call>\n<function={c['name']}>\n{params}</function>\n</tool_call>")
    return "\n".join(out)


class Script:
    """A thread-safe cursor over scripted turns and summaries."""

    def __init__(self, turns: list[dict[str, Any]], summaries: list[str] | None = None):
        self.turns = list(turns)
        self.summaries = list(summaries or [])
        self.lock = threading.Lock()
        self.position = 0

    def next_turn(self, wants_summary: bool) -> dict[str, Any]:
        with self.lock:
            if wants_summary:
                return {"content": self.summaries.pop(0) if self.summaries else DEFAULT_SUMMARY}
            if self.position >= len(self.turns):
                return {"content": "(the script has no more turns)"}
            turn = self.turns[self.position]
            self.position += 1
            return turn


class DeterministicModel:
    """The loop's `Model` interface over a script, in-process. `requests` records what it was sent."""

    def __init__(self, turns: list[dict[str, Any]], summaries: list[str] | None = None, name: str = "scripted"):
        self.script = Script(turns, summaries)
        self.name = name
        self.requests: list[dict[str, Any]] = []
        self._ids = 0

    def complete(self, messages: list[Message], tools: list[dict[str, Any]] | None,
                 cb: StreamCallbacks, cancel: threading.Event, max_tokens: int | None = None) -> ModelTurn:
        start = time.monotonic()
        self.requests.append({"messages": copy.deepcopy(messages), "tools": tools, "max_tokens": max_tokens})
        turn = self.script.next_turn(wants_summary=not tools)
        if turn.get("reasoning"):
            cb.on_reasoning(turn["reasoning"])
        content = turn.get("content", "")
        wanted = turn.get("tool_calls", [])
        finish = "tool_calls" if wanted else "stop"
        if max_tokens is not None and estimate_tokens(content) + sum(
                estimate_tokens(json.dumps(c.get("arguments", {}))) for c in wanted) > max_tokens:
            content, wanted, finish = content[: 4 * max_tokens], [], "length"
        calls = []
        for c in wanted:
            self._ids += 1
            call = ToolCall(f"call_{self._ids}", c["name"], json.dumps(c.get("arguments", {})))
            calls.append(call)
        for piece in _chunks(content, 8):
            if cancel.is_set():
                break
            cb.on_text(piece)
            if turn.get("delay_s"):
                time.sleep(turn["delay_s"])
        for call in calls:
            cb.on_tool_call(call)
        usage = Usage(estimate_tokens(messages) + estimate_tokens(tools or []),
                      estimate_tokens(content) + sum(estimate_tokens(c.arguments) for c in calls))
        return ModelTurn(content, turn.get("reasoning", ""), calls, finish, usage,
                         0.0, time.monotonic() - start)


def _chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


class ScriptedServer:
    """An OpenAI-compatible server on 127.0.0.1 that streams scripted turns. Use as a context manager."""

    def __init__(self, turns: list[dict[str, Any]], summaries: list[str] | None = None, *,
                 model: str = "scripted-model", context_window: int | None = 32768, api_key: str | None = None,
                 port: int = 0, chunk_chars: int = 6):
        self.script = Script(turns, summaries)
        self.model = model
        self.context_window = context_window
        self.api_key = api_key
        self.chunk_chars = chunk_chars
        self.requests: list[dict[str, Any]] = []
        # (time.perf_counter(), text) of every content chunk as it was written, for latency benchmarks.
        self.content_sent: list[tuple[float, str]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def next_turn(self, body: dict[str, Any]) -> dict[str, Any]:
        """The turn that answers this request (subclasses may choose by the conversation)."""
        return self.script.next_turn(wants_summary=not body.get("tools"))

    def chat_requests(self) -> list[dict[str, Any]]:
        return [r["body"] for r in self.requests if r["path"].endswith("/chat/completions")]

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _json(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self._json(401, {"error": {"message": "Invalid API key", "type": "invalid_request_error",
                                               "param": None, "code": "invalid_api_key"}})
                    return False
                return True

            def do_GET(self) -> None:
                server.requests.append({"path": self.path, "body": None})
                if not self._authorized():
                    return
                if self.path.rstrip("/").endswith("/models"):
                    card = {"id": server.model, "object": "model", "owned_by": "composer-tests"}
                    if server.context_window:
                        card["max_model_len"] = server.context_window
                    self._json(200, {"object": "list", "data": [card]})
                else:
                    self._json(404, {"error": {"message": "not found", "type": "not_found"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                server.requests.append({"path": self.path, "body": body})
                if not self._authorized():
                    return
                if not self.path.endswith("/chat/completions"):
                    self._json(404, {"error": {"message": "not found", "type": "not_found"}})
                    return
                if body.get("model") != server.model:
                    self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                               "type": "NotFoundError", "code": 404}})
                    return
                turn = server.next_turn(body)
                if turn.get("status"):
                    self._json(turn["status"], {"error": {"message": f"scripted HTTP {turn['status']}",
                                                          "type": "server_error"}})
                    return
                if turn.get("no_stream"):
                    self._whole(turn)
                else:
                    self._stream(body, turn)

            def _whole(self, turn: dict[str, Any]) -> None:
                calls = [{"id": f"call_w{i}", "type": "function",
                          "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}}
                         for i, c in enumerate(turn.get("tool_calls", []))]
                message = {"role": "assistant", "content": turn.get("content", "")}
                if calls:
                    message["tool_calls"] = calls
                self._json(200, {"id": "chatcmpl-whole", "object": "chat.completion", "model": server.model,
                                 "choices": [{"index": 0, "message": message,
                                              "finish_reason": "tool_calls" if calls else "stop"}],
                                 "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}})

            def _stream(self, body: dict[str, Any], turn: dict[str, Any]) -> None:
                if turn.get("headers_late"):
                    time.sleep(turn.get("prefill_s", 0))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                if turn.get("drop"):  # promise more than is sent: the client sees a broken body
                    self.send_header("Content-Length", str(1 << 30))
                self.end_headers()
                if turn.get("prefill_s") and not turn.get("headers_late"):
                    self.wfile.flush()
                    time.sleep(turn["prefill_s"])
                base = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": int(time.time()),
                        "model": server.model}
                delay = turn.get("delay_s", 0)

                def send(choices: list[dict[str, Any]], **extra: Any) -> None:
                    self.wfile.write(f"data: {json.dumps(base | {'choices': choices} | extra)}\n\n".encode())
                    self.wfile.flush()
                    if delay:
                        time.sleep(delay)

                calls = turn.get("tool_calls", [])
                content = turn.get("content", "")
                if turn.get("text_tool_calls") and calls:
                    content = (content + "\n" if content else "") + render_text_calls(calls, turn["text_tool_calls"])
                    calls = []
                finish = "tool_calls" if calls else "stop"
                limit = body.get("max_tokens")
                if limit is not None and estimate_tokens(content) + sum(
                        estimate_tokens(json.dumps(c.get("arguments", {}))) for c in calls) > limit:
                    content, calls, finish = content[: 4 * limit], [], "length"
                send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
                for piece in _chunks(turn.get("reasoning", ""), server.chunk_chars):
                    send([{"index": 0, "delta": {"reasoning_content": piece}, "finish_reason": None}])
                for piece in _chunks(content, server.chunk_chars):
                    server.content_sent.append((time.perf_counter(), piece))
                    send([{"index": 0, "delta": {"content": piece}, "finish_reason": None}])
                for i, c in enumerate(calls):
                    args = json.dumps(c.get("arguments", {}))
                    head = {"index": i, "id": f"call_{len(server.requests)}_{i}", "type": "function",
                            "function": {"name": c["name"], "arguments": ""}}
                    send([{"index": 0, "delta": {"tool_calls": [head]}, "finish_reason": None}])
                    for piece in _chunks(args, 16):
                        send([{"index": 0, "delta": {"tool_calls": [{"index": i, "function": {"arguments": piece}}]},
                               "finish_reason": None}])
                if turn.get("stream_error"):  # what an OpenAI server sends when it fails mid-stream
                    self.wfile.write(f"data: {json.dumps({'error': {'message': turn['stream_error']}})}\n\n".encode())
                    self.wfile.flush()
                if turn.get("drop") or turn.get("cut") or turn.get("stream_error"):  # a server that died mid-answer
                    self.close_connection = True
                    return
                send([{"index": 0, "delta": {}, "finish_reason": finish}])
                if (body.get("stream_options") or {}).get("include_usage"):
                    prompt = turn.get("prompt_tokens") or (
                        estimate_tokens(body.get("messages", [])) + estimate_tokens(body.get("tools") or []))
                    completion = estimate_tokens(content + turn.get("reasoning", "")) + sum(
                        estimate_tokens(json.dumps(c.get("arguments", {}))) for c in calls)
                    send([], usage={"prompt_tokens": prompt, "completion_tokens": completion,
                                    "total_tokens": prompt + completion})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

        return Handler


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m agent.scripted", description="Serve a scripted model.")
    ap.add_argument("script", help="JSON file: a list of turns, or {\"turns\": [...], \"summaries\": [...]}")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="scripted-model")
    args = ap.parse_args()
    with open(args.script) as f:
        data = json.load(f)
    turns, summaries = (data, None) if isinstance(data, list) else (data["turns"], data.get("summaries"))
    try:
        server = ScriptedServer(turns, summaries, model=args.model, port=args.port)
    except OSError as e:
        print(f"python -m agent.scripted: error: cannot listen on 127.0.0.1:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        raise SystemExit(2) from None
    with server as srv:
        print(f"serving {len(turns)} scripted turns at {srv.base_url}", flush=True)
        try:
            srv.thread.join()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
