"""A workspace's semantic code index: open it, keep it in sync (sync.py), search it.

Search embeds the query, takes the best candidates from the dense (FAISS, exact inner product, one
vector per definition: sync.py) index of the code, the lexical (BM25) index of the code and the BM25
index of the doc prose (a separate field, see chunker.py), optionally restricted to a file or folder,
puts every list per definition (`per_definition`: the head the dense list finds and a slice BM25
finds are one answer), fuses the three lists (fusion.py; the weights were chosen on the bench's
development queries), moves types and functions by what the query's first word says it asks for
(query_kind.py), collapses several chunks of one definition into one result, and, when the query is
one name, puts the definitions of that name first (`definitions_first`).

One `CodeIndex` serves one workspace; its methods are thread-safe (one lock: search reads the same
in-memory FAISS index that sync mutates). Several processes may share a workspace: writers serialise
on a file lock and readers notice a new generation on their next call (store.py).
"""

from __future__ import annotations

import math
import os
import posixpath
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from index import query_kind, store
from index.embed import Embedder, load_embedder
from index.files import MAX_FILE_BYTES, STATE_DIR
from index.fusion import absolute_sum, rrf, weighted_sum
from index.sync import Progress, Syncer, SyncReport

# Candidates taken from each retriever before fusion.
CANDIDATES = 100
# A query that is one name, plain or qualified (`letter`, `Parser.feed`, `io::Read`, `List#add`), maybe
# after the keyword that declares it (`def letter`, `class Parser`, `fn parse`), in backticks or with
# a call's parentheses (`letter()`).
_NAME_QUERY = re.compile(r"(?:(?:def|class|fn|func|function|struct|interface|trait|enum|impl)\s+)?`?"
                         r"([A-Za-z_$][\w$]*(?:(?:\.|::|#)[A-Za-z_$][\w$]*)*)(?:\(\))?`?")
_NAME_SEP = re.compile(r"\.|::|#")


@dataclass(frozen=True)
class Weights:
    """How the dense, lexical and doc rankings are fused (fusion.py). The defaults (absolute scores,
    dense 0.65 / BM25 0.35, power 1) never rank below the better of the two lists in any language of
    the development half of bench/search.py's `multi` (six languages and a JDK standard-library set,
    357 queries), the best such configuration there, and within half a point of the best on
    `quality`'s (the Python stdlib without docstrings, 2,678 queries)."""

    method: str = "abs"  # "abs" (absolute scores), "sum" (max-normalised weighted sum) or "rrf"
    dense: float = 0.65
    lexical: float = 0.35
    # The doc prose field. Tuned to 0 on the multi-language set's dev half (every step up, 0.05 to 0.3,
    # cost MRR@10): the documented neighbours' wording is exactly what misleads. Kept as a field so
    # the prose stays out of the code's vector and bag, and to be weighed again with more data.
    doc: float = 0.0
    k: float = 60.0  # RRF only
    power: float = 1.0  # "abs" only: the exponent of BM25's fraction of the query's ceiling
    # The query-kind prior's weight (query_kind.py), in units of a fused score of 1 (with RRF, whose
    # top score is 1/(k+1) a list, it is scaled by that). 0.04: the best on every set's development
    # halves pooled (`python bench/search_kind.py`: +0.6 MRR@10 there, +0.7 on the test halves).
    kind: float = 0.04

    def __post_init__(self):
        if self.method not in ("abs", "sum", "rrf"):
            raise ValueError(f"fusion method {self.method!r}: expected abs, sum or rrf")
        if min(self.dense, self.lexical, self.doc, self.kind) < 0 or self.k <= 0 or self.power <= 0:
            raise ValueError(f"bad fusion weights: {self}")

    @classmethod
    def for_model(cls, emb: Embedder) -> Weights:
        """The fusion tuned for this embedder, stored with the model (embed.SETTINGS_FILE's `fusion`:
        code-minilm's were tuned on the six languages' development halves), else the defaults above
        (tuned for all-MiniLM-L6-v2)."""
        fusion = getattr(emb, "fusion", None)
        if not fusion:
            return cls()
        try:
            return cls(**fusion)
        except TypeError as e:
            raise ValueError(f"the fusion stored with {emb.name} is not valid: {fusion} ({e})") from e

    def fuse(self, dense: Ranking, lexical: Ranking, doc: Ranking | None = None) -> list[tuple[int, float]]:
        lists = [(dense, self.dense), (lexical, self.lexical)]
        if doc is not None:
            lists.append((doc, self.doc))
        if self.method == "rrf":
            return rrf([(ids, w) for (ids, _), w in lists], k=self.k)
        if self.method == "abs":
            return absolute_sum((*dense, self.dense), [(*r, w) for r, w in lists[1:]], self.power)
        return weighted_sum([(ids, scores, w) for (ids, scores), w in lists])

    def rank(self, query: str, dense: Ranking, lexical: Ranking, doc: Ranking | None,
             rows: dict[int, store.ChunkRow]) -> list[tuple[int, float]]:
        """One result per definition, best first: the fused lists, moved by the query-kind prior, collapsed."""
        scale = 1 / (self.k + 1) if self.method == "rrf" else 1.0
        return collapse(query_kind.apply(query, self.fuse(dense, lexical, doc), rows, self.kind * scale), rows)


