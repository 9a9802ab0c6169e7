"""The full-screen interface (Textual). Imported only when `composer-agent` opens it, never by --help."""

from __future__ import annotations

from pathlib import Path

from agent.config import Config


def run(config: Config, root: Path, *, resume: str | None = None, mode: str | None = None) -> int:
    from agent.tui.app import ComposerApp

    def connect(emit, ask):
        # Runs on the connect thread, after the first paint: the HTTP client's imports cost ~100 ms.
        from agent.interactive import Interactive

        return Interactive(config, root, emit=emit, ask=ask, resume=resume, mode=mode)

    app = ComposerApp(connect, root=root, approval=config.approval)
    code = app.run()
    hint = app.controller.resume_hint() if app.controller is not None else None
    if hint:  # printed once the full screen is gone, so it stays in the terminal's scrollback
        print(hint)
    return code or 0
