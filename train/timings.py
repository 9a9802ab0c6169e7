"""Varied timings in recorded tool results: SFT data that does not tie the model to one machine's speed.

Tool results carry wall-clock times: the shell tool ends every result with `[exit code 1; 0.3 s]`, and
pytest's summary says `1 failed, 4 passed in 0.03s`. Expert trajectories are recorded on one machine
at one load, so every time in them falls in a narrow band (shell 0.2-0.8 s, pytest 0.01-0.05 s on the
2-core VM), and a small model learns those bytes as part of its context. Measured on composer-tiny:
with 16 episodes at once on 2 cores the same tool calls took 0.6-2.7 s, and the training pass rate at
T=1 fell from 0.60 to 0.33 with nothing else changed (BENCHMARKS.md, "Slow tool calls threw the built-in model off").

`vary_timings` rewrites those times in a recorded session as another machine would have reported them:
one slowness factor per episode (log-uniform, 0.3x to 30x; the original times kept with probability
`keep`), a little jitter per result, and the prompt token ids of every request rendered again with the
model's chat format. What the expert answered is unchanged (its choices never depend on the times), so
the sample stays a correct demonstration; only the context around it varies.
"""

from __future__ import annotations

import copy
import math
import random
import re

from agent.session import SessionData

SHELL_TIME = re.compile(r"(\[[^\[\]\n]*; )(\d+(?:\.\d+)?)( s\])\s*$")
PYTEST_TIME = re.compile(r"(\b(?:passed|failed|error|errors|skipped|xfailed|xpassed|warnings?|deselected|"
                         r"no tests ran) in )(\d+\.\d+)(s\b)")


def slowness(rng: random.Random, keep: float = 0.5, low: float = 0.3, high: float = 30.0) -> float:
    """1.0 with probability `keep`, else log-uniform in [low, high]."""
    if rng.random() < keep:
        return 1.0
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def retime(text: str, factor: float, rng: random.Random) -> str:
    """`text` with its shell and pytest times multiplied by `factor` (x a +-20% jitter each)."""
    if factor == 1.0:
        return text

    def scaled(value: str) -> float:
        return float(value) * factor * rng.uniform(0.8, 1.2)

    text = PYTEST_TIME.sub(lambda m: f"{m[1]}{scaled(m[2]):.2f}{m[3]}", text)
    return SHELL_TIME.sub(lambda m: f"{m[1]}{max(0.0, scaled(m[2])):.1f}{m[3]}", text)


def vary_timings(data: SessionData, chat, rng: random.Random, keep: float = 0.5) -> SessionData:
    """A copy of `data` whose tool results report the times of a machine `slowness()` times as fast, its
    request records' prompt ids rendered again by `chat` (ChatFormat of the model being trained)."""
    factor = slowness(rng, keep)
    if factor == 1.0:
        return data
    records = copy.deepcopy(data.records)
    for rec in records:
        msg = rec.get("message") if rec.get("type") == "message" else None
        if msg and msg.get("role") == "tool" and isinstance(msg.get("content"), str):
            msg["content"] = retime(msg["content"], factor, rng)
    out = SessionData.from_records(records)
    tools = data.meta.get("tools") or None
    for rec, sent in out.requests():
        if rec.get("prompt_token_ids") is not None:
            rec["prompt_token_ids"] = chat.render_ids(sent, tools if rec.get("purpose", "turn") == "turn" else None)
            rec.pop("routed_experts", None)  # positions moved; the trainer routes these tokens itself
    return out
