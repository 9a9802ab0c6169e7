"""Driving ComposerApp in tests: a real controller against a scripted loopback server, polled waits,
and the screen as plain text for snapshots."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from agent.config import Config
from agent.interactive import Interactive
from agent.tui.app import ComposerApp

SIZE = (100, 32)


def make_app(root: Path, base_url: str, approval: str = "auto", resume: str | None = None, builtin: bool = False,
             **kw) -> ComposerApp:
    config = Config(base_url=base_url, approval=approval)
    config.builtin_model = builtin  # as composer-agent sets it when it serves the built-in model itself
    return ComposerApp(lambda emit, ask: Interactive(config, root, emit=emit, ask=ask, resume=resume), root=root,
                       approval=approval, **kw)


async def until(pilot, condition: Callable[[], object], what: str, timeout: float = 15.0):
    """Let the app run until `condition()` is truthy; fail with `what` (and the screen) otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await pilot.pause(0.02)
    raise AssertionError(f"timed out waiting for {what}; the screen was:\n{screen_text(pilot.app)}")


async def shows(pilot, *texts: str, timeout: float = 15.0) -> str:
    """Wait until the screen shows every one of `texts` (widgets repaint a frame after they change)."""
    return await until(pilot, lambda: all(t in (s := screen_text(pilot.app)) for t in texts) and s,
                       f"the screen to show {texts}", timeout)


async def connected(pilot) -> None:
    await until(pilot, lambda: pilot.app.controller is not None, "the controller to connect")


async def send(pilot, text: str) -> None:
    pilot.app.prompt.focus()
    pilot.app.prompt.set_text(text)
    await pilot.press("enter")


def screen_text(app: ComposerApp) -> str:
    """What the terminal shows, as text (styles dropped), trailing spaces trimmed."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True,
                      legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True))  # what export_screenshot renders
    return "\n".join(line.rstrip() for line in console.export_text(styles=False).splitlines()) + "\n"


def card_states(app: ComposerApp) -> list[str]:
    return [c.state for c in app.transcript.cards.values()]
