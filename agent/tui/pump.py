"""Handing agent events from worker threads to the UI thread, at most once per frame.

The agent emits events from its own thread and from tool threads; a model streaming 200 tokens/s
would cost 200 widget updates a second if each event were applied on its own. Instead `EventPump`
collects events under a lock and arms a single timer on the UI loop when the first one arrives; when
it fires, the batch is applied in one go with consecutive text deltas of a turn joined. Nothing ticks
while the agent is idle.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Awaitable, Callable
from dataclasses import replace

from agent.protocol import Event, ReasoningDelta, TextDelta

FRAME_S = 1 / 60  # Textual paints at most 60 frames/s; batching finer than that buys nothing


def coalesce(events: list[Event]) -> list[Event]:
    """Join runs of TextDelta (and of ReasoningDelta) of the same turn; keep everything else in order."""
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, (TextDelta, ReasoningDelta)) and type(last) is type(ev) and last.turn == ev.turn:
            out[-1] = replace(last, text=last.text + ev.text)
        else:
            out.append(ev)
    return out


class EventPump:
    def __init__(self, apply: Callable[[list[Event]], Awaitable[None]], frame_s: float = FRAME_S):
        self.apply = apply
        self.frame_s = frame_s
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        self._armed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._set_timer: Callable[..., object] | None = None
        self._context: contextvars.Context | None = None
        self.batches = 0  # how many flushes ran (read by the benchmark)

    def attach(self, loop: asyncio.AbstractEventLoop, set_timer: Callable[..., object]) -> None:
        """Call on the UI thread once it runs; `set_timer(delay, callback)` is the app's timer."""
        self._loop, self._set_timer = loop, set_timer
        # Textual finds its app through context variables: arm the timer inside the UI's context.
        self._context = contextvars.copy_context()

    def __call__(self, event: Event) -> None:
        """Queue an event; safe from any thread."""
        with self._lock:
            self._pending.append(event)
            if self._armed:
                return
            self._armed = True
        assert self._loop is not None, "EventPump.attach() was not called"
        try:
            self._loop.call_soon_threadsafe(self._arm, context=self._context)
        except RuntimeError:
            pass  # the loop closed: the app is gone and nobody will see the event

    def _arm(self) -> None:
        assert self._set_timer is not None
        self._set_timer(self.frame_s, self.flush)

    async def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._armed = False
        if batch:
            self.batches += 1
            await self.apply(coalesce(batch))
