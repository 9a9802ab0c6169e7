"""The model client: OpenAI-compatible chat completions, streamed, with retries and clear errors.

`OpenAIClient.complete()` streams one assistant turn. Content deltas go through the text-format
parser (agent.toolcall_text) on the way, so `<think>` blocks become reasoning and tool calls that a
server left inside `content` (Hermes or Qwen3-Coder text) become real tool calls; servers that stream
structured `tool_calls` are read directly. Each tool call is handed to `on_tool_call` as soon as it is
complete, so the loop can start running it while the model is still streaming.

Errors: connection failures, 429 and 5xx are retried with exponential backoff (Retry-After honoured);
401/403, 404 and unknown models are not, and come out as ModelError(kind="config"), which front-ends
report in one line and exit 2 on. A 400 that says the prompt is too long is kind="context_overflow"
(the loop summarises and tries again).

An answer is whole only with [DONE] or a finish_reason: a stream that breaks or just ends before
either (a server dying mid-answer) is asked again, unless a tool it called already started, since
asking again would run that tool twice. Then the turn keeps the calls already started and the run
stops with kind="cut_off".

With `record_tokens` the request also asks for token ids and logprobs (composer-serve's and vLLM's
`return_token_ids`), and the turn carries a TokenRecord: exactly what the server sampled, for RL.
"""

from __future__ import annotations

import base64
import binascii
import json
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.config import Config
from agent.protocol import Message, Usage
from agent.toolcall_text import StreamParser
from agent.tools.executor import ToolCall

RETRY_STATUSES = {408, 409, 429, 500, 502, 503, 504}


class ModelError(Exception):
    """kind: config | context_overflow | request | server | cut_off | interrupted."""

    def __init__(self, message: str, kind: str, status: int | None = None, partial: ModelTurn | None = None):
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.partial = partial


@dataclass
class TokenRecord:
    """What the server tokenised and sampled for one request: training uses these ids, never a re-encoding."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float | None]  # one per completion id, under the sampling policy
    policy_version: int | None = None  # composer-serve's weights version (the oldest, if it changed mid-stream)
    routed_experts: dict[str, Any] | None = None  # the MoE experts of each token read (return_routed_experts)
    numerics: dict[str, Any] | None = None  # composer-serve's serve_dtype and batch_invariant: how they were computed


@dataclass
class ModelTurn:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    ttft_s: float = 0.0
    duration_s: float = 0.0
    tokens: TokenRecord | None = None  # only with record_tokens


@dataclass
class StreamCallbacks:
    on_text: Callable[[str], None] = lambda text: None
    on_reasoning: Callable[[str], None] = lambda text: None
    on_tool_call: Callable[[ToolCall], None] = lambda call: None
    on_retry: Callable[[int, float, str], None] = lambda attempt, delay, reason: None


class Model(Protocol):
    """What the loop needs from a model: one streamed assistant turn per call."""

    name: str

    def complete(self, messages: list[Message], tools: list[dict[str, Any]] | None,
                 cb: StreamCallbacks, cancel: threading.Event, max_tokens: int | None = None) -> ModelTurn:
        """max_tokens: this request's cap (a token budget's remainder), else the model's own setting."""
        ...


