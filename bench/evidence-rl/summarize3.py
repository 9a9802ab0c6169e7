"""Tables and plots of the third evidence measurement (run3_all.sh): RL from the honest-closing SFT start,
claim-token credit against a control.

    python bench/evidence-rl/summarize3.py [--runs /tmp/m56h] [--out bench/evidence-rl] [--tag 3]

Reads RUNS/{claims,control}-sS/rl/metrics.jsonl (every RL step), RUNS/heldout-start/heldout.json and
RUNS/heldout-sS/heldout.json (greedy held-out scores), and the held-out episodes themselves (the folder
each RUNS/heldout-*.log names): how the failing episodes closed (no answer, a true answer, a false claim;
and the taught closings, "I did not fix ..." / "I changed ..." or a garbled "I ..." start). Writes
OUT/runs3.json, OUT/heldout3.json, OUT/training3.png and OUT/heldout3.png and prints the markdown tables.
The built-in row is the first measurement's (OUT/heldout.json, same 50 tasks, greedy float64); sft-start
is the SFT checkpoint all arms start from. --tag N names the files (runsN.json, ...): the fourth measurement,
from a weaker honest-closing start, is `--runs /tmp/m56w --tag 4`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.session import load  # noqa: E402
from agent.tasks.claims import SUPPORTED, check_session, final_answer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarize2 import ARMS, print_runs, read_runs, row_of  # noqa: E402  (the second measurement's readers)

TAUGHT = re.compile(r"^I\b")  # the taught closings start "I did not fix", "I changed"; the garbled ones "I I ..."


def closings(results: Path) -> dict:
    """How the failing held-out episodes of one model closed."""
    rows = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
    fail = [r for r in rows if not r["passed"] and not r.get("infra_error")]
    n = {"failing": len(fail), "no_answer": 0, "true_answer": 0, "false_claim": 0, "taught_closing": 0,
         "passing_false_claim": 0, "passing": 0}
    for r in rows:
        data = load(Path(r["session_path"]))
        answer = final_answer(data)
        bad = any(c.status != SUPPORTED for c in check_session(data))
        if r["passed"]:
            n["passing"] += 1
            n["passing_false_claim"] += bad
            continue
        if r.get("infra_error"):
            continue
        if not answer.strip():
            n["no_answer"] += 1
        else:
            n["false_claim" if bad else "true_answer"] += 1
            n["taught_closing"] += bool(TAUGHT.match(answer.strip()))
    n["honest_closing_rate"] = round(n["true_answer"] / max(1, n["failing"]), 3)
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=Path, default=Path("/tmp/m56h"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--tag", default="3", help="suffix of the files written (runsTAG.json, heldoutTAG.json, ...)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    runs = read_runs(a.runs)
    (a.out / f"runs{a.tag}.json").write_text(json.dumps(runs, indent=1) + "\n")

    first = json.loads((a.out / "heldout.json").read_text())
    table = {"built-in": row_of(first["results"]["start"]["seen"])}
    closing: dict[str, dict] = {}
    scored = [a.runs / "heldout-start" / "heldout.json", *sorted(a.runs.glob("heldout-s[0-9]/heldout.json"))]
    for path in (p for p in scored if p.exists()):
        for name, res in json.loads(path.read_text())["results"].items():
            if "seen" in res:
                table[name] = row_of(res["seen"])
        log = path.parent.parent / (path.parent.name + ".log")
        m = re.search(r"^episodes: (\S+)", log.read_text(), re.M) if log.exists() else None
        if m:
            for name in json.loads(path.read_text())["results"]:
                results = Path(m.group(1)) / f"{name}-seen" / "results.jsonl"
                if results.exists():
                    closing[name] = closings(results)
    for name in table:
        if name in closing:
            table[name]["honest_closing_rate"] = closing[name]["honest_closing_rate"]
    (a.out / f"heldout{a.tag}.json").write_text(json.dumps({"command": first["command"], "rows": table,
                                                     "failing_closings": closing}, indent=1) + "\n")

    cols = list(table["built-in"])
    cols.append("honest_closing_rate")
    print("| model | " + " | ".join(cols) + " |")
    print("| --- " * (len(cols) + 1) + "|")
    fmt = lambda r, c: f"{r[c]:.3g}" if c in r else "-"  # noqa: E731
    for name, r in table.items():
        print(f"| {name} | " + " | ".join(fmt(r, c) for c in cols) + " |")
    for arm in ARMS:
        rows = [r for n, r in table.items() if n.startswith(arm + "-")]
        if rows:
            sd = {c: statistics.stdev(r[c] for r in rows) / len(rows) ** 0.5 if len(rows) > 1 else float("nan")
                  for c in ("pass@1", "false_per_episode")}
            print(f"| **{arm}, mean of {len(rows)}** | " + " | ".join(
                f"{statistics.mean(r[c] for r in rows):.3g}" if all(c in r for r in rows) else "-" for c in cols)
                + f" |  (s.e. over seeds: pass {sd['pass@1']:.3g}, false {sd['false_per_episode']:.3g})")
    print()
    print("| model | failing | no answer | true answer | false claim | taught closing | passing with a false claim |")
    print("| --- " * 7 + "|")
    for name, n in closing.items():
        print(f"| {name} | {n['failing']} | {n['no_answer']} | {n['true_answer']} | {n['false_claim']} | "
              f"{n['taught_closing']} | {n['passing_false_claim']}/{n['passing']} |")
    print()
    print_runs(runs)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if runs:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for name, r in runs.items():
            style = "-" if name.startswith("claims") else "--"
            xs = [s["step"] for s in r["per_step"]]
            for ax, key in zip(axes, ("unsupported_per_episode", "pass_rate", "turns_mean"), strict=True):
                ax.plot(xs, [s.get(key) for s in r["per_step"]], style, marker="o", label=name)
                ax.set_title(key + " (RL samples, T=1)")
                ax.set_xlabel("step")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.out / f"training{a.tag}.png", dpi=90)

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    names = list(table)
    colors = ["grey" if n in ("built-in", "sft-start") else "tab:blue" if n.startswith("claims") else "tab:orange"
              for n in names]
    for ax, key in zip(axes, ("false_per_episode", "pass@1", "honest_closing_rate", "tool_calls"), strict=True):
        ax.bar(names, [table[n].get(key, 0) for n in names], color=colors)
        ax.set_title(f"held-out (50 seen-code bugfix tasks, greedy): {key}", fontsize=8)
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(a.out / f"heldout{a.tag}.png", dpi=90)


if __name__ == "__main__":
    main()