Ranking = tuple[list[int], list[float]]  # chunk ids best first, and their scores


def dense_depth(snap: store.Snapshot, n: int) -> int:
    """How deep to read the dense list for `n` candidates. While vectors are still being embedded
    (sync.py: every file is in by its words first), the top `n` of the vectors there are would reach
    as deep as the top `n / coverage` of the whole index: what is missing from the dense list gets its
    lowest cosine (fusion.absolute_sum), so the few embedded definitions would outrank every other.
    Reading the top `n x coverage` instead keeps the list as deep as it will be when complete (the
    stdlib, 8% of vectors in: MRR@10 26.8 -> 33.2, BM25 alone 33.1; 85% in: 46.9 -> 47.0)."""
    try:
        waiting = int(snap.info.get("unembedded_vectors", "0"))
    except ValueError:
        waiting = 0
    have = snap.vectors.ntotal
    return n if waiting <= 0 or not have else max(1, math.ceil(n * have / (have + waiting)))


def collapse(fused: list[tuple[int, float]], rows: dict[int, store.ChunkRow]) -> list[tuple[int, float]]:
    """Keep the best-ranked chunk of each definition: slices of one long function (or the header and
    fields of one class) are one answer, not several results crowding out others."""
    seen: set = set()
    out = []
    for cid, score in fused:
        r = rows.get(cid)
        if r is None:
            continue
        key = (r.path, r.unit) if r.unit else cid
        if key not in seen:
            seen.add(key)
            out.append((cid, score))
    return out


def definitions_first(query: str, fused: list[tuple[int, float]],
                      rows: dict[int, store.ChunkRow]) -> list[tuple[int, float]]:
    """When the query is one name, the definitions of that name go first (in their fused order): the
    code that defines `letter` answers the query `letter` better than a test that calls it seven times,
    which both retrievers may rank above it. A qualified name (`Parser.feed`, `grades.letter`) matches a
    definition whose file path and symbol end in those parts; a declaring keyword may come first (`def
    letter`, `class Parser`). Any other query keeps the fused order."""
    m = _NAME_QUERY.fullmatch(query)
    if m is None:
        return fused
    want = _NAME_SEP.split(m[1])

    def defines(cid: int) -> bool:
        r = rows.get(cid)
        if r is None or not r.symbol:
            return False
        full = posixpath.splitext(r.path)[0].split("/") + _NAME_SEP.split(r.symbol)  # pkg/grades.py: letter
        return full[-len(want):] == want

    return sorted(fused, key=lambda cs: not defines(cs[0]))  # stable: ties keep the fused order


def per_definition(lists: list[Ranking], rows: dict[int, store.ChunkRow]) -> list[Ranking]:
    """The rankings with every definition under one id, so that fusion adds up what each list says
    about the same definition: the dense list holds a definition's first chunk, BM25 may rank a later
    slice of it, and fused as separate ids the two would not reinforce each other. A definition's id
    is the chunk the lexical list ranks best (it shows where the words are), else the first one met;
    each list keeps a definition's best score once. Chunks outside definitions stay as they are."""
    def key(cid: int):
        r = rows.get(cid)
        return (r.path, r.unit) if r is not None and r.unit else cid

    rep: dict = {}
    for ids, _ in (lists[1], lists[0], *lists[2:]) if len(lists) > 1 else lists:
        for cid in ids:
            rep.setdefault(key(cid), cid)
    out = []
    for ids, scores in lists:
        seen: set = set()
        kept_ids, kept_scores = [], []
        for cid, sc in zip(ids, scores, strict=True):
            k = key(cid)
            if k not in seen:
                seen.add(k)
                kept_ids.append(rep[k])
                kept_scores.append(sc)
        out.append((kept_ids, kept_scores))
    return out


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