def estimate_tokens(obj: Any) -> int:
    """A rough token count (4 chars per token) for servers that report no usage."""
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return max(1, len(text) // 4)


class _Transient(Exception):
    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.retry_after = retry_after


class OpenAIClient:
    def __init__(self, config: Config):
        import httpx  # lazily: keeps `composer-agent --help` fast

        self._httpx = httpx
        self.config = config
        self.base_url = config.base_url
        self.name = config.model or ""
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(
            connect=10.0, read=config.request_timeout_s, write=60.0, pool=10.0))
        self._feed: _Feed | None = None

    # -- start-up check -------------------------------------------------------------------------------

    def check(self) -> tuple[str, int | None]:
        """Reach the server, resolve the model name; return (model, server's context window or None)."""
        url = f"{self.base_url}/models"
        try:
            r = self.http.get(url, timeout=15.0)
        except self._httpx.HTTPError as e:
            raise ModelError(f"cannot reach the model server at {url}: {_reason(e)}", "config") from None
        if r.status_code in (401, 403):
            raise ModelError(_auth_message(self.base_url, r), "config", r.status_code)
        if r.status_code != 200:  # some servers have no /models: trust the configuration
            if not self.name:
                raise ModelError(f"{url} answered HTTP {r.status_code}; set the model with --model", "config")
            return self.name, None
        try:
            models = r.json().get("data") or []
        except (ValueError, AttributeError):
            models = []
        ids = [m.get("id") for m in models if isinstance(m, dict)]
        if not self.name:
            if not ids:
                raise ModelError(f"the server at {self.base_url} lists no models; set --model", "config")
            self.name = ids[0]
        elif ids and self.name not in ids:
            raise ModelError(f"model {self.name!r} does not exist at {self.base_url}; "
                             f"available: {', '.join(map(str, ids))}", "config", 404)
        card = next((m for m in models if m.get("id") == self.name), {})
        window = card.get("max_model_len") or card.get("context_length") or card.get("context_window")
        return self.name, int(window) if isinstance(window, int | float) else None

    # -- one turn -------------------------------------------------------------------------------------

    def complete(self, messages: list[Message], tools: list[dict[str, Any]] | None,
                 cb: StreamCallbacks, cancel: threading.Event, max_tokens: int | None = None) -> ModelTurn:
        body: dict[str, Any] = {"model": self.name, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}}
        if tools:
            body |= {"tools": tools, "tool_choice": "auto", "parallel_tool_calls": True}
        if self.config.temperature is not None:
            body["temperature"] = self.config.temperature
        if self.config.seed is not None:
            body["seed"] = self.config.seed
        if max_tokens is None:
            max_tokens = self.config.max_output_tokens
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if self.config.record_tokens:
            body |= {"return_token_ids": True, "logprobs": True, "return_routed_experts": True}
        attempt = 0
        while True:
            try:
                return self._stream(body, tools, cb, cancel)
            except _Transient as e:
                attempt += 1
                if attempt > self.config.max_retries:
                    raise ModelError(f"{e} (gave up after {self.config.max_retries} retries)", "server") from None
                delay = e.retry_after if e.retry_after is not None else min(30.0, 0.5 * 2 ** (attempt - 1))
                cb.on_retry(attempt, delay, str(e))
                if cancel.wait(delay):
                    raise ModelError("interrupted", "interrupted") from None

    def interrupt(self) -> None:
        """Close the connection of the request under way (called from another thread): the server stops
        working on it, and the stream waiting on it ends at once, even before the first byte came back."""
        feed = self._feed
        if feed is not None:
            feed.close()

    def _stream(self, body, tools, cb: StreamCallbacks, cancel: threading.Event) -> ModelTurn:
        httpx = self._httpx
        url = f"{self.base_url}/chat/completions"
        start = time.monotonic()
        acc = _Accumulator(tools, cb, start, _Tokens(self.base_url) if body.get("return_token_ids") else None)
        feed = self._feed = _Feed(self.http, url, body)
        whole = False  # the stream came to its end: leave the connection to the pool
        try:
            r = feed.next(cancel)
            if r is _CANCELLED:
                raise ModelError("interrupted", "interrupted", partial=acc.finish(body, partial=True))
            if r.status_code != 200:
                self._raise_for_status(r)
            if "text/event-stream" not in r.headers.get("content-type", "text/event-stream"):
                acc.whole_response(_json_body(r.content, url))
                whole = True
                return acc.finish(body)
            ended = self._read_events(feed, acc, body, cancel)
            whole = ended or acc.finish_reason is not None
        except ModelError:
            raise
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                httpx.ReadTimeout, httpx.WriteError, httpx.PoolTimeout) as e:
            if cancel.is_set():
                raise ModelError("interrupted", "interrupted", partial=acc.finish(body, partial=True)) from None
            if acc.finish_reason is None:
                _cut_off(acc, body, f"{type(e).__name__} talking to {url}: {_reason(e)}")
            ended = True  # the answer was whole; only [DONE] or the usage chunk was lost
        finally:
            if not whole or cancel.is_set():
                feed.close()
            self._feed = None
        if not ended and acc.finish_reason is None:
            _cut_off(acc, body, acc.stream_error or f"the stream from {url} ended without [DONE] or a finish_reason")
        return acc.finish(body)

    def _read_events(self, feed: _Feed, acc: _Accumulator, body, cancel: threading.Event) -> bool:
        """Feed the SSE events to `acc`; True when the stream ended with [DONE]."""
        while True:
            line = feed.next(cancel)
            if line is _CANCELLED:
                raise ModelError("interrupted", "interrupted", partial=acc.finish(body, partial=True))
            if line is None:
                return False
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return True
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and obj.get("error"):
                acc.stream_error = f"the server reported an error mid-stream: {_stream_error_message(obj['error'])}"
                continue
            acc.chunk(obj)

    def _raise_for_status(self, r) -> None:
        status, message = r.status_code, _error_message(r)
        if status in RETRY_STATUSES or status >= 500:
            retry_after = r.headers.get("retry-after")
            delay = float(retry_after) if retry_after and retry_after.replace(".", "").isdigit() else None
            raise _Transient(f"HTTP {status} from {self.base_url}: {message}", delay)
        if status in (401, 403):
            raise ModelError(_auth_message(self.base_url, r), "config", status)
        if status == 404:
            if "model" in message.lower():
                raise ModelError(f"model {self.name!r} does not exist at {self.base_url}: {message}", "config", 404)
            raise ModelError(f"HTTP 404 from {self.base_url}/chat/completions: {message} "
                             "(base_url should end with the API version, e.g. /v1)", "config", 404)
        lowered = message.lower()
        if status == 400 and "context" in lowered and any(w in lowered for w in ("length", "maximum", "long")):
            raise ModelError(f"the prompt is too long for the model: {message}", "context_overflow", 400)
        raise ModelError(f"HTTP {status} from {self.base_url}: {message}", "request", status)


