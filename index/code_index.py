"""A workspace's semantic code index: build, keep in sync, search.

Sync compares the workspace with what the index recorded: files whose size and mtime are unchanged are
skipped without being read; the rest are hashed, and only files whose content hash changed are chunked
again. Within a changed file, chunks whose embedded text is unchanged keep their vectors (most edits
touch one function), so only new text is embedded. Deleted files lose their chunks. A different
embedding model or index format forces a full rebuild, as does `rebuild=True`.

Search embeds the query, takes the best candidates from the dense (FAISS, exact inner product) and
lexical (BM25) indexes, optionally restricted to a folder, and fuses them with reciprocal rank fusion.

One `CodeIndex` serves one workspace; its methods are thread-safe (one lock: search reads the same
in-memory FAISS index that sync mutates). Several processes may share a workspace: writers serialise
on a file lock and readers notice a new generation on their next call (see store.py).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from index import store
from index.chunker import chunk_file
from index.embed import Embedder, load_embedder
from index.files import MAX_FILE_BYTES, STATE_DIR, decode, list_files, noise_reason
from index.fusion import rrf, weighted_sum
from index.languages import language_for
from index.lexical import Lexical

# Tokens kept free in each chunk for the symbol part of the header.
SYMBOL_RESERVE = 16
# Candidates taken from each retriever before fusion.
CANDIDATES = 100
# Files modified this recently are re-hashed next time even if size and mtime match: a write in the
# same mtime tick as our stat would otherwise go unnoticed (the "racy git" problem).
RACY_NS = 2_000_000_000

Progress = Callable[[str, int, int], None]  # (stage, done, total); stages: "scan", "embed"


@dataclass(frozen=True)
class Weights:
    """How the dense and lexical rankings are fused (fusion.py). The defaults were tuned on the
    development half of bench/search.py's stdlib queries; see bench/INDEX-RESULTS.md."""

    method: str = "sum"  # "sum" (max-normalised weighted sum) or "rrf"
    dense: float = 0.7
    lexical: float = 0.3
    k: float = 60.0  # RRF only

    def fuse(self, dense: tuple[list[int], list[float]], lexical: tuple[list[int], list[float]]
             ) -> list[tuple[int, float]]:
        if self.method == "rrf":
            return rrf([(dense[0], self.dense), (lexical[0], self.lexical)], k=self.k)
        return weighted_sum([(dense[0], dense[1], self.dense), (lexical[0], lexical[1], self.lexical)])


@dataclass
class Hit:
    path: str
    start_line: int
    end_line: int
    symbol: str
    score: float
    text: str
    dense_rank: int | None = None
    lexical_rank: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SyncReport:
    files: int = 0  # files listed in the workspace
    indexed_files: int = 0  # of which hold chunks
    chunks: int = 0  # chunks in the index afterwards
    added: list[str] = field(default_factory=list)
    modified: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> files
    embedded: int = 0  # chunks embedded by this sync
    reused: int = 0  # chunks whose vectors were kept
    rebuilt: str | None = None  # why the whole index was rebuilt, if it was
    seconds: float = 0.0

    @property
    def changed(self) -> int:
        return len(self.added) + len(self.modified) + len(self.deleted)

    def summary(self) -> str:
        if self.rebuilt:
            head = f"built the index ({self.rebuilt}): {self.indexed_files} files, {self.chunks} chunks"
        elif self.changed:
            parts = [f"{len(v)} {name}" for name, v in
                     (("added", self.added), ("modified", self.modified), ("deleted", self.deleted)) if v]
            head = (f"indexed {self.changed} changed file{'s' if self.changed != 1 else ''} "
                    f"({', '.join(parts)}); {self.chunks} chunks")
        else:
            return f"index up to date: {self.indexed_files} files, {self.chunks} chunks"
        return f"{head} in {self.seconds:.1f}s"


