"""How far a composer-tiny checkpoint's skill reaches: greedy pass@1 on new seeds of the code it was
trained on ("seen code": the training pool's own names, seeds 50,000+ that no recipe trains on), on that
code under fresh names ("renamed": seeds 900,000+) and on the held-out pool ("unseen code": modules and
function names that appear nowhere in training, seeds 1,000,000+).

    python bench/tiny_heldout.py NAME=MODEL_DIR... [--families find-def] [--seeds 150] [--seed-offset 0] [--kinds seen,renamed,unseen] [--temperature 0] [--samples 1] [--dtype float64] [--concurrency 2] [--out bench/tiny]

With --samples K (and a temperature above 0) every task runs K times: pass@1 is then the mean over all K
runs, and pass@K the share of tasks solved at least once, the most RL can sharpen towards from this
policy (a group of K episodes of a task with no success has no signal to learn from).

Each model is served by composer-serve (one server, weights switched between models) and run through
the eval runner, as the recipe's own held-out eval does. Writes heldout.json and a plot next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/train.py must not shadow train/

BASES = {"seen": 50_000, "renamed": 900_000, "unseen": 1_000_000}


def tasks(families: list[str], kind: str, n: int, size: str, offset: int = 0):
    from agent.tasks.families import generate

    return [generate(f, BASES[kind] + offset + s, size, "heldout") for s in range(n) for f in families]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="NAME=MODEL_DIR (a served checkpoint folder)")
    ap.add_argument("--families", default="find-def")
    ap.add_argument("--seeds", type=int, default=150)
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="skip this many seeds of each kind (e.g. to score a choice made on the first ones on new seeds)")
    ap.add_argument("--kinds", default=",".join(BASES), help="which of seen,renamed,unseen to run")
    ap.add_argument("--size", default="small")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-output-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); 1: the policy RL samples")
    ap.add_argument("--samples", type=int, default=1,
                    help="episodes per task (with --temperature > 0): adds pass@K and each task's solve count")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"],
                    help="float64 (default): as the built-in model is served, the same greedy choices on every CPU")
    ap.add_argument("--concurrency", type=int, default=2,
                    help="episodes at once (default 2, as the recipe records and evaluates); 16 on a 2-core machine "
                         "times every tool call 2-5x slower, as a slow or busy machine would")
    ap.add_argument("--out", default="bench/tiny")
    args = ap.parse_args(argv)
    if args.samples < 1 or (args.samples > 1 and args.temperature == 0):
        ap.error("--samples must be >= 1, and above 1 only with --temperature > 0 (greedy repeats itself)")

    from train.recipe import PYTEST_ENV, Served, TinyRecipe, evaluate, headline

    os.environ.update(PYTEST_ENV)
    families = args.families.split(",")
    r = TinyRecipe(max_turns=args.max_turns, max_output_tokens=args.max_output_tokens, concurrency=args.concurrency)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiny-heldout-"))
    suites = {kind: tasks(families, kind, args.seeds, args.size, args.seed_offset) for kind in args.kinds.split(",")}
    results: dict[str, dict] = {}
    for spec in args.models:
        name, _, model = spec.partition("=")
        model_dir = Path(model)
        results[name] = {"model": str(model_dir)}
        # a server per model: weights can only be switched to a newer policy version
        served = Served(work / f"{name}-server.log", dtype=args.dtype)
        try:
            for kind, suite in suites.items():
                if args.samples == 1:
                    report = evaluate(served.serve(model_dir), suite, work / f"{name}-{kind}", r,
                                      temperature=args.temperature)
                    results[name][kind] = headline(report)
                else:
                    results[name][kind] = _sampled(served.serve(model_dir), suite, work / f"{name}-{kind}", r,
                                                   args.temperature, args.samples, name)
                    print(f"{name:>16} {kind:>6} code: pass@{args.samples} {results[name][kind]['pass@k']}",
                          flush=True)
                print(f"{name:>16} {kind:>6} code: pass@1 {results[name][kind]['pass@1']} "
                      f"(by family: {results[name][kind]['families']})", flush=True)
        finally:
            served.stop()
    print(f"episodes: {work}")
    summary = {"families": families, "seeds": args.seeds, "samples": args.samples, "seed_offset": args.seed_offset, "size": args.size, "bases": BASES,
               "concurrency": args.concurrency, "max_turns": args.max_turns,
               "temperature": args.temperature, "dtype": args.dtype, "results": results}
    (out / "heldout.json").write_text(json.dumps(summary, indent=2))
    print("\n| model | seen code, new seeds | seen code, fresh names | unseen code (held-out pool) |")
    print("| --- | --- | --- | --- |")
    for name, res in results.items():
        cells = [str(res[k]["pass@1"]) if k in res else "-" for k in BASES]
        print(f"| {name} | {' | '.join(cells)} |")
    _plot(results, out / "heldout.png", families, args.temperature)
    return 0


def _sampled(server, suite, folder: Path, r, temperature: float, k: int, name: str) -> dict:
    """K runs of `suite` at `temperature`: pass@1 over all runs, pass@K, and each task's solve count."""
    from train.recipe import evaluate

    solved: dict[str, int] = {t.id: 0 for t in suite}
    for j in range(k):
        print(f"{name}: sample {j + 1}/{k}", flush=True)
        evaluate(server, suite, folder / f"sample-{j}", r, temperature=temperature)
        for line in (folder / f"sample-{j}" / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            solved[row["task_id"]] += bool(row["passed"])
    n = len(solved)
    by_family: dict[str, list[int]] = {}
    for t in suite:
        by_family.setdefault(t.family, []).append(solved[t.id])
    return {"pass@1": round(sum(solved.values()) / (k * n), 4), "pass@k": round(sum(c > 0 for c in solved.values()) / n, 4),
            "k": k, "families": {f: round(sum(c) / (k * len(c)), 4) for f, c in sorted(by_family.items())},
            "solved": solved}


def _plot(results: dict, path: Path, families: list[str], temperature: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(names)), 3.5))
    labels = {"seen": "seen code, new seeds", "renamed": "seen code, fresh names", "unseen": "unseen code"}
    for i, (kind, label) in enumerate(labels.items()):
        ax.bar([x + 0.27 * (i - 1) for x in xs], [results[n].get(kind, {}).get("pass@1") or 0 for n in names], 0.27, label=label)
    ax.set_xticks(list(xs), names, rotation=20)
    ax.set_ylim(0, 1)
    ax.set_ylabel("greedy pass@1" if temperature == 0 else f"pass@1 at T={temperature:g}")
    ax.set_title(f"composer-tiny held-out ({', '.join(families)})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
