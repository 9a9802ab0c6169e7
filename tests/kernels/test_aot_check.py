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
    # one process per architecture, side by side: each compiles on one core (CI has two), half the wall time
    procs = [subprocess.Popen([sys.executable, "-m", "kernels.aot_check", "--arch", arch], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for arch in ("90", "100")]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stdout[-4000:] + stderr[-2000:]
        assert "all compiled" in stdout
    lines = [line for stdout, _ in outs for line in stdout.splitlines() if line.startswith("sm_")]
    assert sum(line.startswith("sm_90:") for line in lines) >= 12 and sum(line.startswith("sm_100:") for line in lines) >= 13
