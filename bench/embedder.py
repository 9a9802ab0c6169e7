"""Our code embedder (issue 55): mine pairs, train, and compare with all-MiniLM-L6-v2.

    python bench/embedder.py train [--work DIR] [--per-lang 9000] [--budget-min 62] [--epochs 1]
                                   [--evals-per-epoch 2] [--seed 55] [--export DIR] [--curve NAME] [--export-point last]
        (the defaults are the shipped model's recipe: 17,821 pairs, one epoch of 556 steps of 32,
         hard negatives from every definition of a package; on the 2-core Intel VM, 4.4-5.0 pairs/s,
         all 556 steps ran in 59 min)
        the whole recipe in one command: exclusion list (every definition of the evaluation corpora),
        pairs mined from third-party code (index/embed_mine.py), the six-language set's development
        halves as the curve, fine-tuning (index/embed_train.py, seeds and recipe in its Recipe; the
        schedule ends where the budget does), the end of the schedule exported as float16 to --export
        (default index/models/code-minilm/) with its weights' fingerprint, curve JSON + PNG under
        bench/embedder-results/ (NAME.json/.png, default train-curve). The shipped model's fusion is
        chosen afterwards: bench/search.py multi --model DIR, then
        bench/search_fusion.py WORK/fusion-cases-SLUG.pkl --write DIR; the query-kind prior's weight
        (the same for every model, code_index.Weights.kind) is checked with bench/search_python_gap.py
        --model DIR, then bench/search_kind.py --model DIR.
    python bench/embedder.py mine               the pairs alone (what `train` does first when they are missing)
    python bench/embedder.py kinds              index/query_kinds.json from the mined pairs: how often a doc
                                                whose first word is w documents a type, how often a function
                                                (the query-kind prior, index/query_kind.py)
    python bench/embedder.py dev --model M      dense MRR@10 of a model on the development halves
    python bench/embedder.py speed --models A,B embeddings/s of models side by side, alternating

The development measure: for each language of bench/search.py's `multi` set (Python, C, Java,
JavaScript, TypeScript, Rust), every definition of the corpus as the index embeds it
(`sync.dense_texts`), the queries of the development half (by file, search_eval.is_dev), the dense
ranking alone; MRR@10 pooled over the queries and per language. Test halves are never read here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import search_corpora  # noqa: E402
from bench import search_eval as se  # noqa: E402

LANGS = ("python", "c", "java", "javascript", "typescript", "rust")
RESULTS = Path(__file__).resolve().parent / "embedder-results"
MODEL_DIR = Path(__file__).resolve().parents[1] / "index" / "models" / "code-minilm"
DEFAULT_WORK = Path("/tmp/composer-embedder")


def exclusion_keys(langs=(*LANGS, "jdk")) -> frozenset[bytes]:
    """The code key of every definition in every evaluation corpus (test halves included)."""
    from index.chunker import chunk_file
    from index.embed_mine import code_key
    from index.sync import dense_texts

    keys = set()
    for lang in langs:
        root = se.source_root(lang)
        for p in search_corpora.source_files(root):
            rel = p.relative_to(root).as_posix()
            for t in dense_texts(chunk_file(rel, p.read_text(errors="replace")), path=rel):
                if t:
                    keys.add(code_key(t))
    return frozenset(keys)


class DevSet:
    """Dense retrieval over each language's definitions, development-half queries only."""

    def __init__(self, work: Path, langs=LANGS, half: str = "dev"):
        from index.chunker import chunk_file
        from index.sync import dense_texts

        self.sets = []
        for lang in langs:
            root, queries, _ = se.build(lang, work / "multi" / lang)
            cands = []  # (path, first line, last line, text)
            for p in search_corpora.source_files(root):
                rel = p.relative_to(root).as_posix()
                chunks = chunk_file(rel, p.read_text(errors="replace"))
                for c, t in zip(chunks, dense_texts(chunks, path=rel), strict=True):
                    if t:
                        cands.append((rel, c.unit[0] if c.unit else c.start_line,
                                      c.unit[1] if c.unit else c.end_line, t))
            qs = [q for q in queries if se.is_dev(q.path) == (half == "dev")]
            self.sets.append((lang, cands, qs))

    def __call__(self, model) -> dict[str, float]:
        import numpy as np

        model.max_seq_length = 256  # as the index reads (the shipped sentence_bert_config)
        pooled, out = [], {}
        for lang, cands, qs in self.sets:
            cv = model.encode([c[3] for c in cands], batch_size=32, normalize_embeddings=True)
            qv = model.encode([q.query for q in qs], batch_size=32, normalize_embeddings=True)
            rr = []
            for q, s in zip(qs, qv @ cv.T, strict=True):
                top = np.argsort(-s, kind="stable")[:10]
                hit = next((i for i, j in enumerate(top) if cands[j][0] == q.path
                            and cands[j][1] <= q.end_line and cands[j][2] >= q.start_line), None)
                rr.append(0.0 if hit is None else 1 / (hit + 1))
            out[f"MRR@10 {lang}"] = 100 * float(np.mean(rr)) if rr else 0.0
            pooled += rr
        return {"MRR@10": 100 * float(np.mean(pooled)), **out}


