"""Training curves as a PNG next to the metrics JSONL (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (("reward_mean", "reward"), ("pass_rate", "pass rate"), ("completion_tokens", "completion tokens"),
          ("logprob_gap_max", "trainer/sampler log-prob gap (max)"), ("staleness_mean", "staleness (versions)"),
          ("loss", "loss"))


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
    panels = [(k, t) for k, t in PANELS if any(r.get(k) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
