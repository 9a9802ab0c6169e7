"""Third-party chatter goes to a log file, not to the user: torchao's failed extension loads, torch's and
transformers' deprecation notices, Python warnings, download bars.

Those libraries log through handlers of their own that write to stderr (torch and transformers install
one when imported), or through logging's last resort, and Python warnings print to stderr. A user of
`composer-agent index` sees them as errors, and in the full-screen interface they land on the screen.
`route()` points the libraries' loggers and Python warnings at one log file instead; it runs where the
index extra is imported (index.embed), before the heavy imports and again after them, since importing
is what installs those handlers. Our own messages are printed, never logged, so they still show.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

# The loggers of the libraries the index extra imports (children such as torch.utils._pytree follow).
THIRD_PARTY = (
    "torch",
    "torchao",
    "transformers",
    "sentence_transformers",
    "huggingface_hub",
    "safetensors",
    "accelerate",
    "faiss",
    "filelock",
    "urllib3",
    "py.warnings",
)

_log_file: Path | None = None
_handler: logging.Handler | None = None


def use_log_file(path: Path) -> None:
    """Log to `path` (the CLI picks one under the workspace's .composer/); call before `route()`."""
    global _log_file
    _log_file = path


def log_file() -> Path:
    if _log_file is not None:
        return _log_file
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "composer" / "index.log"


def _the_handler() -> logging.Handler:
    global _handler
    if _handler is None:
        path = log_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _handler = logging.FileHandler(path, delay=True, encoding="utf-8")
        except OSError:  # nowhere to write: dropping the chatter still beats showing it
            _handler = logging.NullHandler()
        _handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    return _handler


def route() -> None:
    """Send the libraries' log records and Python warnings to the log file (idempotent)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
    handler = _the_handler()
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger, routed below
    for name in THIRD_PARTY:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if h is not handler:
                logger.removeHandler(h)  # torch's and transformers' own stderr handlers
        if handler not in logger.handlers:
            logger.addHandler(handler)
        logger.propagate = False  # not on to the root logger (or logging's last resort, on stderr)
