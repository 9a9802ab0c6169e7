"""Tool speed, measured: the grep tool against raw ripgrep, and a parallel turn against its calls' sum.

    python bench/tools.py [--repeat 5]

Corpora are real code nobody here wrote: the Python standard library (copied to a temp folder
without the interpreter's own site-packages, which pyenv keeps inside it) and this environment's
site-packages. "raw rg" is the same search run directly (`rg` with the flags the tool passes, output
captured); the ratio is the tool's wall time (argument parsing, rg, collecting, sorting, formatting)
over that. Medians of --repeat runs, after one warm-up run each (page cache warm for both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

from agent.tools import Executor, ToolCall, ToolContext, default_registry
from agent.tools.files import rg_base_args

PATTERNS = [
    ("files_with_matches", r"def __init__\("),
    ("files_with_matches", r"frobnicate_nothing_matches"),
    ("content", r"raise NotImplementedError"),
    ("count", r"import re$"),
]


def median_time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def raw_rg_argv(rg: str, mode: str, pattern: str) -> list[str]:
    argv = rg_base_args(rg)
    if mode == "files_with_matches":
        argv.append("--files-with-matches")
    elif mode == "count":
        argv += ["--count", "--with-filename"]
    else:
        argv += ["--line-number", "--with-filename", "--no-heading", "--null", "--max-columns", "400",
                 "--max-columns-preview"]
    return argv + ["--regexp", pattern]


def bench_grep(corpus: Path, repeat: int) -> list[dict]:
    ctx = ToolContext.for_root(corpus)
    ex = Executor(default_registry(), ctx)
    rows = []
    for mode, pattern in PATTERNS:
        call = ToolCall("b", "grep", json.dumps({"pattern": pattern, "output_mode": mode}))
        result = ex.run([call])[0]
        assert result.ok, result.content
        argv = raw_rg_argv(ctx.rg, mode, pattern)
        t_raw = median_time(lambda argv=argv: subprocess.run(argv, cwd=corpus, capture_output=True), repeat)
        t_tool = median_time(lambda call=call: ex.run([call]), repeat)
        rows.append({"mode": mode, "pattern": pattern, "files": result.data["files"],
                     "raw_rg_s": t_raw, "tool_s": t_tool, "ratio": t_tool / t_raw})
    ex.close()
    return rows


def bench_parallel_turn(corpus: Path) -> dict:
    ctx = ToolContext.for_root(corpus)
    ex = Executor(default_registry(), ctx)
    calls = [
        ToolCall("1", "shell", json.dumps({"command": "sleep 0.5; echo a"})),
        ToolCall("2", "shell", json.dumps({"command": "sleep 0.5; echo b"})),
        ToolCall("3", "shell", json.dumps({"command": "sleep 0.5; echo c"})),
        ToolCall("4", "grep", json.dumps({"pattern": r"class \w+Error\(", "output_mode": "count"})),
        ToolCall("5", "glob", json.dumps({"pattern": "**/test_*.py"})),
        ToolCall("6", "read_file", json.dumps({"path": "json/decoder.py"})),
        ToolCall("7", "list_dir", json.dumps({"path": "email"})),
    ]
    ex.run(calls)  # warm-up
    t = time.perf_counter()
    results = ex.run(calls)
    wall = time.perf_counter() - t
    ex.close()
    assert all(r.ok for r in results), [r.content for r in results if not r.ok]
    total = sum(r.duration_s for r in results)
    return {"calls": len(calls), "wall_s": wall, "sum_of_calls_s": total, "speedup": total / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-stdlib-"))
    stdlib = tmp / "stdlib"
    shutil.copytree(sysconfig.get_paths()["stdlib"], stdlib,
                    ignore=shutil.ignore_patterns("site-packages", "__pycache__"), symlinks=True)
    site = Path(sysconfig.get_paths()["purelib"])
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    for name, corpus in (("stdlib", stdlib), ("site-packages", site)):
        n_files = sum(1 for _ in corpus.rglob("*.py"))
        print(f"\n## grep tool vs raw rg on {name} ({corpus}, {n_files} .py files)")
        print(f"{'mode':<20} {'pattern':<32} {'files':>6} {'raw rg':>9} {'tool':>9} {'ratio':>6}")
        for r in bench_grep(corpus, args.repeat):
            print(f"{r['mode']:<20} {r['pattern']:<32} {r['files']:>6} {r['raw_rg_s'] * 1e3:>7.1f}ms "
                  f"{r['tool_s'] * 1e3:>7.1f}ms {r['ratio']:>5.2f}x")
    p = bench_parallel_turn(stdlib)
    print(f"\n## one parallel turn on stdlib: {p['calls']} calls (3x sleep 0.5, grep, glob, read, list)")
    print(f"wall {p['wall_s']:.3f} s vs sum of calls {p['sum_of_calls_s']:.3f} s -> {p['speedup']:.2f}x")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
