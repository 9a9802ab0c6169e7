"""The full-screen interface (Textual). Imported only when `composer-agent` opens it, never by --help."""

from __future__ import annotations

from pathlib import Path

from agent.config import Config


def run(config: Config, root: Path, *, resume: str | None = None) -> int:
    from agent.tui.app import ComposerApp

    def connect(emit, ask):
        # Runs on the connect thread, after the first paint: the HTTP client's imports cost ~100 ms.
        from agent.interactive import Interactive

        return Interactive(config, root, emit=emit, ask=ask, resume=resume)

    app = ComposerApp(connect, root=root, approval=config.approval)
    code = app.run()
    return code or 0
