"""`composer-agent eval compare RUN_A RUN_B`: two eval runs over the same tasks, paired task by task.

    composer-agent eval compare runs/a runs/b [--out DIR] [--resamples 10000] [--seed 0]

Two runs are only comparable over the same tasks: runs whose task ids differ are refused (exit 2)
rather than compared on their overlap, since a pass rate over other tasks is another quantity.
Episodes lost to infrastructure errors are left out of both sides of their pair.

- Pass rate: the difference B - A of the mean per-task pass rate (the mean over a task's repeats), with
  a percentile bootstrap 95% interval that resamples tasks (so repeats of one task move together), and
  McNemar's exact test on the episodes paired by (task, repeat): only pairs where one run passed and the
  other did not carry information, and under "no difference" each way is equally likely.
- Deltas, B - A, of the per-task means of tokens, time, tool calls, turns and the quality metrics
  (agent/tasks/quality.py), each with its bootstrap interval, over the tasks both runs measured.
A difference is called significant when McNemar's p < 0.05 and the interval excludes 0.
Writes compare.json and compare.png to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from math import comb
from pathlib import Path
from typing import Any

from agent.tasks.quality import METRICS as QUALITY
from agent.tasks.quality import figures

COST = ("prompt_tokens", "completion_tokens", "tool_calls", "turns", "duration_s")
ALPHA = 0.05


class CompareError(ValueError):
    """Runs that cannot be compared (the message says why)."""


def load_run(path: str | Path) -> list[dict[str, Any]]:
    """The episodes of a run: its folder's results.jsonl (or that file)."""
    p = Path(path)
    p = p / "results.jsonl" if p.is_dir() else p
    if not p.is_file():
        raise CompareError(f"{path}: no results.jsonl (is it an eval --out folder?)")
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by a kill: what came before is whole
    if not rows:
        raise CompareError(f"{p}: no episodes")
    return rows


def mcnemar(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for b pairs (A passed, B failed) and c pairs (A failed, B passed)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def bootstrap(values: list[float], resamples: int, rng: random.Random) -> tuple[float, float]:
    """Percentile 95% interval of the mean of `values` (resampled with replacement)."""
    if not values:
        return (0.0, 0.0)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * (resamples - 1))], means[int(0.975 * (resamples - 1))]


