"""What semantic search adds to the agent (issue 55, Must 4): the find-def family of `composer-agent eval`
played by scripted experts, through the real loop, tools and index (agent/tasks/expert_find.py).

    OMP_NUM_THREADS=1 python bench/search_agent.py [--seeds 10] [--arms expert,expert-grep,code-minilm,minilm]

Arms: `expert` (the recorded expert: its plan greps `def NAME(` and knows the answer), `expert-grep`
(the same grep, answer read from its output), `code-minilm` and `minilm` (`expert-search`:
semantic_search for the name first, k=3, answer from a hit whose snippet shows the definition, grep
when none does; the index is built in each fresh workspace by the tool itself, with that embedder).
Tasks: find-def at every size, seeds 0..N-1 (train split) and 1,000,000.. (held-out split, other
modules and names). The arms alternate in chunks of tasks (each arm's eval resumed with the next chunk),
so the shared machine's load falls on all of them alike; one episode at a time, torch on one thread.
Tokens are what the eval counts (the scripted server's estimate, 4 characters a token, summed over the
episode's requests). Index build seconds come from the tool's own note ("built the index ... in X s").
Writes OUT/<arm>/ (emptied first: a run never reuses an earlier run's episodes, which may come from
other weights; eval folders: results.jsonl, report.json, report.png, sessions) and
bench/embedder-results/agent-find-def.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "embedder-results"
ARMS = {"expert": ("expert", None), "expert-grep": ("expert-grep", None),
        "code-minilm": ("expert-search", "code-minilm"), "minilm": ("expert-search", "minilm")}
_BUILT = re.compile(r"built the index \([^)]*\): (\d+) files, (\d+) chunks in ([\d.]+)s")


def tasks_for(seeds: int):
    from agent.tasks.families import HELDOUT_BASE, generate

    return {split: [generate("find-def", base + s, size, split) for s in range(seeds)
                    for size in ("small", "medium", "large")]
            for split, base in (("train", 0), ("heldout", HELDOUT_BASE))}


def episode_facts(row: dict) -> dict:
    """Which tools the episode called and what the index build reported, from its session file."""
    from agent.session import load
    from agent.tasks.expert_find import asked_name

    data = load(row["session_path"])
    calls = [c for r in data.records if r["type"] == "tools" for c in r["calls"]]
    outputs = [m.get("content") or "" for seg in data.segments for m in seg if m.get("role") == "tool"]
    built = next((_BUILT.search(o) for o in outputs if _BUILT.search(o)), None)
    asked = next((asked_name(m["content"]) for seg in data.segments for m in seg if m.get("role") == "user"), "")
    return {"tools": [c["name"] for c in calls], "rank": _definition_rank(outputs[0], asked) if built else None,
            "search_s": sum(c.get("duration_s") or 0 for c in calls if c["name"] == "semantic_search"),
            "build": None if built is None else {"files": int(built[1]), "chunks": int(built[2]),
                                                 "seconds": float(built[3])}}


def _definition_rank(output: str, name: str) -> int | None:
    """Where the first hit whose snippet shows `def NAME(` stands in a semantic_search answer (1 = first;
    None: not among the hits)."""
    rank = None
    for line in output.splitlines():
        m = re.match(r"^(\d+)\. \S+:\d+-\d+\s", line)
        if m:
            rank = int(m.group(1))
        elif rank and re.match(rf"\s*\d+\t\s*(?:async\s+)?def {re.escape(name)}\(", line):
            return rank
    return None


def summarize(rows: list[dict]) -> dict:
    from agent.tasks.quality import figures

    def mean(xs):
        return round(statistics.fmean(xs), 3) if xs else None

    facts = [episode_facts(r) for r in rows]
    builds = [f["build"] for f in facts if f["build"]]
    out = {"episodes": len(rows), "pass@1": mean([float(r["passed"]) for r in rows]),
           "tool_calls": mean([r["tool_calls"] for r in rows]),
           "prompt_tokens": mean([r["prompt_tokens"] for r in rows]),
           "completion_tokens": mean([r["completion_tokens"] for r in rows]),
           "tokens": mean([r["prompt_tokens"] + r["completion_tokens"] for r in rows]),
           "wall_s_mean": mean([r["duration_s"] for r in rows]),
           "wall_s_median": round(statistics.median(r["duration_s"] for r in rows), 3) if rows else None,
           "grep_calls": sum(f["tools"].count("grep") for f in facts),
           "search_calls": sum(f["tools"].count("semantic_search") for f in facts),
           "answered_by_search": sum(1 for f in facts if f["tools"] == ["semantic_search"]),
           "definition_rank": {str(k): sum(1 for f in facts if f["rank"] == k)
                               for k in sorted({f["rank"] for f in facts if f["build"]}, key=str)},
           "unsupported_claims": mean([figures(r.get("quality"))["unsupported_claims"] or 0 for r in rows])}
    if builds:
        out["index_build"] = {"seconds_mean": mean([b["seconds"] for b in builds]),
                              "seconds_median": round(statistics.median(b["seconds"] for b in builds), 3),
                              "chunks_mean": mean([b["chunks"] for b in builds]),
                              "chunks_per_s": round(sum(b["chunks"] for b in builds)
                                                    / max(1e-9, sum(b["seconds"] for b in builds)), 1)}
        out["search_call_s_mean"] = mean([f["search_s"] for f in facts if f["search_s"]])
    return out


def warm(models: list[str]) -> dict[str, float]:
    """Load each embedder and run one batch through its torch model (what an index build uses), so no
    arm's first episode pays the load; returns the seconds each took."""
    from index.embed import SINGLE_THREAD_TEXTS, load_embedder

    took = {}
    for m in models:
        t = time.monotonic()
        load_embedder(m).encode([f"def f{i}(x): return x" for i in range(SINGLE_THREAD_TEXTS + 1)])
        took[m] = round(time.monotonic() - t, 2)
    return took


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["arms"])
    splits = list(result["arms"][arms[0]]["by_split"])
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.2))
    for ax, key, title in zip(axes, ("pass@1", "tool_calls", "tokens", "wall_s_median"),
                              ("pass@1", "tool calls / episode", "tokens / episode (prompt+completion)",
                               "wall s / episode (median)"), strict=True):
        width = 0.8 / len(splits)
        for i, s in enumerate(splits):
            ax.bar([x + i * width for x in range(len(arms))],
                   [result["arms"][a]["by_split"][s][key] or 0 for a in arms], width, label=s)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(arms))], arms, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle("find-def family: grep alone vs semantic_search first (scripted experts)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def run(a, arms: list[str], by_split: dict) -> dict:
    """Every arm over the same tasks, alternating in chunks; returns the run's own figures."""
    import torch

    torch.set_num_threads(1)
    from agent.config import Config
    from agent.tasks.eval import EvalConfig, run_eval
    from agent.tasks.expert_find import expert_server

    tasks = [t for ts in by_split.values() for t in ts]
    for x in arms:  # the chunks below resume this run's episodes only, never an earlier run's (other weights)
        if (a.out / x).exists():
            shutil.rmtree(a.out / x)
            print(f"cleared {a.out / x}: an earlier run's episodes", flush=True)
    order = [t for pair in zip(by_split["train"], by_split["heldout"], strict=True) for t in pair]
    load_s = warm([ARMS[x][1] for x in arms if ARMS[x][1]])
    servers = {x: expert_server(tasks, ARMS[x][0]).__enter__() for x in arms}
    ecfg = EvalConfig(concurrency=1, repeat=1)
    quiet = open(os.devnull, "w")
    start = time.monotonic()
    try:
        for end in range(a.chunk, len(order) + a.chunk, a.chunk):
            for x in arms:
                model, embedder = ARMS[x]
                if embedder:
                    os.environ["COMPOSER_EMBED_MODEL"] = embedder
                cfg = Config(base_url=servers[x].base_url, model=model)
                run_eval(order[:end], cfg, ecfg, a.out / x, resume=True, log=quiet)
                os.environ.pop("COMPOSER_EMBED_MODEL", None)
            print(f"{min(end, len(order))}/{len(order)} tasks per arm, {time.monotonic() - start:.0f}s, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for s in servers.values():
            s.__exit__(None, None, None)
    return {"command": "OMP_NUM_THREADS=1 python bench/search_agent.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seeds_per_split": a.seeds,
            "tasks_per_arm": len(tasks), "embedder_load_s": load_s, "wall_s": round(time.monotonic() - start, 1),
            "load_average_end": [round(x, 2) for x in os.getloadavg()], "arms": {}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10, help="seeds per split (x3 sizes x2 splits tasks per arm)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--chunk", type=int, default=6, help="tasks per arm before the next arm runs")
    p.add_argument("--out", type=Path, default=Path("/tmp/composer-search-agent"))
    p.add_argument("--json", type=Path, default=RESULTS / "agent-find-def.json")
    p.add_argument("--report-only", action="store_true",
                   help="summarise the eval folders under OUT again (their sessions) without running")
    a = p.parse_args()
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown} (known: {', '.join(ARMS)})")

    by_split = tasks_for(a.seeds)
    if a.report_only:  # the run's own figures (time, load) as the last full run recorded them
        prev = json.loads(a.json.read_text()) if a.json.is_file() else {}
        result = {k: v for k, v in prev.items() if k != "arms"} | {"arms": {}}
    else:
        result = run(a, arms, by_split)
    split_of = {t.id: s for s, ts in by_split.items() for t in ts}
    for x in arms:
        rows = [json.loads(line) for line in (a.out / x / "results.jsonl").read_text().splitlines()]
        result["arms"][x] = {**summarize(rows), "by_split": {s: summarize([r for r in rows if split_of[r["task_id"]] == s])
                                                               for s in by_split},
                             "by_size": {z: summarize([r for r in rows if f"-{z}-" in r["task_id"]])
                                         for z in ("small", "medium", "large")}}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1))
    plot(result, a.json.with_suffix(".png"))
    cols = ("episodes", "pass@1", "tool_calls", "tokens", "prompt_tokens", "wall_s_median", "grep_calls",
            "answered_by_search", "definition_rank")
    print("| arm | " + " | ".join(cols) + " | index build s (median) |")
    for x, r in result["arms"].items():
        print(f"| {x} | " + " | ".join(str(r[c]) for c in cols)
              + f" | {(r.get('index_build') or {}).get('seconds_median', '-')} |")
    print(f"wrote {a.json} and {a.json.with_suffix('.png')}")


if __name__ == "__main__":
    main()