@dataclass
class _Snapshot:
    gen: int
    info: dict[str, str]
    vectors: object  # faiss.IndexIDMap2
    lexical: Lexical


def index_dir_for(root: Path) -> Path:
    """`<root>/.composer/index`, creating `.composer/` with a .gitignore that keeps it out of git."""
    base = root / STATE_DIR
    if not base.exists():
        base.mkdir(parents=True, exist_ok=True)
        # Same rule as the agent's state folder: Composer's state never lands in a commit.
        (base / ".gitignore").write_text(
            "# Composer's state (sessions, index, logs) stays out of git; config.toml may be shared.\n"
            "*\n!.gitignore\n!config.toml\n")
    return base / "index"


def embed_text(path: str, symbol: str, code: str) -> str:
    """What the embedder sees: a one-line header naming the place, then the code."""
    return f"{path} | {symbol}\n{code}" if symbol else f"{path}\n{code}"


def lexical_text(embedded: str, symbol: str) -> str:
    """What BM25 sees: the embedded text with the symbol counted twice, a poor man's BM25F field
    weight (a definition's name says more than any word in its body: +1.3 MRR@10 on the bench's
    development half)."""
    return f"{symbol}\n{embedded}" if symbol else embedded


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class CodeIndex:
    def __init__(self, root: str | Path, *, model: str | None = None, embedder: Embedder | None = None,
                 index_dir: Path | None = None, max_file_bytes: int = MAX_FILE_BYTES,
                 weights: Weights = Weights()):
        self.root = Path(os.path.realpath(root))
        if not self.root.is_dir():
            raise NotADirectoryError(f"not a folder: {root}")
        self.dir = index_dir or index_dir_for(self.root)
        self.model = model
        self._embedder = embedder
        self.max_file_bytes = max_file_bytes
        self.weights = weights
        self._lock = threading.RLock()
        self._con = store.connect(self.dir)
        self._snap: _Snapshot | None = None

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = load_embedder(self.model)
        return self._embedder

    def close(self) -> None:
        self._con.close()

    def info(self) -> dict[str, str]:
        return store.read_info(self._con)

    # -- loading -------------------------------------------------------------------------------------

    def _current(self) -> _Snapshot | None:
        """The committed generation, loaded (again only if another writer committed since)."""
        import faiss

        for _ in range(5):
            info = store.read_info(self._con)
            if info.get("format") != store.FORMAT or "gen" not in info:
                self._snap = None
                return None
            gen = int(info["gen"])
            if self._snap is not None and self._snap.gen == gen:
                return self._snap
            vpath, lpath = store.vectors_path(self.dir, gen), store.lexical_path(self.dir, gen)
            try:
                vectors = faiss.read_index(str(vpath))
                lexical = Lexical.load(lpath)
            except (OSError, RuntimeError, ValueError, KeyError):
                # A writer may have just replaced this generation: look again; else it is damaged.
                if store.read_info(self._con).get("gen") != info["gen"]:
                    continue
                self._snap = None
                return None
            n = self._con.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
            if vectors.ntotal != n or len(lexical) != n:
                if store.read_info(self._con).get("gen") != info["gen"]:
                    continue
                self._snap = None
                return None
            self._snap = _Snapshot(gen, info, vectors, lexical)
            return self._snap
        return None

    def _rebuild_reason(self, snap: _Snapshot | None, emb: Embedder) -> str | None:
        info = store.read_info(self._con)
        if not info:
            return "no index yet"
        if info.get("format") != store.FORMAT:
            return "index format changed"
        if info.get("model") != emb.name or info.get("dim") != str(emb.dim):
            return f"embedding model changed from {info.get('model')} to {emb.name}"
        if snap is None:
            return "index files missing or damaged"
        return None

    # -- sync ----------------------------------------------------------------------------------------

    def sync(self, *, rebuild: bool = False, progress: Progress | None = None,
             wait: bool = True) -> SyncReport:
        """Bring the index up to date with the workspace. With `wait=False`, raise `IndexBusy` rather
        than wait for another process that is writing."""
        t0 = time.monotonic()
        with self._lock, store.writer_lock(self.dir, wait=wait):
            emb = self.embedder
            snap = self._current()
            reason = "rebuild requested" if rebuild else self._rebuild_reason(snap, emb)
            try:
                report = self._sync(snap if reason is None else None, emb, reason, progress)
            except BaseException:
                self._snap = None  # in-memory structures may be half-updated: reload from disk
                raise
            report.seconds = time.monotonic() - t0
            return report

    def _sync(self, snap: _Snapshot | None, emb: Embedder, reason: str | None,
              progress: Progress | None) -> SyncReport:
        import faiss

        full = reason is not None
        report = SyncReport(rebuilt=reason)
        stored = {} if full else store.read_files(self._con)
        listed = list_files(self.root)
        report.files = len(listed)
        listed_set = set(listed)

        new_files: list[store.FileRow] = []  # rows to write (changed content or status)
        stat_only: list[store.FileRow] = []  # same content, new size/mtime
        texts: dict[str, str] = {}  # files to chunk
        now = time.time_ns()
        for i, rel in enumerate(listed):
            if progress and i % 200 == 0:
                progress("scan", i, len(listed))
            row = self._scan_one(rel, stored.get(rel), now, texts)
            if row is None:
                continue
            if row.hash == "=":  # unchanged content
                stat_only.append(store.FileRow(rel, row.size, row.mtime_ns, stored[rel].hash,
                                               stored[rel].status, stored[rel].n_chunks))
                continue
            new_files.append(row)
            (report.modified if rel in stored else report.added).append(rel)
            if row.status != "indexed":
                report.skipped[row.status] = report.skipped.get(row.status, 0) + 1
        if progress:
            progress("scan", len(listed), len(listed))
        report.deleted = sorted(p for p in stored if p not in listed_set)

        # Old chunks of modified files: their vectors can be reused where the text is unchanged.
        old = store.chunk_hashes(self._con, report.modified) if not full else {}
        reusable: dict[str, int] = {h: cid for chunks in old.values() for cid, h in chunks}
        gone_ids = [cid for chunks in old.values() for cid, _ in chunks]
        gone_ids += [cid for chunks in store.chunk_hashes(self._con, report.deleted).values()
                     for cid, _ in chunks] if not full else []

        info = store.read_info(self._con)
        next_id = int(info.get("next_id", "1"))
        rows: list[store.ChunkRow] = []
        embed_texts: list[str] = []
        lex_texts: list[str] = []
        to_embed: list[int] = []  # positions in rows
        reuse_from: list[tuple[int, int]] = []  # (position in rows, old chunk id)
        for fi, frow in enumerate(new_files):
            text = texts.pop(frow.path, None)
            if text is None:
                continue
            chunks = self._chunk(frow.path, text, emb)
            new_files[fi] = store.FileRow(frow.path, frow.size, frow.mtime_ns, frow.hash,
                                          "indexed" if chunks else "empty", len(chunks))
            lang = language_for(frow.path) or "text"
            for c in chunks:
                etext = embed_text(frow.path, c.symbol, c.text)
                th = _hash(etext.encode("utf-8", errors="surrogatepass"))
                rows.append(store.ChunkRow(next_id, frow.path, c.start_line, c.end_line, c.symbol, lang,
                                           th, c.text))
                next_id += 1
                if th in reusable:
                    reuse_from.append((len(rows) - 1, reusable.pop(th)))
                else:
                    to_embed.append(len(rows) - 1)
                embed_texts.append(etext)
                lex_texts.append(lexical_text(etext, c.symbol))

        if not full and not rows and not gone_ids:
            # Nothing to embed or remove (only skipped files came or went): metadata only, same generation.
            if new_files or report.deleted:
                store.commit(self._con, gen=snap.gen, info={}, full=False, removed_paths=report.deleted,
                             files=new_files + stat_only, chunks=[])
            elif stat_only:
                store.update_stats(self._con, stat_only)
            return self._finish(report, snap)

        # Embed what is new (the slow part), reuse the rest.
        vecs = np.zeros((len(rows), emb.dim), dtype=np.float32)
        if to_embed:
            done = 0

            def on_batch(n: int) -> None:
                nonlocal done
                done += n
                if progress:
                    progress("embed", done, len(to_embed))

            if progress:
                progress("embed", 0, len(to_embed))
            vecs[to_embed] = emb.encode([embed_texts[i] for i in to_embed], on_batch=on_batch)
        for pos, old_id in reuse_from:
            vecs[pos] = snap.vectors.reconstruct(old_id)
        report.embedded, report.reused = len(to_embed), len(reuse_from)

        if full:
            vectors = faiss.IndexIDMap2(faiss.IndexFlatIP(emb.dim))
            lexical = Lexical.empty()
        else:
            vectors, lexical = snap.vectors, snap.lexical
            if gone_ids:
                vectors.remove_ids(faiss.IDSelectorBatch(np.asarray(gone_ids, dtype=np.int64)))
                lexical.remove(gone_ids)
        if rows:
            ids = np.asarray([r.id for r in rows], dtype=np.int64)
            vectors.add_with_ids(vecs, ids)
            lexical.add(ids, lex_texts)

        gen = int(info.get("gen", "0")) + 1
        store.write_atomic(store.vectors_path(self.dir, gen), lambda p: faiss.write_index(vectors, str(p)))
        store.write_atomic(store.lexical_path(self.dir, gen), lexical.save)
        new_info = {"format": store.FORMAT, "model": emb.name, "dim": str(emb.dim),
                    "next_id": str(next_id)}
        if full:
            new_info["built_at"] = str(time.time())
        store.commit(self._con, gen=gen, info=new_info, full=full,
                     removed_paths=report.modified + report.deleted, files=new_files + stat_only,
                     chunks=rows)
        self._snap = _Snapshot(gen, store.read_info(self._con), vectors, lexical)
        store.remove_stale(self.dir, gen)
        return self._finish(report, self._snap)

    def _finish(self, report: SyncReport, snap: _Snapshot | None) -> SyncReport:
        report.chunks = snap.vectors.ntotal if snap is not None else 0
        report.indexed_files = self._con.execute(
            "SELECT COUNT(*) FROM files WHERE n_chunks > 0").fetchone()[0]
        return report

    def _scan_one(self, rel: str, old: store.FileRow | None, now: int,
                  texts: dict[str, str]) -> store.FileRow | None:
        """Classify one listed file. Returns None if it vanished, a row with hash "=" if its content is
        unchanged, else its new row (and its text in `texts` when it is to be chunked)."""
        path = self.root / rel
        try:
            st = path.stat()
        except OSError:
            return None
        mtime = 0 if now - st.st_mtime_ns < RACY_NS else st.st_mtime_ns
        if old is not None and old.mtime_ns and (old.size, old.mtime_ns) == (st.st_size, st.st_mtime_ns):
            return store.FileRow(rel, st.st_size, st.st_mtime_ns, "=", old.status)
        reason = noise_reason(rel)
        if reason is None and st.st_size > self.max_file_bytes:
            reason = "too large"
        if reason is not None:
            if old is not None and old.status == reason:
                return store.FileRow(rel, st.st_size, mtime, "=", reason)
            return store.FileRow(rel, st.st_size, mtime, "", reason)
        try:
            data = path.read_bytes()
        except OSError as e:
            return store.FileRow(rel, st.st_size, 0, "", f"unreadable: {e.strerror or e}")
        h = _hash(data)
        if old is not None and old.hash == h:
            return store.FileRow(rel, st.st_size, mtime, "=", old.status)
        ft = decode(data, max_bytes=self.max_file_bytes)
        if ft.text is None:
            return store.FileRow(rel, st.st_size, mtime, h, ft.skip_reason or "skipped")
        texts[rel] = ft.text
        return store.FileRow(rel, st.st_size, mtime, h, "indexed")

    def _chunk(self, rel: str, text: str, emb: Embedder):
        path_tokens = emb.count_tokens([rel])[0]
        # [CLS] and [SEP] take two of the model's tokens; the header takes the path and the symbol.
        budget = max(64, emb.max_tokens - 2 - path_tokens - SYMBOL_RESERVE)
        return chunk_file(rel, text, budget=budget, count_tokens=emb.count_tokens)

    # -- search --------------------------------------------------------------------------------------

    def candidates(self, queries: list[str], n: int = CANDIDATES, *, path: str | None = None,
                   ) -> list[tuple[tuple[list[int], list[float]], tuple[list[int], list[float]]]]:
        """For each query, ((ids, scores) from the dense retriever, (ids, scores) from BM25), best
        first, up to `n` each, restricted to a file or folder when `path` is given. The two fused are
        the search result; apart they are what evaluations compare."""
        import faiss

        with self._lock:
            snap = self._current()
            none: tuple[list[int], list[float]] = ([], [])
            if snap is None or snap.vectors.ntotal == 0 or not queries:
                return [(none, none) for _ in queries]
            emb = self.embedder
            if snap.info.get("model") != emb.name:
                raise ValueError(f"the index was built with {snap.info.get('model')}, not {emb.name}; "
                                 "sync (or rebuild) it first")
            allowed = None
            prefix = (path or "").strip().strip("/")
            if prefix and prefix != ".":
                ids = store.ids_under(self._con, prefix)
                if not ids:
                    return [(none, none) for _ in queries]
                allowed = np.asarray(ids, dtype=np.int64)
            qv = emb.encode(queries)
            selector = faiss.IDSelectorBatch(allowed) if allowed is not None else None
            params = faiss.SearchParameters(sel=selector) if selector is not None else None
            dist, dense = snap.vectors.search(qv, min(n, snap.vectors.ntotal), params=params)
            out = []
            for qi, q in enumerate(queries):
                keep = dense[qi] >= 0
                lex_ids, lex_scores = snap.lexical.search(q, n, allowed=allowed)
                out.append(((dense[qi][keep].tolist(), dist[qi][keep].tolist()),
                            (lex_ids.tolist(), lex_scores.tolist())))
            return out

    def chunks(self, ids: list[int]) -> dict[int, store.ChunkRow]:
        with self._lock:
            return store.chunks_by_id(self._con, ids)

    def search(self, query: str, k: int = 10, *, path: str | None = None) -> list[Hit]:
        """The `k` best chunks for `query`, best first; `path` restricts to a file or folder (POSIX,
        relative to the root). Searches what is indexed now: call `sync()` first for fresh results."""
        query = query.strip()
        if not query:
            raise ValueError("the query is empty")
        if k < 1:
            raise ValueError("k must be at least 1")
        with self._lock:
            (dense, lexical), = self.candidates([query], max(k, CANDIDATES), path=path)
            fused = self.weights.fuse(dense, lexical)[:k]
            rows = store.chunks_by_id(self._con, [cid for cid, _ in fused])
        dense_ids, lex_ids = dense[0], lexical[0]
        dense_rank = {cid: r for r, cid in enumerate(dense_ids, start=1)}
        lex_rank = {cid: r for r, cid in enumerate(lex_ids, start=1)}
        hits = []
        for cid, score in fused:
            r = rows.get(cid)
            if r is not None:
                hits.append(Hit(r.path, r.start_line, r.end_line, r.symbol, round(score, 6), r.text,
                                dense_rank.get(cid), lex_rank.get(cid)))
        return hits
