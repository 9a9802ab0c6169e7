"""Every Triton kernel of the serving path compiles for sm_90 and sm_100 (Triton's own compiler down to a
cubin, no GPU needed): what the interpreter cannot check (kernels/aot_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_and_blackwell():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter's kernels don't compile
    out = subprocess.run([sys.executable, "-m", "kernels.aot_check"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "all compiled" in out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith("sm_")]
    assert sum(line.startswith("sm_90:") for line in lines) >= 12 and sum(line.startswith("sm_100:") for line in lines) >= 13