_CANCELLED: Any = object()
_POLL_S = 0.02  # how often a wait on the network looks at the cancel flag


class _Feed:
    """One streamed request, read by a thread of its own: the response, then its lines, then None.

    The caller waits on a queue, not on the socket, so an interrupt takes effect at once whatever the
    server is doing (a slow prefill sends nothing for seconds). `close()` shuts the socket down, which
    wakes a blocked read at once; a close() alone would not, and the server would not notice."""

    def __init__(self, http, url: str, body: dict[str, Any]):
        self.queue: queue.Queue[Any] = queue.Queue()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, args=(http, url, body), name="model-stream", daemon=True)
        self.thread.start()

    def _trace(self, name: str, info: dict[str, Any]) -> None:
        if name == "connection.connect_tcp.complete":  # a new connection: kept so close() can reach it early
            self._keep(info.get("return_value"))

    def _keep(self, stream: Any) -> None:
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            with self.lock:
                self.sockets.append(sock)
            if self.closed.is_set():
                self._shutdown()

    def _run(self, http, url: str, body: dict[str, Any]) -> None:
        try:
            with http.stream("POST", url, json=body, extensions={"trace": self._trace}) as r:
                self._keep(r.extensions.get("network_stream"))
                if self.closed.is_set():
                    return
                if r.status_code != 200 or "text/event-stream" not in r.headers.get(
                        "content-type", "text/event-stream"):
                    r.read()
                self.queue.put(r)
                for line in r.iter_lines():
                    if self.closed.is_set():
                        return
                    self.queue.put(line)
            self.queue.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which decides
            self.queue.put(e)

    def next(self, cancel: threading.Event) -> Any:
        """The next item (the response, a line, or None at the end), or _CANCELLED; errors are raised."""
        while True:
            if cancel.is_set():
                return _CANCELLED
            try:
                item = self.queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def close(self) -> None:
        self.closed.set()
        self._shutdown()

    def _shutdown(self) -> None:
        with self.lock:
            sockets = list(self.sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass


def _cut_off(acc: _Accumulator, body: dict[str, Any], why: str) -> None:
    """The answer stopped before its end. Ask again, unless a tool it called is already running: asking
    again would run that twice, so the turn ends as it came, with those calls only, and the run stops."""
    if not acc.started_calls():
        raise _Transient(why if acc.first is None else f"the answer was cut off: {why}")
    partial = acc.cut_short(body)
    n = len(partial.tool_calls)
    raise ModelError(f"the model's answer was cut off ({why}) after {n} tool call{'s' if n != 1 else ''} had "
                     "started; those ran once and their results are in the session, the rest of the answer "
                     "is lost (resume the session to go on)", "cut_off", partial=partial)


def _json_body(raw: bytes, url: str) -> dict[str, Any]:
    """A non-streamed answer; one that does not parse was cut on the way (asked again)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        raise _Transient(f"the answer from {url} was cut off: its JSON body is incomplete") from None
    if not isinstance(obj, dict):
        raise _Transient(f"the answer from {url} is not a JSON object")
    return obj


def _stream_error_message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)[:300]
    return str(err)[:300]


class _Accumulator:
    """Builds a ModelTurn from streamed chunks (or one whole response)."""

    def __init__(self, tools, cb: StreamCallbacks, start: float, tokens: _Tokens | None = None):
        self.cb = cb
        self.tokens = tokens
        self.start = start
        self.first: float | None = None
        self.parser = StreamParser("auto", tools, reasoning=True)
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}
        self.emitted: set[int] = set()
        self.text_calls: list[ToolCall] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.stream_error: str | None = None  # an error object the server sent in the stream

    def _mark(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def chunk(self, obj: dict[str, Any]) -> None:
        if self.tokens is not None:
            self.tokens.chunk(obj)
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self._mark()
                self.reasoning.append(reasoning)
                self.cb.on_reasoning(reasoning)
            if delta.get("content"):
                self._mark()
                self._parse(self.parser.feed(delta["content"]))
            for tc in delta.get("tool_calls") or []:
                self._mark()
                self._tool_delta(tc)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def whole_response(self, obj: dict[str, Any]) -> None:
        self.usage = obj.get("usage")
        choice = (obj.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        # A whole response is one chunk holding everything (token ids and logprobs in the same places).
        self.chunk({"prompt_token_ids": obj.get("prompt_token_ids"), "policy_version": obj.get("policy_version"),
                    "serve_dtype": obj.get("serve_dtype"), "batch_invariant": obj.get("batch_invariant"),
                    "choices": [{"delta": {"content": msg.get("content"),
                                           "reasoning_content": msg.get("reasoning_content"),
                                           "tool_calls": [dict(tc, index=i) for i, tc in
                                                          enumerate(msg.get("tool_calls") or [])]},
                                 "token_ids": choice.get("token_ids"), "logprobs": choice.get("logprobs"),
                                 "finish_reason": choice.get("finish_reason")}]})

    def _tool_delta(self, tc: dict[str, Any]) -> None:
        idx = tc.get("index")
        if idx is None:
            idx = max(self.calls, default=0) if self.calls and not tc.get("id") else len(self.calls)
        for earlier in [i for i in self.calls if i < idx and i not in self.emitted]:
            self._emit_structured(earlier)
        slot = self.calls.setdefault(idx, {"id": "", "name": "", "arguments": ""})
        if tc.get("id"):
            slot["id"] = tc["id"]
        fn = tc.get("function") or {}
        if fn.get("name"):
            slot["name"] = fn["name"] if not slot["name"] else slot["name"] + fn["name"]
        if fn.get("arguments"):
            args = fn["arguments"]
            slot["arguments"] += args if isinstance(args, str) else json.dumps(args)

    def _emit_structured(self, idx: int) -> None:
        self.emitted.add(idx)
        slot = self.calls[idx]
        slot["id"] = slot["id"] or new_call_id()
        self.cb.on_tool_call(ToolCall(slot["id"], slot["name"], slot["arguments"]))

    def _parse(self, items) -> None:
        for it in items:
            if it.kind == "content":
                self.content.append(it.text)
                self.cb.on_text(it.text)
            elif it.kind == "reasoning":
                self.reasoning.append(it.text)
                self.cb.on_reasoning(it.text)
            elif it.call is not None:
                call = ToolCall(new_call_id(), it.call.name, it.call.arguments)
                self.text_calls.append(call)
                self.cb.on_tool_call(call)

    def started_calls(self) -> bool:
        return bool(self.emitted or self.text_calls)

    def finish(self, body: dict[str, Any], partial: bool = False) -> ModelTurn:
        """The whole turn; `partial` (interrupted): as far as it came, token ids included unchecked."""
        # Checked before handing out the calls held back till now, so a bad record starts no more tools.
        tokens = self.tokens.record(strict=not partial) if self.tokens is not None else None
        self._parse(self.parser.close())
        for idx in sorted(self.calls):
            if idx not in self.emitted:
                self._emit_structured(idx)
        return self._turn(body, sorted(self.calls), tokens)

    def cut_short(self, body: dict[str, Any]) -> ModelTurn:
        """The turn as far as a broken stream brought it: only the calls already handed out."""
        self.finish_reason = "connection_lost"
        tokens = self.tokens.record(strict=False) if self.tokens is not None else None
        return self._turn(body, sorted(self.emitted), tokens)

    def _turn(self, body: dict[str, Any], structured: list[int], tokens: TokenRecord | None = None) -> ModelTurn:
        calls = [ToolCall(self.calls[i]["id"], self.calls[i]["name"], self.calls[i]["arguments"]) for i in structured]
        calls += self.text_calls
        content = "".join(self.content)
        if self.text_calls:
            content = content.strip()
        end = time.monotonic()
        if self.usage:
            details = self.usage.get("prompt_tokens_details") or {}
            usage = Usage(int(self.usage.get("prompt_tokens") or 0), int(self.usage.get("completion_tokens") or 0),
                          cached_tokens=int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0)
        else:
            usage = Usage(estimate_tokens(body.get("messages", [])) + estimate_tokens(body.get("tools") or []),
                          estimate_tokens(content + "".join(self.reasoning)) + sum(
                              estimate_tokens(c.arguments) for c in calls), estimated=True)
        return ModelTurn(content, "".join(self.reasoning), calls, self.finish_reason, usage,
                         (self.first or end) - self.start, end - self.start, tokens)


class _Tokens:
    """Collects the token ids and logprobs a server streams (record_tokens) into a TokenRecord."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.prompt: list[int] | None = None
        self.completion: list[int] = []
        self.saw_completion = False  # a server that ignores return_token_ids sends no `token_ids` key
        self.logprobs: list[float | None] = []
        self.version: int | None = None
        self.routes: dict[str, Any] | None = None
        self.numerics: dict[str, Any] | None = None

    def chunk(self, obj: dict[str, Any]) -> None:
        if obj.get("prompt_token_ids") is not None:
            self.prompt = list(obj["prompt_token_ids"])
        if isinstance(obj.get("serve_dtype"), str):
            self.numerics = {"serve_dtype": obj["serve_dtype"], "batch_invariant": bool(obj.get("batch_invariant"))}
        version = obj.get("policy_version")
        if isinstance(version, int):
            # Weights may change mid-stream; the oldest version bounds how stale these tokens are.
            self.version = version if self.version is None else min(self.version, version)
        for choice in obj.get("choices") or []:
            if choice.get("token_ids") is not None:
                self.saw_completion = True
                self.completion += choice["token_ids"]
            if isinstance(choice.get("routed_experts"), dict):
                self.routes = choice["routed_experts"]
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                self.logprobs.append(entry.get("logprob"))

    def record(self, strict: bool) -> TokenRecord | None:
        """The record; strict (a finished turn) raises ModelError when the server's answer cannot be trained on."""
        if not strict:
            if self.prompt is None and not self.saw_completion:
                return None
            # A cut stream may end between a chunk's ids and its logprobs: pad so that they still pair up.
            logprobs = (self.logprobs + [None] * len(self.completion))[: len(self.completion)]
            return TokenRecord(self.prompt or [], self.completion, logprobs, self.version, numerics=self.numerics)
        missing = [name for name, absent in (("prompt_token_ids", self.prompt is None),
                                             ("completion token_ids", not self.saw_completion)) if absent]
        if missing:
            what = "none" if len(missing) == 2 else f"no {missing[0]}"
            raise ModelError("--record-tokens needs a server that returns token ids (composer-serve, or vLLM "
                             f">= 0.10.2 with return_token_ids); {self.base_url} returned {what}", "config")
        if len(self.logprobs) != len(self.completion):
            raise ModelError(f"{self.base_url} returned {len(self.logprobs)} logprobs for {len(self.completion)} "
                             "completion token ids; --record-tokens needs one per token", "request")
        return TokenRecord(self.prompt, self.completion, self.logprobs, self.version, self.routes, self.numerics)


def routes_from(routes: dict[str, Any], start: int) -> dict[str, Any] | None:
    """A server's routed_experts ({start, shape [T, M, K], dtype, data: base64}) from token `start` of
    it on (a malformed one: None, and the trainer routes those tokens itself)."""
    try:
        (n, m, k), item = routes["shape"], {"uint8": 1, "int16": 2}[routes["dtype"]]
        raw = base64.b64decode(routes["data"], validate=True)
        if len(raw) != n * m * k * item or not 0 <= start <= n:
            return None
        return {"start": int(routes["start"]) + start, "shape": [n - start, m, k], "dtype": routes["dtype"],
                "data": base64.b64encode(raw[start * m * k * item:]).decode("ascii")}
    except (KeyError, TypeError, ValueError, binascii.Error):
        return None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(8)


def _reason(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text.split("] ")[-1] if "Errno" in text else text


def _error_message(r) -> str:
    try:
        data = r.json()
    except ValueError:
        return (r.text or "").strip()[:300] or r.reason_phrase
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data))
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        return str(err)[:300]
    return str(data)[:300]


def _auth_message(base_url: str, r) -> str:
    return (f"the server at {base_url} refused the request (HTTP {r.status_code}: {_error_message(r)}); "
            "check --api-key / COMPOSER_API_KEY")