def _load(model: str | None):
    from sentence_transformers import SentenceTransformer

    from index.embed import load_embedder

    emb = load_embedder(model)
    return SentenceTransformer(emb.source, device="cpu", model_kwargs={"torch_dtype": "float32"})


def balanced(pairs, per_lang: int, seed: int):
    """At most `per_lang` pairs of each language (Python dominates what is mined), drawn with a seed
    evenly over its packages, in a shuffled order."""
    import random

    rng = random.Random(seed)
    by_pkg: dict[str, list] = {}
    for p in pairs:
        by_pkg.setdefault(p.package, []).append(p)
    out = []
    for lang in sorted({p.lang for p in pairs}):
        pkgs = [rng.sample(v, len(v)) for k, v in sorted(by_pkg.items()) if v[0].lang == lang]
        took = []
        while len(took) < per_lang and any(pkgs):
            for v in pkgs:  # round-robin over the language's packages
                if v and len(took) < per_lang:
                    took.append(v.pop())
        out += took
    rng.shuffle(out)
    return out


def mine_pairs(a) -> Path:
    """The mined pairs' file under the work folder, mined first if it is missing."""
    from index import embed_mine

    a.work.mkdir(parents=True, exist_ok=True)
    pairs_file = a.work / f"pairs-r{embed_mine.REVISION}.jsonl"
    if not pairs_file.exists():
        t = time.monotonic()
        excl = exclusion_keys()
        print(f"exclusion list: {len(excl)} definitions of the evaluation corpora", file=sys.stderr)
        pairs, stats = embed_mine.mine(embed_mine.all_trees(), per_package=a.per_package, exclude_hashes=excl)
        embed_mine.write(pairs, pairs_file)
        stats["_mined_s"] = time.monotonic() - t
        pairs_file.with_suffix(".stats.json").write_text(json.dumps(stats, indent=1))
        print(f"{len(pairs)} pairs mined in {stats['_mined_s']:.0f} s -> {pairs_file}", file=sys.stderr)
    return pairs_file


def cmd_mine(a) -> None:
    mine_pairs(a)


