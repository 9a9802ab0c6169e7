"""Tables and plots of the second evidence measurement (run2_all.sh): claim-token credit against a control.

    python bench/evidence-rl/summarize2.py [--runs /tmp/m56] [--out bench/evidence-rl]

Reads RUNS/{claims,control}-sS/rl/metrics.jsonl (every RL step) and RUNS/heldout-sS/heldout.json (greedy
held-out scores); writes OUT/runs2.json, OUT/heldout2.json, OUT/training2.png and OUT/heldout2.png, and
prints the markdown tables. The start row is the built-in model's score on the same 50 tasks from the
first measurement (OUT/heldout.json: greedy in float64, so the same run gives the same figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ARMS = ("claims", "control")
STEP_KEYS = ("pass_rate", "unsupported_per_episode", "claims_per_episode", "turns_mean", "tool_calls_mean",
             "reward_evidence", "claim_credit_episodes", "claim_credit_tokens", "claim_credit_unlocated",
             "pass@8", "best_of_k_reward", "rollout_s", "train_s")


def row_of(seen: dict) -> dict:
    c = seen["claims"]
    return {"pass@1": seen["pass@1"], "false_per_episode": c["unsupported_per_episode"],
            "contradicted_per_episode": c["contradicted_per_episode"],
            "episodes_with_false": c["episodes_with_unsupported"], "claims_per_episode": c["per_episode"],
            "turns": seen["turns"], "tool_calls": seen["tool_calls"], "tool_calls_per_turn": seen["tool_calls_per_turn"]}


def read_runs(root: Path) -> dict[str, dict]:
    """Every arm's RL steps under root ({claims,control}-sS/rl/metrics.jsonl): per step and their means."""
    runs: dict[str, dict] = {}
    for path in sorted(root.glob("*-s[0-9]/rl/metrics.jsonl")):
        name = path.parents[1].name
        if name.split("-")[0] not in ARMS:
            continue
        steps = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        per = [{k: s.get(k) for k in ("step", *STEP_KEYS) if k in s} for s in steps]
        mean = {k: round(statistics.mean(s[k] for s in per if s.get(k) is not None), 4)
                for k in STEP_KEYS if any(s.get(k) is not None for s in per)}
        runs[name] = {"steps": len(per), "train_mean_all_steps": mean, "per_step": per}
    return runs


def print_runs(runs: dict[str, dict]) -> None:
    """The training runs' table: each run's means over its steps (markdown, to stdout)."""
    print("| run | steps | " + " | ".join(STEP_KEYS[:5]) + " | claim tokens / step |")
    print("| --- " * 8 + "|")
    for name, r in runs.items():
        m = r["train_mean_all_steps"]
        print(f"| {name} | {r['steps']} | " + " | ".join(f"{m.get(k, 0):.3g}" for k in STEP_KEYS[:5])
              + f" | {m.get('claim_credit_tokens', 0):.3g} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=Path, default=Path("/tmp/m56"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    runs = read_runs(a.runs)
    (a.out / "runs2.json").write_text(json.dumps(runs, indent=1) + "\n")

    first = json.loads((a.out / "heldout.json").read_text())
    table = {"start": row_of(first["results"]["start"]["seen"])}
    for path in sorted(a.runs.glob("heldout-s*/heldout.json")):
        for name, res in json.loads(path.read_text())["results"].items():
            if "seen" in res:
                table[name] = row_of(res["seen"])
    (a.out / "heldout2.json").write_text(json.dumps({"command": first["command"], "rows": table}, indent=1) + "\n")

    cols = list(table["start"])
    print("| model | " + " | ".join(cols) + " |")
    print("| --- " * (len(cols) + 1) + "|")
    for name, r in table.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.3g}" for c in cols) + " |")
    for arm in ARMS:
        rows = [r for n, r in table.items() if n.startswith(arm + "-")]
        if rows:
            print(f"| {arm}, mean of {len(rows)} | " + " | ".join(f"{statistics.mean(r[c] for r in rows):.3g}"
                                                                 for c in cols) + " |")
    print()
    print_runs(runs)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(a.out / "training2.png", dpi=90)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(table)
    for ax, key in zip(axes, ("false_per_episode", "pass@1", "tool_calls"), strict=True):
        ax.bar(names, [table[n][key] for n in names],
               color=["grey" if n == "start" else "tab:blue" if n.startswith("claims") else "tab:orange" for n in names])
        ax.set_title(f"held-out (50 seen-code bugfix tasks, greedy): {key}", fontsize=9)
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(a.out / "heldout2.png", dpi=90)


if __name__ == "__main__":
    main()
