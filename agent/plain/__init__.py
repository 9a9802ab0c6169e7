"""Line mode (`composer-agent --plain`): prompt-toolkit input, output printed line by line.

Imported only when line mode starts; prompt_toolkit stays out of every other code path.
"""

from __future__ import annotations

from pathlib import Path

from agent.config import Config


def run(config: Config, root: Path, *, resume: str | None = None, mode: str | None = None) -> int:
    from agent.plain.app import run as run_line_mode

    return run_line_mode(config, root, resume=resume, mode=mode)
