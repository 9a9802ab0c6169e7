"""Which implementation runs: the Triton kernels or their torch references.

The rule, for `backend="auto"` (every public entry point takes a `backend` argument):
- a CUDA tensor runs the Triton kernel when triton can be imported, else the torch reference;
- a CPU tensor runs the Triton kernel only under the Triton interpreter (`TRITON_INTERPRET=1` in the
  environment), else the torch reference, so that the server works on a machine with no GPU.

`backend="triton"` insists on the kernel (and says why when it cannot run); `backend="torch"` insists on
the reference.

Limits: triton reads `TRITON_INTERPRET` when a `@triton.jit` function is *defined*, that is when one of
our `*_triton.py` modules is first imported. Set the variable before that import (tests do it in
`tests/kernels/conftest.py`) and do not flip it later in the same process. triton itself is imported
lazily, so `import kernels` works on an install without it (the agent-only install).
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]


@cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when the Triton interpreter is on (kernels run on the CPU through NumPy)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def why_not_triton(device: torch.device) -> str | None:
    """None when the Triton kernels can run for tensors on `device`, else the reason they cannot."""
    if not triton_installed():
        return "triton is not installed (pip install 'composer[kernels]')"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None
    if device.type == "cpu":
        return "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before triton is imported"
    return f"no Triton backend for device type {device.type!r}"


def use_triton(device: torch.device, backend: Backend = "auto") -> bool:
    if backend == "torch":
        return False
    reason = why_not_triton(device)
    if backend == "triton":
        if reason is not None:
            raise RuntimeError(f"backend='triton' cannot run here: {reason}")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', not {backend!r}")
    return reason is None
