"""The learning signal of `composer-train recipe tiny`: held-out pass@1 after SFT and after RL per seed,
the control run (every advantage zeroed), malformed tool calls per episode, completion tokens per solved
task of the easy family and tool calls per turn; a table on stdout, the JSON and the curves (PNG).

    python bench/tiny_recipe.py RUN_DIR... [--control RUN_DIR] [--out bench/tiny]

Each RUN_DIR is a recipe output folder (summary.json, eval-sft/, eval-rl/, rl/metrics.jsonl, sft_metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_run(d: Path) -> dict:
    s = json.loads((d / "summary.json").read_text())
    rl = d / "rl" / "metrics.jsonl"
    s["rl_curve"] = [json.loads(x) for x in rl.read_text().splitlines() if x.strip()] if rl.exists() else []
    sft = d / "sft_metrics.jsonl"
    s["sft_curve"] = (
        [json.loads(x) for x in sft.read_text().splitlines() if x.strip()] if sft.exists() else []
    )
    s["dir"] = str(d)
    return s


def row(name: str, seed, stage: str, h: dict, easy: str, t1: dict | None = None) -> str:
    tok = (h.get("tokens_per_solved") or {}).get(easy, "-")
    return (
        f"| {name} | {seed} | {stage} | **{h['pass@1']}** | {t1['pass@1'] if t1 else '-'} | "
        f"{h['malformed_per_episode']} | {tok} | {h['tool_calls_per_turn']} | {h['completion_tokens']} |"
    )


def table(runs: list[dict], control: dict | None, easy: str) -> str:
    lines = [
        "| run | seed | after | held-out pass@1 (greedy) | held-out pass@1 (T=1) | malformed calls / episode "
        f"| completion tokens / solved {easy} | tool calls / turn | completion tokens / episode |",
        "|" + " --- |" * 9,
    ]
    for name, runs_ in (("RL", runs), ("control (advantages 0)", [control] if control else [])):
        for s in runs_:
            seed = s["recipe"]["seed"]
            lines.append(row(name, seed, "SFT", s["sft"], easy, s.get("sft_t1")))
            if "rl" in s:
                lines.append(row(name, seed, "RL", s["rl"], easy, s.get("rl_t1")))
    rl = [s for s in runs if "rl" in s]
    if rl:
        mean = lambda xs: round(sum(xs) / len(xs), 3)  # noqa: E731
        t1 = [s for s in rl if s.get("sft_t1") and s.get("rl_t1")]
        t1_cell = (
            f"{mean([s['sft_t1']['pass@1'] for s in t1])} → {mean([s['rl_t1']['pass@1'] for s in t1])}"
            if t1
            else ""
        )
        lines.append(
            f"| RL, mean of {len(rl)} | | SFT → RL | **{mean([s['sft']['pass@1'] for s in rl])} → "
            f"{mean([s['rl']['pass@1'] for s in rl])}** | {t1_cell} | | | | |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], control: dict | None, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(14, 3))
    for s in runs:
        c = s["sft_curve"]
        axes[0].plot([r["step"] for r in c], [r["loss"] for r in c], label=f"seed {s['recipe']['seed']}")
    axes[0].set_title("SFT loss (NLL / trained token)", fontsize=9)
    for s, style in [(s, "-") for s in runs] + ([(control, "--")] if control else []):
        c = s["rl_curve"]
        label = f"seed {s['recipe']['seed']}" + (" control" if s is control else "")
        axes[1].plot(
            [r["step"] for r in c], [r["pass_rate"] for r in c], style, marker="o", markersize=3, label=label
        )
        axes[2].plot(
            [r["step"] for r in c],
            [r["reward_mean"] for r in c],
            style,
            marker="o",
            markersize=3,
            label=label,
        )
        axes[3].plot(
            [r["step"] for r in c],
            [r["completion_tokens"] / max(1, r["episodes"]) for r in c],
            style,
            marker="o",
            markersize=3,
            label=label,
        )
    axes[1].set_title("RL: training pass rate per step (T=1)", fontsize=9)
    axes[2].set_title("RL: mean reward per step", fontsize=9)
    axes[3].set_title("RL: completion tokens / episode", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--control", type=Path)
    p.add_argument("--easy", default="find-def", help="the family whose tokens per solved task are reported")
    p.add_argument("--out", type=Path, default=Path("bench/tiny"))
    args = p.parse_args(argv)
    runs = [load_run(d) for d in args.runs]
    control = load_run(args.control) if args.control else None
    args.out.mkdir(parents=True, exist_ok=True)
    keep = (
        "recipe",
        "params",
        "sft",
        "rl",
        "sft_t1",
        "rl_t1",
        "timings_s",
        "rl_curve",
        "expert_conversation_tokens_mean",
    )
    (args.out / "tiny_recipe.json").write_text(
        json.dumps(
            {
                "runs": [{k: s.get(k) for k in keep} for s in runs],
                "control": {k: control.get(k) for k in keep} if control else None,
            },
            indent=1,
        )
    )
    print(table(runs, control, args.easy))
    plot(runs, control, args.out / "tiny_recipe.png")
    print(f"\nwrote {args.out / 'tiny_recipe.json'} and {args.out / 'tiny_recipe.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