def cmd_kinds(a) -> None:
    from index import embed_mine, query_kind

    table = query_kind.build_table(embed_mine.read(mine_pairs(a)))
    query_kind.TABLE.write_text(json.dumps(table, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{query_kind.TABLE}: {len(table['words'])} words, docs {table['docs']}", file=sys.stderr)


def cmd_train(a) -> None:
    import torch

    from index import embed_mine, embed_train

    torch.set_num_threads(2)
    pairs_file = mine_pairs(a)
    mined = embed_mine.read(pairs_file)
    kinds, known = set(a.kinds.split(",")), [k for k, _ in embed_mine.KINDS]
    if not kinds <= set(known):
        sys.exit(f"--kinds: a comma-separated subset of {','.join(known)}, not {a.kinds!r}")
    pairs = balanced([p for p in mined if p.kind in kinds], a.per_lang, seed=a.seed)
    counts = {lg: sum(p.lang == lg for p in pairs) for lg in sorted({p.lang for p in pairs})}
    print(f"{len(pairs)} of {len(mined)} mined pairs: {counts}", file=sys.stderr)
    recipe = embed_train.Recipe(seed=a.seed, epochs=a.epochs, budget_min=a.budget_min, batch=a.batch, lr=a.lr,
                                max_seq=a.max_seq, evals_per_epoch=a.evals_per_epoch)
    dev = DevSet(a.work)
    model = _load("sentence-transformers/all-MiniLM-L6-v2")
    report = embed_train.train(model, pairs, recipe, a.work / "run", dev,
                               log=lambda s: print(s, file=sys.stderr, flush=True))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_json = RESULTS / f"{a.curve}.json"
    out_json.write_text(json.dumps({**report, "per_lang": a.per_lang, "kinds": sorted(kinds), "mined": len(mined),
                                    "pairs_by_lang": counts}, indent=1))
    embed_train.plot(out_json, RESULTS / f"{a.curve}.png",
                     "code-minilm: six-language dev halves, dense list")
    chosen = a.work / "run" / a.export_point
    if not chosen.is_dir():
        print("no point beat all-MiniLM-L6-v2 on the dev halves: exporting the last one, to measure",
              file=sys.stderr)
        chosen = a.work / "run" / "last"
    from index.embed import _bundled_model_dir

    embed_train.export_fp16(chosen, a.export or MODEL_DIR, config_from=_bundled_model_dir())
    print(f"exported {chosen} -> {a.export or MODEL_DIR} (float16)", file=sys.stderr)


def cmd_dev(a) -> None:
    import torch

    torch.set_num_threads(2)
    res = DevSet(a.work, half=a.half)(_load(a.model))
    print(json.dumps(res, indent=1))


def cmd_speed(a) -> None:
    """Chunks/s of each model on the same real chunks (the Python set's definitions), alternating."""
    import statistics

    import torch

    from index.chunker import chunk_file
    from index.embed import _open, load_embedder
    from index.sync import dense_texts

    torch.set_num_threads(2)
    root = se.source_root("python")
    texts = []
    for p in search_corpora.source_files(root):
        rel = p.relative_to(root).as_posix()
        texts += [t for t in dense_texts(chunk_file(rel, p.read_text()), path=rel) if t]
    texts = texts[: a.limit]
    names = a.models.split(",")
    embs = {n: load_embedder(n) for n in names}
    for e in embs.values():
        e.encode(texts[:64])  # load and warm up
    rates: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(a.runs):
        for n in names:
            t = time.monotonic()
            embs[n].encode(texts)
            rates[n].append(len(texts) / (time.monotonic() - t))
    out = {n: {"chunks_per_s": statistics.median(r), "runs": r, "dtype": embs[n].dtype} for n, r in rates.items()}
    base = names[0]
    for n in names:
        print(f"{n}: {out[n]['chunks_per_s']:.1f} chunks/s ({out[n]['dtype']}), "
              f"{out[n]['chunks_per_s'] / out[base]['chunks_per_s']:.2f}x {base}")
    print(f"{len(texts)} texts, load average {os.getloadavg()[0]:.1f}")
    _ = _open
    if a.json:
        a.json.write_text(json.dumps({"texts": len(texts), **out}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=("mine", "kinds", "train", "dev", "speed"))
    p.add_argument("--work", type=Path, default=DEFAULT_WORK)
    p.add_argument("--budget-min", type=float, default=62.0, help="train: minutes of training steps")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=55,
                   help="train: which pairs each language's cap keeps, their order, dropout (the shipped model: 55)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-seq", type=int, default=128)
    p.add_argument("--per-package", type=int, default=700)
    p.add_argument("--per-lang", type=int, default=9000, help="train: pairs of each language at most")
    p.add_argument("--export-point", choices=("last", "best"), default="last",
                   help="train: export the end of the schedule, or the best development point (75 queries: "
                        "neighbouring points differ by up to 4 MRR, so `best` picks noise)")
    p.add_argument("--kinds", default="sentence,doc,names",
                   help="train: the kinds of mined query to train on (first sentence, whole doc comment, names)")
    p.add_argument("--evals-per-epoch", type=int, default=2, help="train: dev points per epoch")
    p.add_argument("--curve", default="train-curve",
                   help="train: name of the curve's JSON and PNG under bench/embedder-results/")
    p.add_argument("--export", type=Path, help="train: where the float16 model goes (default: the package's)")
    p.add_argument("--model", help="dev: a model folder or name (default: the index's default)")
    p.add_argument("--half", choices=("dev", "test"), default="dev")
    p.add_argument("--models", default="sentence-transformers/all-MiniLM-L6-v2,code-minilm")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--limit", type=int, default=600)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    {"mine": cmd_mine, "kinds": cmd_kinds, "train": cmd_train, "dev": cmd_dev, "speed": cmd_speed}[a.cmd](a)


if __name__ == "__main__":
    main()
