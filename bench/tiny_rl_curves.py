"""RL runs side by side, step by step: training pass rate, malformed calls per episode and the mean
negative log-prob of the sampled tokens (an entropy proxy: it rises as the policy spreads its mass).

    python bench/tiny_rl_curves.py NAME=RL_RUN_DIR... [--out bench/tiny/rl-noise]

RL_RUN_DIR is a `composer-train rl` folder (the recipe's OUT/rl): its metrics.jsonl, and the sampler's
log-probs from trajectories/batch-K. Runs with the same seed and tasks draw the same tasks at each step,
so their rows compare step by step. Writes curves.json and curves.png, and prints means over windows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WINDOWS = ((0, 4), (4, 20), (20, 40))


def sampled_nll(run: Path, steps: int) -> list[float | None]:
    out: list[float | None] = []
    for k in range(steps):
        lps: list[float] = []
        for f in sorted((run / "trajectories" / f"batch-{k}").glob("*.jsonl")):
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("type") == "request" and rec.get("completion_logprobs"):
                    lps += rec["completion_logprobs"]
        out.append(-sum(lps) / len(lps) if lps else None)
    return out


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 3) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME=RL_RUN_DIR")
    ap.add_argument("--out", default="bench/tiny/rl-noise")
    args = ap.parse_args()
    curves = {}
    for spec in args.runs:
        name, _, path = spec.partition("=")
        run = Path(path)
        ms = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        curves[name] = {"pass_rate": [m["pass_rate"] for m in ms],
                        "malformed_per_episode": [m["malformed_per_episode"] for m in ms],
                        "sampled_nll": sampled_nll(run, len(ms))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "curves.json").write_text(json.dumps(curves, indent=1))
    print("| run | steps | " + " | ".join(f"{k} steps {a}-{b - 1}" for k in ("pass", "malformed", "NLL")
                                           for a, b in WINDOWS) + " |")
    print("| --- " * (2 + 3 * len(WINDOWS)) + "|")
    for name, c in curves.items():
        cells = [mean(c[k][a:b]) for k in ("pass_rate", "malformed_per_episode", "sampled_nll") for a, b in WINDOWS]
        print(f"| {name} | {len(c['pass_rate'])} | " + " | ".join("" if v is None else f"{v}" for v in cells) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ("pass_rate", "malformed_per_episode", "sampled_nll"),
                              ("training pass rate (T=1)", "malformed calls / episode", "sampled-token NLL"),
                              strict=True):
        for name, c in curves.items():
            ys = c[key]
            smooth = [mean(ys[max(0, i - 3):i + 1]) for i in range(len(ys))]  # trailing mean of 4 steps
            ax.plot(range(len(ys)), smooth, label=name)
        ax.set_title(title + " (mean of the last 4 steps)")
        ax.set_xlabel("RL step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    print(f"wrote {out / 'curves.json'} and {out / 'curves.png'}")


if __name__ == "__main__":
    main()
