"""What the server says in its log: one access line per request, and a throughput line while busy.

    composer.access: POST /v1/chat/completions 200 prompt_tokens=35 completion_tokens=12 ttft=0.081s duration=0.412s
    (with speculative decoding, after completion_tokens: spec_drafted=20 spec_accepted=9)
    composer.throughput: prompt 310.2 tokens/s, generation 95.0 tokens/s, running 8, waiting 2, KV cache 12.5%

The access line is written when the response's last byte has gone (a stream's duration is the whole
stream). Token counts and the time to first token come from serve/generation.py, which notes them on
the request's `Access` record through a context variable (the request's tasks inherit it), so every
endpoint is counted the same way. The throughput line (vLLM's "Avg prompt throughput" line) comes every
`interval` seconds while anything is running, waiting or was generated since the last one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

access_log = logging.getLogger("composer.access")
throughput_log = logging.getLogger("composer.throughput")


@dataclass
class Access:
    start: float = field(default_factory=time.monotonic)
    prompts: dict[int, int] = field(
        default_factory=dict
    )  # prompt ids object -> its length (n choices share one)
    completion_tokens: int = 0
    first_token: float | None = None
    drafted: int = 0  # speculative decoding: draft tokens verified for this request, and accepted
    accepted: int = 0

    def line(self, method: str, path: str, status: int) -> str:
        ttft = f"{self.first_token - self.start:.3f}s" if self.first_token is not None else "-"
        spec = f" spec_drafted={self.drafted} spec_accepted={self.accepted}" if self.drafted else ""
        return (
            f"{method} {path} {status} prompt_tokens={sum(self.prompts.values())} "
            f"completion_tokens={self.completion_tokens}{spec} ttft={ttft} duration={time.monotonic() - self.start:.3f}s"
        )


current: ContextVar[Access | None] = ContextVar("composer_access", default=None)


class Totals:
    """Tokens since start, counted as they happen (a long generation shows up while it runs)."""

    prompt = 0
    generated = 0


def prompt_started(prompt_ids: list[int]) -> None:
    Totals.prompt += len(prompt_ids)
    if (a := current.get()) is not None:
        a.prompts[id(prompt_ids)] = len(prompt_ids)


def token_generated(drafted: int = 0, accepted: bool = False) -> None:
    Totals.generated += 1
    if (a := current.get()) is not None:
        a.completion_tokens += 1
        a.drafted += drafted
        a.accepted += accepted
        if a.first_token is None:
            a.first_token = time.monotonic()


class AccessLog:
    """ASGI middleware: one line per HTTP request, at its end (or when it fails)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = Access()
        token = current.set(record)
        status = 500
        logged = False

        def log() -> None:
            nonlocal logged
            if not logged:
                logged = True
                access_log.info(record.line(scope["method"], scope["path"], status))

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log()

        try:
            await self.app(scope, receive, sending)
        finally:
            current.reset(token)
            log()


async def log_throughput(stats, interval: float) -> None:
    """Every `interval` seconds, while busy: tokens per second since the last line, queue and KV cache."""
    last = (time.monotonic(), Totals.prompt, Totals.generated)
    while True:
        await asyncio.sleep(interval)
        now = (time.monotonic(), Totals.prompt, Totals.generated)
        s = stats()
        if now[1:] != last[1:] or s.running or s.waiting:
            dt = max(now[0] - last[0], 1e-9)
            throughput_log.info(
                f"prompt {(now[1] - last[1]) / dt:.1f} tokens/s, generation "
                f"{(now[2] - last[2]) / dt:.1f} tokens/s, running {s.running}, waiting {s.waiting}, "
                f"KV cache {100 * s.kv_cache_usage:.1f}%"
                + (f", drafts accepted {100 * s.spec_accepted / s.spec_drafted:.1f}% "
                   f"({1 + s.spec_accepted / s.spec_verifies:.2f} tokens per verifying step)" if s.spec_drafted else "")
            )
        last = now