class CodeIndex:
    def __init__(self, root: str | Path, *, model: str | None = None, embedder: Embedder | None = None,
                 index_dir: Path | None = None, max_file_bytes: int = MAX_FILE_BYTES,
                 weights: Weights | None = None):
        self.root = Path(os.path.realpath(root))
        if not self.root.is_dir():
            raise NotADirectoryError(f"not a folder: {root}")
        self.dir = index_dir or index_dir_for(self.root)
        self.model = model
        self._embedder = embedder
        self.max_file_bytes = max_file_bytes
        self._weights = weights  # None: the embedder's own (Weights.for_model)
        self._lock = threading.RLock()
        self._con = store.connect(self.dir)
        self._snap: store.Snapshot | None = None

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = load_embedder(self.model)
        return self._embedder

    @property
    def weights(self) -> Weights:
        """How the rankings are fused: as given, else what the embedder's model stores, else the defaults."""
        if self._weights is None:
            self._weights = Weights.for_model(self.embedder)
        return self._weights

    def close(self) -> None:
        self._con.close()

    def info(self) -> dict[str, str]:
        return store.read_info(self._con)

    def chunk_count(self) -> int:
        """Chunks in the committed index."""
        with self._lock:
            snap = self._current()
            return len(snap.lexical) if snap is not None else 0

    # -- loading -------------------------------------------------------------------------------------

    def _current(self) -> store.Snapshot | None:
        """The committed generation, loaded (again only if another writer committed since)."""
        self._snap = store.load(self._con, self.dir, self._snap)
        return self._snap

    def _rebuild_reason(self, snap: store.Snapshot | None, emb: Embedder) -> str | None:
        info = store.read_info(self._con)
        if not info:
            return "no index yet"
        if info.get("format") != store.FORMAT:
            return "index format changed"
        if info.get("model") != emb.name or info.get("dim") != str(emb.dim):
            return f"embedding model changed from {info.get('model')} to {emb.name}"
        if info.get("weights", "") != getattr(emb, "fingerprint", ""):
            return f"the weights of {emb.name} changed"
        if snap is None:
            return "index files missing or damaged"
        return None

    # -- sync ----------------------------------------------------------------------------------------

    def sync(self, *, rebuild: bool = False, progress: Progress | None = None, wait: bool = True,
             budget_s: float | None = None) -> SyncReport:
        """Bring the index up to date with the workspace.

        `wait=False` raises `store.IndexBusy` instead of waiting for another process that is writing.
        `budget_s` stops after the batch that crosses that many seconds; the report's `pending` counts
        the changed files left for the next sync (the index is consistent either way)."""
        t0 = time.monotonic()
        with self._lock, store.writer_lock(self.dir, wait=wait):
            emb = self.embedder
            snap = self._current()
            reason = "rebuild requested" if rebuild else self._rebuild_reason(snap, emb)
            syncer = Syncer(self._con, self.dir, self.root, emb, snap=snap, rebuild_reason=reason,
                            max_file_bytes=self.max_file_bytes, progress=progress, budget_s=budget_s)
            try:
                report, self._snap = syncer.run()
            except BaseException:
                self._snap = None  # in-memory structures may be half-updated: reload from disk
                raise
            report.seconds = time.monotonic() - t0
            return report

    # -- search --------------------------------------------------------------------------------------

    def candidates(self, queries: list[str], n: int = CANDIDATES, *, path: str | None = None,
                   ) -> list[tuple[Ranking, Ranking, Ranking]]:
        """For each query, the (ids, scores) of the dense retriever (cosines), of BM25 over code and
        of BM25 over doc prose (each as a fraction of the query's ceiling), best first, up to `n` each,
        restricted to a file or folder when `path` is given. Fused they are the search result; apart
        they are what evaluations compare."""
        import faiss

        with self._lock:
            snap = self._current()
            none: tuple[list[int], list[float]] = ([], [])
            if snap is None or len(snap.lexical) == 0 or not queries:
                return [(none, none, none) for _ in queries]
            emb = self.embedder
            if snap.info.get("model") != emb.name:
                raise ValueError(f"the index was built with {snap.info.get('model')}, not {emb.name}; "
                                 "sync (or rebuild) it first")
            if snap.info.get("weights", "") != getattr(emb, "fingerprint", ""):
                raise ValueError(f"the index was built with other weights of {emb.name}; sync (or rebuild) it first")
            allowed = None
            prefix = (path or "").strip().strip("/")
            if prefix and prefix != ".":
                ids = store.ids_under(self._con, prefix)
                if not ids:
                    return [(none, none, none) for _ in queries]
                allowed = np.asarray(ids, dtype=np.int64)
            qv = emb.encode(queries)
            selector = faiss.IDSelectorBatch(allowed) if allowed is not None else None
            params = faiss.SearchParameters(sel=selector) if selector is not None else None
            if snap.vectors.ntotal:
                dist, dense = snap.vectors.search(qv, min(dense_depth(snap, n), snap.vectors.ntotal), params=params)
            else:
                dist, dense = np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
            out = []
            for qi, q in enumerate(queries):
                keep = dense[qi] >= 0
                lex_ids, lex_scores = snap.lexical.search(q, n, allowed=allowed)
                doc_ids, doc_scores = snap.doclex.search(q, n, allowed=allowed)
                # BM25 as a fraction of what the query could score at most (fusion.absolute_sum)
                lex_scores = lex_scores / max(snap.lexical.ceiling(q), 1e-9)
                doc_scores = doc_scores / max(snap.doclex.ceiling(q), 1e-9)
                out.append(((dense[qi][keep].tolist(), dist[qi][keep].tolist()),
                            (lex_ids.tolist(), lex_scores.tolist()),
                            (doc_ids.tolist(), doc_scores.tolist())))
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
            (dense, lexical, doc), = self.candidates([query], max(k, CANDIDATES), path=path)
            rows = store.chunks_by_id(self._con, sorted({*dense[0], *lexical[0], *doc[0]}))
        dense, lexical, doc = per_definition([dense, lexical, doc], rows)
        fused = definitions_first(query, self.weights.rank(query, dense, lexical, doc, rows), rows)[:k]
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
