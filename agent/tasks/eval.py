"""`composer-agent eval SUITE`: run a suite headless through the normal loop against any endpoint.

N episodes run at once, each task `repeat` times; every episode's result goes to OUT/results.jsonl as
it finishes (so `--resume` skips what is done), then OUT/report.json, a table on stdout and
OUT/report.png. Reported overall and per family: pass@1 (mean over repeats), pass@k (the unbiased
estimator, k = repeat), prompt and completion tokens, tool calls, tool calls per turn, turns and wall
time per episode, and the quality metrics of agent/tasks/quality.py (test edits, which fail an episode;
diff size, unneeded files and size against the reference fix; new lint problems; formatter-rewritten
lines; unsupported claims), each averaged over the episodes where it was measured; episodes lost to
infrastructure errors are counted apart, not as failures.
RL uses the same runner (agent.tasks.runner) for held-out pass rates.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Any

from agent.config import Config
from agent.tasks.quality import METRICS as QUALITY
from agent.tasks.quality import figures
from agent.tasks.runner import EpisodeResult, run_episode
from agent.tasks.spec import Task
from agent.tasks.variation import draw

METRICS = ("prompt_tokens", "completion_tokens", "tool_calls", "tool_calls_per_turn", "turns", "duration_s")


@dataclass
class EvalConfig:
    concurrency: int = 4
    """Episodes at once."""
    repeat: int = 1
    """Episodes per task (pass@k uses k = repeat)."""
    sandbox: bool | None = None
    """Shell under bubblewrap (default: when installed)."""
    vary_environment: bool = False
    """Each episode in a differently shaped folder, git state and date (training data; see
    agent/tasks/variation.py), drawn from its task id and repeat."""

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.repeat < 1:
            raise ValueError("concurrency and repeat must be at least 1")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _load_done(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by a kill
    return rows


def run_eval(tasks: list[Task], config: Config, ecfg: EvalConfig, out: str | Path, *, resume: bool = False,
             log=sys.stderr) -> dict[str, Any]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = _load_done(results_path) if resume else []
    if not resume:
        results_path.unlink(missing_ok=True)
    have = {(r["task_id"], r["repeat"]) for r in done}
    jobs = [(t, r) for r in range(ecfg.repeat) for t in tasks if (t.id, r) not in have]
    lock = threading.Lock()
    rows = list(done)
    start = time.monotonic()

    def one(job: tuple[Task, int]) -> None:
        task, r = job
        variation = draw(f"{task.id}/{r}") if ecfg.vary_environment else None
        res: EpisodeResult = run_episode(task, config, keep_dir=out / "sessions", label=f"r{r}", sandbox=ecfg.sandbox,
                                         variation=variation, quality=True)
        row = {**res.as_dict(), "repeat": r, "family": task.family or task.tag}
        with lock:
            rows.append(row)
            with open(results_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            passed = sum(x["passed"] for x in rows)
            line = (f"eval {len(rows)}/{len(tasks) * ecfg.repeat} | pass {passed}/{len(rows)} | "
                    f"{time.monotonic() - start:.0f}s")
            log.write(("\r\033[K" + line) if log.isatty() else line + "\n")
            log.flush()

    with ThreadPoolExecutor(max_workers=ecfg.concurrency) as pool:
        list(pool.map(one, jobs))
    if log.isatty():
        log.write("\n")
    report = summarize(rows, ecfg.repeat)
    report["wall_s"] = round(time.monotonic() - start, 2)
    report["episodes_per_min"] = round(len(jobs) / max(1e-9, report["wall_s"]) * 60, 2) if jobs else None
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot_report(report, out / "report.png")
    return report


def summarize(rows: list[dict[str, Any]], k: int) -> dict[str, Any]:
    def block(rs: list[dict[str, Any]]) -> dict[str, Any]:
        scored = [r for r in rs if not r.get("infra_error")]
        by_task: dict[str, list[bool]] = {}
        for r in scored:
            by_task.setdefault(r["task_id"], []).append(bool(r["passed"]))
        b: dict[str, Any] = {"tasks": len({r["task_id"] for r in rs}), "episodes": len(rs),
                             "infra_errors": len(rs) - len(scored)}
        if scored:
            b["pass@1"] = round(sum(sum(v) / len(v) for v in by_task.values()) / len(by_task), 4)
            b[f"pass@{k}"] = round(sum(pass_at_k(len(v), sum(v), min(k, len(v))) for v in by_task.values())
                                   / len(by_task), 4)
            for m in METRICS:
                b[m] = round(sum(r.get(m, 0) or 0 for r in scored) / len(scored), 3)
            figs = [figures(r.get("quality")) for r in scored]
            for m in QUALITY:
                vals = [f[m] for f in figs if f[m] is not None]
                b[m] = round(sum(vals) / len(vals), 3) if vals else None
        return b

    fams = sorted({r.get("family") or "" for r in rows})
    return {"overall": block(rows), "families": {f or "-": block([r for r in rows if (r.get("family") or "") == f])
                                                 for f in fams}}


def table(report: dict[str, Any], k: int) -> str:
    cols = ["tasks", "episodes", "pass@1", f"pass@{k}", "completion_tokens", "tool_calls", "tool_calls_per_turn",
            "turns", "duration_s", "infra_errors"]
    if k == 1:
        cols.remove("pass@1")
    return _markdown(report, cols) + "\n\nquality per episode (mean; '-' where not measured):\n" + _markdown(report, QUALITY)


def _markdown(report: dict[str, Any], cols: list[str] | tuple[str, ...]) -> str:
    lines = ["| family | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for name, b in [*report["families"].items(), ("all", report["overall"])]:
        lines.append(f"| {name} | " + " | ".join("-" if b.get(c) is None else str(b[c]) for c in cols) + " |")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], png: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fams = list(report["families"])
    if not fams:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    axes = axes.ravel()
    fb = report["families"]
    axes[0].bar(fams, [fb[f].get("pass@1", 0) for f in fams])
    axes[0].set_ylim(0, 1)
    axes[0].set_title("pass@1", fontsize=9)
    axes[1].bar(fams, [fb[f].get("completion_tokens", 0) for f in fams])
    axes[1].set_title("completion tokens / episode", fontsize=9)
    axes[2].bar(fams, [fb[f].get("lines_changed") or 0 for f in fams], label="lines changed")
    axes[2].plot(fams, [fb[f].get("size_ratio") or 0 for f in fams], "o", color="C3", label="size / reference")
    axes[2].set_title("diff per episode", fontsize=9)
    axes[2].legend(fontsize=6)
    bad = ("test_edit", "unneeded_files", "new_lint", "format_issues", "unsupported_claims")
    width = 0.8 / len(bad)
    for i, m in enumerate(bad):
        axes[3].bar([x + i * width for x in range(len(fams))], [fb[f].get(m) or 0 for f in fams], width, label=m)
    axes[3].set_xticks([x + 0.4 - width / 2 for x in range(len(fams))], fams)
    axes[3].set_ylim(0, max([1.0] + [fb[f].get(m) or 0 for f in fams for m in bad]) * 1.1)
    axes[3].set_title("quality problems / episode (0 is clean)", fontsize=9)
    axes[3].legend(fontsize=6)
    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
