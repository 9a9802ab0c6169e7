"""The agent's first searches in a repository it has never indexed: what its early answers are worth.

    python bench/search_first.py [--budget 45] [--limit 1000] [--work DIR] [--model M]
    python bench/search_first.py --plot BEFORE.log,AFTER.log --out first-search.png   # MRR@10 against time

The repository is the `quality` corpus (the Python standard library with its docstrings blanked,
bench/corpus.py: ~730 files, ~29,000 chunks). Each round is one `semantic_search` call as the agent's
tool makes it: a sync with the tool's time budget (`--budget`, the tool's SYNC_BUDGET_S), then the
searches. Per round it prints the sync's seconds, the files the index holds, the definitions that have
vectors, and MRR@10 of a fixed sample of the corpus's docstring -> function queries (`--limit`) ranked
as `semantic_search` ranks them, on the index as it stands; rounds go on until nothing is pending.
The index is built in a fresh folder each run (the corpus is not touched), after the model is loaded.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import corpus as corpus_mod  # noqa: E402
from bench.search import DEFAULT_WORK, _flags, machine, metrics  # noqa: E402
from index.code_index import CodeIndex, per_definition  # noqa: E402


def mrr(ix: CodeIndex, queries: list) -> float:
    """MRR@10 of `queries` on the index as it stands, ranked as CodeIndex.search ranks."""
    cands = ix.candidates([q.query for q in queries], 100)
    rows = ix.chunks(sorted({i for d, lx, dc in cands for i in d[0] + lx[0] + dc[0]}))
    ranked = []
    for q, c in zip(queries, cands, strict=True):
        d, lx, dc = per_definition(list(c), rows)
        ranked.append(_flags([cid for cid, _ in ix.weights.rank(q.query, d, lx, dc, rows)], q, rows))
    return metrics(ranked)["MRR@10"]


ROUND = re.compile(r"round \d+: sync +[\d.]+s \(all rounds +([\d.]+)s\).*MRR@10 +([\d.]+)")


def plot(logs: list[Path], out: Path) -> None:
    """MRR@10 after each round against the seconds spent syncing, one line per log of this script."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for log in logs:
        points = [(float(m[1]), float(m[2])) for m in map(ROUND.search, log.read_text().splitlines()) if m]
        ax.step([0.0] + [t for t, _ in points], [0.0] + [v for _, v in points], where="post", marker="o",
                label=f"{log.stem} ({len(points)} searches)")
    ax.set_xlabel("seconds the searches spent syncing (45 s budget each)")
    ax.set_ylabel("MRR@10 of the answers (1,000 queries)")
    ax.set_title("First searches in a repository never indexed (Python stdlib, 29k chunks)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"written {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=45.0, help="seconds a sync may spend (the tool's budget)")
    ap.add_argument("--limit", type=int, default=1000, help="queries evaluated each round (a fixed sample)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--model", help="embedding model (default: the index's default)")
    ap.add_argument("--plot", help="comma-separated logs of this script: plot them instead of measuring")
    ap.add_argument("--out", type=Path, default=Path("first-search.png"), help="--plot: the PNG to write")
    a = ap.parse_args()
    if a.plot:
        plot([Path(x) for x in a.plot.split(",")], a.out)
        return
    print(f"machine: {machine()}", flush=True)
    corpus, queries = corpus_mod.build(a.work)
    if a.limit and len(queries) > a.limit:
        queries = random.Random(0).sample(queries, a.limit)
    with tempfile.TemporaryDirectory(prefix="composer-first-") as tmp:
        ix = CodeIndex(corpus, index_dir=Path(tmp) / "index", model=a.model)
        t = time.monotonic()
        _ = ix.embedder.model  # torch and the weights loaded before the clock starts
        print(f"corpus {corpus}: {len(queries)} queries; model {ix.embedder.name} loaded in "
              f"{time.monotonic() - t:.1f}s; budget {a.budget:g}s a sync", flush=True)
        spent, round_no = 0.0, 0
        while True:
            round_no += 1
            t = time.monotonic()
            report = ix.sync(budget_s=a.budget)
            took = time.monotonic() - t
            spent += took
            t = time.monotonic()
            score = mrr(ix, queries)
            vectors = ix._current().vectors.ntotal
            print(f"round {round_no}: sync {took:5.1f}s (all rounds {spent:6.1f}s)  files {report.indexed_files:4d}  "
                  f"chunks {report.chunks:6d}  vectors {vectors:6d}  MRR@10 {score:5.1f}  "
                  f"(searched in {time.monotonic() - t:.1f}s)", flush=True)
            if not report.pending:
                break
        ix.close()


if __name__ == "__main__":
    main()
