"""A live progress line for training runs: one line redrawn in a terminal, one line per step in logs."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(self, total: int, start: int = 0, out: TextIO | None = None, label: str = "step"):
        self.total, self.done, self.label = total, start, label
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.t0 = time.monotonic()
        self.first = start

    def update(self, m: dict[str, Any]) -> None:
        self.done = int(m.get("step", self.done)) + 1
        elapsed = time.monotonic() - self.t0
        per = elapsed / max(1, self.done - self.first)
        eta = per * (self.total - self.done)
        parts = [f"{self.label} {self.done}/{self.total}"]
        for key, fmt in (("reward_mean", "reward {:.3f}"), ("pass_rate", "pass {:.0%}"), ("loss", "loss {:.4f}"),
                         ("completion_tokens", "tok {}"), ("staleness_mean", "stale {:.2f}"),
                         ("logprob_gap_max", "gap {:.1e}"), ("wait_s", "wait {:.1f}s")):
            if m.get(key) is not None:
                parts.append(fmt.format(m[key]))
        parts.append(f"eta {eta:.0f}s")
        line = " | ".join(parts)
        if self.tty:
            self.out.write("\r\033[K" + line)
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()
