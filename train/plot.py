"""Training curves as a PNG next to the metrics JSONL (matplotlib, headless).

A panel is a title and the metrics drawn in it; a key ending in "*" is every metric with that prefix
(pass@1, pass@2, ... or reward_pass, reward_evidence, ...), so what a run logs decides the lines."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (("reward", ["reward_mean", "best_of_k_reward"]), ("pass rate and pass@k", ["pass_rate", "pass@*", "best_of_k_pass"]),
          ("reward terms (mean)", ["reward_*"]), ("claims per episode", ["claims_per_episode", "unsupported_per_episode"]),
          ("turns, tool calls per episode", ["turns_mean", "tool_calls_mean"]),
          ("completion tokens", ["completion_tokens"]), ("trainer/sampler log-prob gap (max)", ["logprob_gap_max"]),
          ("staleness (versions)", ["staleness_mean"]), ("loss", ["loss"]))


def _keys(rows: list[dict], wanted: list[str]) -> list[str]:
    present = list(dict.fromkeys(k for r in rows for k, v in r.items() if isinstance(v, int | float)))
    out: list[str] = []
    for w in wanted:
        if w.endswith("*"):
            out += [k for k in present if k.startswith(w[:-1]) and k not in out and k != "reward_mean"]
        elif w in present and w not in out:
            out.append(w)
    return out


def plot_metrics(jsonl: str | Path, png: str | Path) -> Path | None:
    """Plot the panels present in `jsonl`; returns the PNG path, or None without data or matplotlib."""
    rows = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()] \
        if Path(jsonl).exists() else []
    if not rows:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [(t, ks) for t, wanted in PANELS if (ks := _keys(rows, wanted))]
    cols = min(5, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=key)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        if len(keys) > 1:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