def _per_task(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """task id -> {"family", "episodes": {repeat: row}} over episodes without infrastructure errors."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        t = out.setdefault(r["task_id"], {"family": r.get("family") or "-", "episodes": {}})
        if not r.get("infra_error"):
            t["episodes"][r.get("repeat", 0)] = r
    return out


def _value(row: dict[str, Any], metric: str) -> float | None:
    if metric == "passed":
        return float(bool(row["passed"]))
    if metric in QUALITY:
        return figures(row.get("quality"))[metric]
    v = row.get(metric)
    return None if v is None else float(v)


def _task_mean(episodes: dict[int, dict[str, Any]], metric: str) -> float | None:
    vals = [v for v in (_value(r, metric) for r in episodes.values()) if v is not None]
    return sum(vals) / len(vals) if vals else None


def _pairs(ta: dict, tb: dict, ids: list[str], metric: str) -> list[tuple[float, float]]:
    out = []
    for t in ids:
        a, b = _task_mean(ta[t]["episodes"], metric), _task_mean(tb[t]["episodes"], metric)
        if a is not None and b is not None:
            out.append((a, b))
    return out


def _delta(pairs: list[tuple[float, float]], resamples: int, rng: random.Random) -> dict[str, Any]:
    if not pairs:
        return {"tasks": 0, "a": None, "b": None, "delta": None, "ci": None}
    n = len(pairs)
    lo, hi = bootstrap([b - a for a, b in pairs], resamples, rng)
    return {"tasks": n, "a": round(sum(a for a, _ in pairs) / n, 4), "b": round(sum(b for _, b in pairs) / n, 4),
            "delta": round(sum(b - a for a, b in pairs) / n, 4), "ci": [round(lo, 4), round(hi, 4)]}


def _pass_block(ta: dict, tb: dict, ids: list[str], resamples: int, rng: random.Random) -> dict[str, Any]:
    d = _delta(_pairs(ta, tb, ids, "passed"), resamples, rng)
    b = c = 0
    for t in ids:
        for rep, ra in ta[t]["episodes"].items():
            rb = tb[t]["episodes"].get(rep)
            if rb is not None and bool(ra["passed"]) != bool(rb["passed"]):
                b += bool(ra["passed"])
                c += bool(rb["passed"])
    d.update(a_only=b, b_only=c, mcnemar_p=float(f"{mcnemar(b, c):.4g}"))
    d["significant"] = bool(d["ci"] and d["mcnemar_p"] < ALPHA and not d["ci"][0] <= 0 <= d["ci"][1])
    return d


def compare(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], resamples: int = 10_000,
            seed: int = 0) -> dict[str, Any]:
    ta, tb = _per_task(rows_a), _per_task(rows_b)
    if set(ta) != set(tb):
        only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
        raise CompareError(f"the runs are over different tasks: {len(only_a)} only in A (e.g. {only_a[:3]}), "
                           f"{len(only_b)} only in B (e.g. {only_b[:3]}); compare runs of the same suite")
    rng = random.Random(seed)
    ids = sorted(ta)
    result: dict[str, Any] = {"tasks": len(ids), "episodes": [len(rows_a), len(rows_b)],
                              "pass": _pass_block(ta, tb, ids, resamples, rng), "families": {}, "deltas": {}}
    for fam in sorted({ta[t]["family"] for t in ids}):
        fids = [t for t in ids if ta[t]["family"] == fam]
        result["families"][fam] = _pass_block(ta, tb, fids, resamples, rng)
    for m in (*COST, *QUALITY):
        result["deltas"][m] = _delta(_pairs(ta, tb, ids, m), max(1000, resamples // 5), rng)
    result["changed_tasks"] = {t: [_task_mean(ta[t]["episodes"], "passed"), _task_mean(tb[t]["episodes"], "passed")]
                               for t in ids if _task_mean(ta[t]["episodes"], "passed")
                               != _task_mean(tb[t]["episodes"], "passed")}
    return result


def table(result: dict[str, Any]) -> str:
    def ci(d: dict[str, Any]) -> str:
        return "-" if not d["ci"] else f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"

    lines = ["| family | tasks | pass A | pass B | B - A | 95% CI | A only | B only | McNemar p | significant |",
             "|" + " --- |" * 10]
    for name, d in [*result["families"].items(), ("all", result["pass"])]:
        lines.append(f"| {name} | {d['tasks']} | {d['a']} | {d['b']} | {d['delta']:+.3f} | {ci(d)} | {d['a_only']} | "
                     f"{d['b_only']} | {d['mcnemar_p']:.3g} | {'yes' if d['significant'] else 'no'} |")
    lines += ["", "| per episode (task means) | tasks | A | B | B - A | 95% CI |", "|" + " --- |" * 6]
    for m, d in result["deltas"].items():
        if d["tasks"]:
            lines.append(f"| {m} | {d['tasks']} | {d['a']} | {d['b']} | {d['delta']:+} | {ci(d)} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], png: Path, labels: tuple[str, str] = ("A", "B")) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [*result["families"], "all"]
    blocks = [*result["families"].values(), result["pass"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    x = range(len(names))
    axes[0].bar([i - 0.2 for i in x], [d["a"] or 0 for d in blocks], 0.4, label=labels[0])
    axes[0].bar([i + 0.2 for i in x], [d["b"] or 0 for d in blocks], 0.4, label=labels[1])
    axes[0].set_xticks(list(x), names)
    axes[0].set_ylim(0, 1)
    axes[0].set_title("pass rate", fontsize=9)
    axes[0].legend(fontsize=7)
    deltas = [d["delta"] or 0 for d in blocks]
    err = [[dl - (d["ci"] or [0, 0])[0] for dl, d in zip(deltas, blocks, strict=True)],
           [(d["ci"] or [0, 0])[1] - dl for dl, d in zip(deltas, blocks, strict=True)]]
    axes[1].errorbar(list(x), deltas, yerr=err, fmt="o", capsize=4)
    axes[1].axhline(0, color="grey", lw=0.8)
    axes[1].set_xticks(list(x), names)
    axes[1].set_title(f"pass rate {labels[1]} - {labels[0]}, 95% bootstrap CI", fontsize=9)
    ms = [m for m, d in result["deltas"].items() if d["tasks"] and d["a"]]
    rel = [100 * result["deltas"][m]["delta"] / abs(result["deltas"][m]["a"]) for m in ms]
    axes[2].barh(ms, rel, color=["C3" if r > 0 else "C2" for r in rel])
    axes[2].axvline(0, color="grey", lw=0.8)
    axes[2].set_title(f"{labels[1]} vs {labels[0]}, % of {labels[0]}'s mean (where not 0)", fontsize=9)
    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="composer-agent eval compare",
                                description="Compare two eval runs of the same tasks, paired per task.")
    p.add_argument("run_a", help="an eval --out folder (or its results.jsonl)")
    p.add_argument("run_b")
    p.add_argument("--out", help="where compare.json and compare.png go (default: RUN_B's folder)")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    args = p.parse_args(argv)
    try:
        result = compare(load_run(args.run_a), load_run(args.run_b), args.resamples, args.seed)
    except CompareError as e:
        print(f"composer-agent eval compare: error: {e}", file=sys.stderr)
        return 2
    result["runs"] = [str(args.run_a), str(args.run_b)]
    out = Path(args.out or (args.run_b if Path(args.run_b).is_dir() else Path(args.run_b).parent))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "compare.png", (Path(args.run_a).name or "A", Path(args.run_b).name or "B"))
    print(f"A = {args.run_a}, B = {args.run_b}\n")
    print(table(result))
    d = result["pass"]
    verdict = "a significant difference" if d["significant"] else "no significant difference"
    print(f"\npass rate {d['a']} -> {d['b']} ({d['delta']:+.3f}, 95% CI {d['ci']}), McNemar p = {d['mcnemar_p']:.3g} "
          f"({d['a_only']} pairs passed only in A, {d['b_only']} only in B): {verdict}; {out / 'compare.json'}")
    return 0
