"""BM25 over chunks: identifier-aware terms, one sparse matrix, rows added and removed incrementally.

Terms: every identifier is lower-cased and kept whole (`parse_known_args`) and also split at
underscores and case changes (`parse`, `known`, `args`), so prose queries meet code names; then
Snowball-stemmed (PyStemmer), so "parses" meets `parse`. English function words and the most common
keywords are dropped on both sides: their IDF is near zero anyway and their posting lists are the
longest, so dropping them makes queries faster without changing ranks much. k1 and b are higher than
the textbook 1.2/0.75: on the development half of bench/search.py's stdlib queries, 1.6/0.9 gave
+2 MRR@10 (code chunks vary in length more than prose passages and long ones match by accident).

Storage: raw term counts per chunk (CSR, rows ordered by chunk id), the vocabulary and the BM25
weights computed from them (CSC: one slice per term), in one `.npz`. BM25 weights depend on
corpus-wide statistics, so they are recomputed from the counts whenever rows change; that is a few
vectorised passes over the non-zeros (tens of ms at 100 k chunks). Searching reads only the stored
weights with NumPy: a search from a fresh process does not import SciPy (a second of a cold start).
Removed terms stay in the vocabulary with zero document frequency until a rebuild.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

K1 = 1.6
B = 0.9
_IDENT = re.compile(r"[^\W\d]\w*|\d{2,}")  # identifiers in any script (`café`, `größe`), numbers
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
STOP = frozenset("""
a an the and or not of to in on at by for from with without into onto as is are was were be been being
it its this that these those there here if else elif then than so such can could should would may
might must will shall do does did done has have had having which who whom whose what when where why
how all any each both either neither no nor only own same too very just also but while about above
below after before again further once over under until up down out off we you they he she them our
your their his her me my i us self def return none true false var let const function new
""".split())


_local = threading.local()  # PyStemmer objects must not be shared between threads


def _stem(words: list[str]) -> list[str]:
    stemmer = getattr(_local, "stemmer", None)
    if stemmer is None:
        import Stemmer

        stemmer = _local.stemmer = Stemmer.Stemmer("english")
    return stemmer.stemWords(words)


def terms(text: str) -> list[str]:
    """The BM25 terms of a text, in order, repeats kept."""
    return _stem(words(text))


def words(text: str) -> list[str]:
    """Terms before stemming."""
    out: list[str] = []
    for m in _IDENT.finditer(text):
        word = m.group()
        pieces = _CAMEL.findall(word) if word.isascii() else word.split("_")
        parts = [p.lower() for p in pieces]
        whole = word.strip("_").lower()
        if len(parts) > 1 and whole not in STOP:
            out.append(whole)
        out.extend(p for p in parts if len(p) > 1 and p not in STOP)
    return out


class Lexical:
    """Term counts for chunks (rows, sorted by chunk id) and BM25 search over them."""

    def __init__(self, counts, ids: np.ndarray, vocab: list[str], weights: tuple | None = None):
        self._counts = counts  # scipy CSR, or (data, indices, indptr, shape) not yet made into one
        self.ids = ids
        self.vocab = vocab
        self._term_ids: dict[str, int] | None = None
        self._weights = weights  # BM25 weights as CSC arrays (data, indices, indptr); None: stale

    @property
    def term_ids(self) -> dict[str, int]:
        if self._term_ids is None:
            self._term_ids = {t: i for i, t in enumerate(self.vocab)}
        return self._term_ids

    @property
    def counts(self):
        import scipy.sparse as sp

        if isinstance(self._counts, tuple):
            data, indices, indptr, shape = self._counts
            self._counts = sp.csr_matrix((data, indices, indptr), shape=shape)
        return self._counts

    @counts.setter
    def counts(self, value) -> None:
        self._counts = value

    @classmethod
    def empty(cls) -> Lexical:
        import scipy.sparse as sp

        return cls(sp.csr_matrix((0, 0), dtype=np.float32), np.zeros(0, dtype=np.int64), [])

    def __len__(self) -> int:
        return len(self.ids)

    # -- updates -------------------------------------------------------------------------------------

    def add(self, ids: Sequence[int], texts: Sequence[str]) -> None:
        """Append chunks; their ids must all be larger than any already present."""
        import scipy.sparse as sp

        if not len(ids):
            return
        ids_arr = np.asarray(ids, dtype=np.int64)
        if len(self.ids) and ids_arr.min() <= self.ids[-1] or np.any(np.diff(ids_arr) <= 0):
            raise ValueError("lexical rows must be added in increasing id order")
        rows, cols, vals = [], [], []
        for r, text in enumerate(texts):
            for term, n in Counter(terms(text)).items():
                j = self.term_ids.get(term)
                if j is None:
                    j = self.term_ids[term] = len(self.vocab)
                    self.vocab.append(term)
                rows.append(r)
                cols.append(j)
                vals.append(n)
        width = len(self.vocab)
        new = sp.csr_matrix((np.asarray(vals, dtype=np.float32), (rows, cols)), shape=(len(texts), width))
        old = self.counts
        old.resize((old.shape[0], width))
        self.counts = sp.vstack([old, new], format="csr")
        self.ids = np.concatenate([self.ids, ids_arr])
        self._weights = None

    def remove(self, ids: Iterable[int]) -> None:
        gone = np.fromiter(ids, dtype=np.int64)
        if not len(gone):
            return
        keep = ~np.isin(self.ids, gone)
        self.counts = self.counts[keep]
        self.ids = self.ids[keep]
        self._weights = None

    # -- search --------------------------------------------------------------------------------------

    def _prepare(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """BM25 weights, CSC arrays: term j's rows and weights are [indptr[j]:indptr[j + 1]]."""
        if self._weights is None:
            import scipy.sparse as sp

            c = self.counts.tocsr()
            n_docs = c.shape[0]
            dl = np.asarray(c.sum(axis=1)).ravel()
            avgdl = float(dl.mean()) if n_docs else 1.0
            df = np.bincount(c.indices, minlength=c.shape[1]).astype(np.float32)
            idf = np.log1p((n_docs - df + 0.5) / (df + 0.5)).astype(np.float32)
            # Per non-zero: idf[t] * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)).
            row_of = np.repeat(np.arange(n_docs), np.diff(c.indptr))
            tf = c.data
            norm = K1 * (1 - B + B * dl[row_of] / max(avgdl, 1e-9))
            data = idf[c.indices] * tf * (K1 + 1) / (tf + norm)
            w = sp.csr_matrix((data.astype(np.float32), c.indices, c.indptr), shape=c.shape).tocsc()
            w.sort_indices()
            self._weights = (w.data.astype(np.float32), w.indices.astype(np.int32), w.indptr.astype(np.int64))
        return self._weights

    def search(self, query: str, n: int, *, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top `n` (chunk ids, scores), best first; `allowed` restricts to those chunk ids."""
        q = Counter(t for t in terms(query) if t in self.term_ids)
        if not q or not len(self.ids):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        data, rows, indptr = self._prepare()
        scores = np.zeros(len(self.ids), dtype=np.float32)
        for t, qtf in q.items():
            j = self.term_ids[t]
            a, b = indptr[j], indptr[j + 1]
            # rows are unique within a term's slice, so fancy-index += is exact
            scores[rows[a:b]] += qtf * data[a:b]
        if allowed is not None:
            mask = np.isin(self.ids, allowed)
            scores = np.where(mask, scores, 0.0)
        hit = np.flatnonzero(scores > 0)
        if len(hit) > n:
            hit = hit[np.argpartition(-scores[hit], n - 1)[:n]]
        hit = hit[np.argsort(-scores[hit], kind="stable")]
        return self.ids[hit], scores[hit]

    def ceiling(self, query: str) -> float:
        """The most any chunk could score for `query`: each of its terms at the largest weight that
        term has in the index. A ranking's scores divided by it say how much of the query the best
        chunks match, comparably across queries (max-normalising says nothing of that)."""
        q = Counter(t for t in terms(query) if t in self.term_ids)
        if not q or not len(self.ids):
            return 0.0
        data, _, indptr = self._prepare()
        total = 0.0
        for t, qtf in q.items():
            j = self.term_ids[t]
            if indptr[j + 1] > indptr[j]:
                total += qtf * float(data[indptr[j]:indptr[j + 1]].max())
        return total

    # -- persistence ---------------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        c = self.counts.tocsr()
        wd, wi, wp = self._prepare()
        vocab = "\n".join(self.vocab).encode("utf-8")
        with open(path, "wb") as f:
            np.savez(f, data=c.data.astype(np.float32), indices=c.indices.astype(np.int32),
                     indptr=c.indptr.astype(np.int64), shape=np.asarray(c.shape, dtype=np.int64),
                     ids=self.ids, vocab=np.frombuffer(vocab, dtype=np.uint8),
                     w_data=wd, w_indices=wi, w_indptr=wp)

    @classmethod
    def load(cls, path: Path) -> Lexical:
        with np.load(path, allow_pickle=False) as z:
            shape = tuple(int(x) for x in z["shape"])
            counts = (z["data"], z["indices"], z["indptr"], shape)
            vocab_bytes = z["vocab"].tobytes()
            vocab = vocab_bytes.decode("utf-8").split("\n") if vocab_bytes else []
            weights = (z["w_data"], z["w_indices"], z["w_indptr"]) if "w_data" in z.files else None
            return cls(counts, z["ids"].astype(np.int64), vocab, weights)
