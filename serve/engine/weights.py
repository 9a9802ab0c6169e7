"""Policy versions and in-place weight loads: what engines that reload checkpoints share.

RL training writes a checkpoint after each step and tells the server to serve it; every completion
reports the policy version whose weights produced it, so the trainer knows how stale each sample is.
A version comes from the call, else from the checkpoint's `composer_policy.json`, else current + 1,
and it must strictly increase: two checkpoints with one version would make samples ambiguous.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLICY_FILE = "composer_policy.json"


@dataclass(eq=False)
class Reload:
    """A weight load waiting in an engine's inbox; the engine thread answers through `future`."""

    path: str
    version: int
    abort: bool
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    queued_at: float = field(default_factory=time.monotonic)
    aborted: int = 0


class WeightLoadError(ValueError):
    """A load that was refused or failed; the weights that were serving keep serving."""

    def __init__(self, message: str, param: str | None = "path"):
        super().__init__(message)
        self.param = param


class RequestAborted(RuntimeError):
    """Ends a request that was generating when a load with abort_in_flight came: it never gets a token
    from the new weights. `policy_version` is the version of the tokens it did get."""

    def __init__(self, policy_version: int, new_version: int):
        super().__init__(f"the request was aborted: the server switched from policy version {policy_version} "
                         f"to {new_version}; retry it")
        self.policy_version = policy_version


@dataclass
class WeightsLoaded:
    policy_version: int
    load_s: float
    """Reading, validating and swapping in the new weights."""
    wait_s: float = 0.0
    """Waiting for requests in flight to finish before that (0 when they were aborted)."""
    aborted: int = 0
    """Sequences (choices) aborted."""


def read_serve_dtype(model_dir: str | Path, allowed: tuple[str, ...]) -> str | None:
    """The dtype a checkpoint asks to be served in (`serve_dtype` in composer_policy.json) if it is one of
    `allowed`, else None: the built-in model asks for float64, so that its greedy answers are the same on
    every CPU (train/recipe.py export_serving writes it)."""
    try:
        dtype = json.loads((Path(model_dir) / POLICY_FILE).read_text()).get("serve_dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return dtype if dtype in allowed else None


def read_policy_version(model_dir: str | Path) -> int | None:
    """The `policy_version` of a checkpoint's composer_policy.json (other keys ignored), None without one."""
    path = Path(model_dir) / POLICY_FILE
    if not path.is_file():
        return None
    try:
        version = json.loads(path.read_text()).get("policy_version")
    except (OSError, ValueError, AttributeError) as e:
        raise WeightLoadError(f"{path} is not a JSON object: {e}") from None
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise WeightLoadError(f"{path}: policy_version must be a non-negative integer, not {version!r}")
    return version


def checkpoint_dir(path: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise WeightLoadError(f"{path} is not a folder")
    if not (p / "config.json").is_file():
        raise WeightLoadError(f"{path} is not a checkpoint folder (no config.json)")
    return p


def next_version(current: int, requested: int | None, path: Path) -> int:
    version = requested if requested is not None else read_policy_version(path)
    version = current + 1 if version is None else version
    if version <= current:
        raise WeightLoadError(f"policy_version must increase: {version} is not above the current {current}",
                              param="policy_version")
    return version


def config_mismatch(running: dict[str, Any], new: dict[str, Any], keys: list[str] | None = None) -> str | None:
    """'key: running vs new, ...' for the keys (default: all of `running`'s) that differ, else None."""
    diffs = [f"{k} {running.get(k)!r} vs {new.get(k)!r}" for k in keys or list(running)
             if running.get(k) != new.get(k)]
    return ", ".join(diffs) or None
