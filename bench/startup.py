"""Start-up time of `composer-agent`, measured: --help and --version against a bare interpreter.

    python bench/startup.py [--repeat 20]

Each figure is the median wall time of a fresh process (spawn, interpreter start, imports, exit).
The goal for --help is well under 250 ms; `python -c pass` is the floor no Python CLI can beat.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def median_ms(argv: list[str], repeat: int) -> float:
    subprocess.run(argv, capture_output=True)  # warm the page cache
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    exe = shutil.which("composer-agent") or str(Path(sys.executable).parent / "composer-agent")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    rows = [
        ("python -c pass (floor)", [sys.executable, "-c", "pass"]),
        ("composer-agent --version", [exe, "--version"]),
        ("composer-agent --help", [exe, "--help"]),
    ]
    for name, argv in rows:
        print(f"{name:<28} {median_ms(argv, args.repeat):7.1f} ms")


if __name__ == "__main__":
    main()
