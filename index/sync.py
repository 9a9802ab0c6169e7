"""Incremental sync: bring the index in line with the workspace, committing in batches.

Scan: files whose size and mtime match what the index recorded are skipped without being read; the
rest are hashed, and only those whose content hash changed are chunked again. Deleted files lose their
chunks. Within a changed file, chunks whose embedded text is unchanged keep their vectors (most edits
touch one function), so only new text is embedded.

Batches: changed files are embedded and committed in batches of about `BATCH_CHUNKS` chunks, each
batch its own generation (store.py), so a long build that is killed keeps what it had finished, and
the next sync simply continues: files not yet committed still look changed. With a time budget, sync
stops after the batch that crosses it and reports how many files are still pending (the agent's tool
uses this so that a first search in a large repository answers within a minute).

A full rebuild (new model, new format, or asked for) starts from empty structures; its first batch
commit replaces the whole old index.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from index import store
from index.chunker import Chunk, chunk_file
from index.embed import Embedder
from index.files import decode, list_files, noise_reason
from index.languages import language_for, parser_for
from index.lexical import Lexical

# Chunks embedded per committed batch: ~1 min of embedding on 2 CPU cores; each commit rewrites the
# vector and BM25 files, which costs well under a second at this size.
BATCH_CHUNKS = 2048
# Tokens kept free in each chunk for the symbol part of the header.
SYMBOL_RESERVE = 16
# Files modified this recently are re-hashed next time even if size and mtime match: a write in the
# same mtime tick as our stat would otherwise go unnoticed (the "racy git" problem).
RACY_NS = 2_000_000_000

Progress = Callable[[str, int, int], None]  # (stage, done, total); stages: "scan", "embed"


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
    pending: int = 0  # changed files left for the next sync (time budget reached)
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
        more = "1 more file is" if self.pending == 1 else f"{self.pending} more files are"
        tail = f"; {more} indexed on the next searches, results cover the rest" if self.pending else ""
        return f"{head} in {self.seconds:.1f}s{tail}"


@dataclass
class _Change:
    row: store.FileRow
    kind: str  # "added" or "modified"
    text: str | None = None  # None: nothing to chunk (skipped, or not text)
    chunks: list[Chunk] = field(default_factory=list)


# A definition's vector reads its first max_tokens word pieces; joining more of a long one's slices
# than this many characters would only feed the tokenizer text it cuts off.
DENSE_MAX_CHARS = 4096


_NAME_PART = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


def _words(name: str) -> str:
    """An identifier split at underscores and case changes, lower-cased."""
    return " ".join(_NAME_PART.findall(name)).lower()


def name_words(symbol: str) -> str:
    """The innermost name of a dotted symbol as words."""
    return _words(symbol.rsplit(".", 1)[-1])


def context_words(symbol: str, path: str) -> str:
    """Where a definition lives, as words: the names of the definitions around it
    (`ScheduledThreadPoolExecutor.DelayedWorkQueue.take` -> "scheduled thread pool executor delayed
    work queue"), or for a top-level definition its file's stem (`json/decoder.py` -> "decoder")."""
    outer = " ".join(w for w in map(_words, symbol.split(".")[:-1]) if w)
    return outer or _words(path.rsplit("/", 1)[-1].split(".", 1)[0])


def dense_texts(chunks: list[Chunk], *, parsed: bool = True, path: str = "") -> list[str | None]:
    """What the embedder sees for each chunk of one file; None for a chunk that gets no vector.

    One vector per definition, on its first chunk: the definition's own name as words
    (`Compat32.header_fetch_parse` -> "header fetch parse"), a line of where it lives (`context_words`:
    "compat32"; format 6), then its whole code without its doc, which the model reads up to its limit,
    as a whole-function embedding does; no path, dotted symbol or enclosing signatures (the name as
    words: +2.2 MRR@10 on the development half, where the `path | symbol` header cost 4.4; the
    context line: +7 on the JDK set's, +3.4 on the Python stdlib set's dense list). The later slices
    of a long definition and, in a file that has definitions, the code between them (imports,
    constants, top-level statements) get no vector: BM25 still finds them. Each of the three was measured to cost the dense list on the
    bench's development half (`python bench/search.py ablate`): the header 4.4 MRR@10 points, the
    code between definitions 5.5, slices competing with their own definition's head 2 to 3. That
    holds for code outside definitions in files that have none, too (re-export lists, generated
    tables, a comment on a constant: 1.5 points); only files the chunker has no grammar for (prose,
    configuration: `parsed=False`) keep a vector for every chunk. The limit: top-level code of a
    script is found by words (BM25 and the doc field), not by meaning."""
    out: list[str | None] = []
    first: dict[tuple[int, int], int] = {}
    for i, c in enumerate(chunks):
        if c.unit is None:
            out.append(None if parsed else c.code)
        elif c.unit not in first:
            first[c.unit] = i
            name = name_words(c.symbol)
            head = "\n".join(x for x in (name, context_words(c.symbol, path)) if x)
            out.append(f"{head}\n{c.code}" if head and c.code.strip() else c.code)
        else:
            j = first[c.unit]
            if len(out[j] or "") < DENSE_MAX_CHARS:
                out[j] = f"{out[j]}\n{c.code}"
            out.append(None)
    return [t[:DENSE_MAX_CHARS] if t and t.strip() else None for t in out]


def lexical_text(path: str, symbol: str, code: str, context: str = "") -> str:
    """What BM25 sees: the path and symbol, the signatures of the definitions around the chunk, the
    code without its doc, and the symbol once more, a poor man's BM25F field weight (a definition's
    name says more than any word in its body: +1.3 MRR@10 on the bench's development half)."""
    head = f"{path} | {symbol}" if symbol else path
    text = f"{head}\n{context}\n{code}" if context else f"{head}\n{code}"
    return f"{symbol}\n{text}" if symbol else text


def unit_key(c: Chunk) -> str:
    return f"{c.unit[0]}-{c.unit[1]}" if c.unit is not None else ""


def content_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def chunk_for(rel: str, text: str, emb: Embedder) -> list[Chunk]:
    path_tokens = emb.count_tokens([rel])[0]
    # Chunks are what BM25 indexes and a search shows; their size is still that of the model's window
    # less [CLS], [SEP] and a path-and-symbol header (what format 3 embedded), which measured well for
    # BM25. The vectors (dense_texts) read whole definitions instead.
    budget = max(64, emb.max_tokens - 2 - path_tokens - SYMBOL_RESERVE)
    return chunk_file(rel, text, budget=budget, count_tokens=emb.count_tokens)


class Syncer:
    """One sync of one index; `run()` returns the report and the snapshot now committed."""

    def __init__(self, con: sqlite3.Connection, index_dir: Path, root: Path, emb: Embedder, *,
                 snap: store.Snapshot | None, rebuild_reason: str | None, max_file_bytes: int,
                 progress: Progress | None = None, budget_s: float | None = None):
        self.con, self.dir, self.root, self.emb = con, index_dir, root, emb
        self.snap = snap if rebuild_reason is None else None
        self.full = rebuild_reason is not None
        self.max_file_bytes = max_file_bytes
        self.progress = progress or (lambda stage, done, total: None)
        self.budget_s = budget_s
        self.report = SyncReport(rebuilt=rebuild_reason)

    def run(self) -> tuple[SyncReport, store.Snapshot | None]:
        t0 = time.monotonic()
        stored = {} if self.full else store.read_files(self.con)
        changes, stat_only, deleted = self._scan(stored)
        for ch in changes:
            if ch.text is not None:
                ch.chunks = chunk_for(ch.row.path, ch.text, self.emb)
                ch.text = None  # the chunks hold what is needed; let the file text go
        batches = _batches(changes)
        total = sum(len(ch.chunks) for ch in changes)
        done = 0
        self.progress("embed", 0, total)
        for i, batch in enumerate(batches):
            first = i == 0
            self._commit_batch(batch, deleted if first else [], stat_only if first else [], first, done,
                               total)
            done += sum(len(ch.chunks) for ch in batch)
            if self.budget_s is not None and time.monotonic() - t0 > self.budget_s and i + 1 < len(batches):
                self.report.pending = sum(len(b) for b in batches[i + 1:])
                break
        if not batches and (deleted or stat_only):
            self._commit_batch([], deleted, stat_only, True, 0, 0)
        if self.full and not batches and not deleted:
            self._commit_batch([], [], stat_only, True, 0, 0)  # an empty workspace: an empty index
        self.report.chunks = len(self.snap.lexical) if self.snap is not None else 0
        self.report.indexed_files = self.con.execute(
            "SELECT COUNT(*) FROM files WHERE n_chunks > 0").fetchone()[0]
        return self.report, self.snap

    # -- scan ----------------------------------------------------------------------------------------

    def _scan(self, stored: dict[str, store.FileRow]):
        listed = list_files(self.root)
        self.report.files = len(listed)
        changes: list[_Change] = []
        stat_only: list[store.FileRow] = []
        now = time.time_ns()
        for i, rel in enumerate(listed):
            if i % 200 == 0:
                self.progress("scan", i, len(listed))
            old = stored.get(rel)
            result = self._scan_one(rel, old, now)
            if result is None:
                continue
            row, text = result
            if row.hash == "=":  # same content: at most new size/mtime to record
                if (row.size, row.mtime_ns) != (old.size, old.mtime_ns):
                    stat_only.append(store.FileRow(rel, row.size, row.mtime_ns, old.hash, old.status,
                                                   old.n_chunks))
                continue
            changes.append(_Change(row, "modified" if old is not None else "added", text))
        self.progress("scan", len(listed), len(listed))
        listed_set = set(listed)
        deleted = sorted(p for p in stored if p not in listed_set)
        return changes, stat_only, deleted

    def _scan_one(self, rel: str, old: store.FileRow | None, now: int
                  ) -> tuple[store.FileRow, str | None] | None:
        """None if the file vanished; a row with hash "=" if its content is unchanged; else its new
        row and, when it is to be chunked, its text."""
        path = self.root / rel
        try:
            st = path.stat()
        except OSError:
            return None
        mtime = 0 if now - st.st_mtime_ns < RACY_NS else st.st_mtime_ns
        if old is not None and old.mtime_ns and (old.size, old.mtime_ns) == (st.st_size, st.st_mtime_ns):
            return store.FileRow(rel, st.st_size, st.st_mtime_ns, "=", old.status), None
        reason = noise_reason(rel)
        if reason is None and st.st_size > self.max_file_bytes:
            reason = "too large"
        if reason is not None:
            return store.FileRow(rel, st.st_size, mtime, "=" if old and old.status == reason else "",
                                 reason), None
        try:
            data = path.read_bytes()
        except OSError as e:
            return store.FileRow(rel, st.st_size, 0, "", f"unreadable: {e.strerror or e}"), None
        h = content_hash(data)
        if old is not None and old.hash == h:
            return store.FileRow(rel, st.st_size, mtime, "=", old.status), None
        ft = decode(data, max_bytes=self.max_file_bytes)
        if ft.text is None:
            return store.FileRow(rel, st.st_size, mtime, h, ft.skip_reason or "skipped"), None
        return store.FileRow(rel, st.st_size, mtime, h, "indexed"), ft.text

    # -- one batch -----------------------------------------------------------------------------------

    def _commit_batch(self, batch: list[_Change], deleted: list[str], stat_only: list[store.FileRow],
                      first: bool, done_before: int, total: int) -> None:
        import faiss

        full_commit = self.full and first
        info = store.read_info(self.con)
        next_id = int(info.get("next_id", "1"))
        modified = [ch.row.path for ch in batch if ch.kind == "modified"]
        # Old chunks of modified files: vectors reusable where the embedded text is unchanged.
        old = store.chunk_hashes(self.con, modified + deleted) if not self.full else {}
        reusable = {h: cid for p in modified for cid, h in old.get(p, [])}
        gone_ids = [cid for chunks in old.values() for cid, _ in chunks]

        rows: list[store.ChunkRow] = []
        files: list[store.FileRow] = []
        embed_texts: list[str | None] = []
        lex_texts: list[str] = []
        doc_texts: list[str] = []
        to_embed: list[int] = []
        reuse_from: list[tuple[int, int]] = []
        for ch in batch:
            r = ch.row
            if r.status == "indexed":
                r = store.FileRow(r.path, r.size, r.mtime_ns, r.hash,
                                  "indexed" if ch.chunks else "empty", len(ch.chunks))
            else:
                self.report.skipped[r.status] = self.report.skipped.get(r.status, 0) + 1
            files.append(r)
            getattr(self.report, ch.kind).append(r.path)
            lang = language_for(r.path) or "text"
            parsed = lang != "text" and parser_for(lang) is not None
            for c, dtext in zip(ch.chunks, dense_texts(ch.chunks, parsed=parsed, path=r.path), strict=True):
                ltext = lexical_text(r.path, c.symbol, c.code, c.context)
                # The hash names the vector's text; a chunk without one never matches a chunk with one.
                th = content_hash((dtext if dtext is not None else "\0" + ltext).encode(
                    "utf-8", errors="surrogatepass"))
                rows.append(store.ChunkRow(next_id, r.path, c.start_line, c.end_line, c.symbol, lang, th,
                                           c.text, unit_key(c)))
                next_id += 1
                if dtext is None:
                    pass
                elif th in reusable:
                    reuse_from.append((len(rows) - 1, reusable.pop(th)))
                else:
                    to_embed.append(len(rows) - 1)
                embed_texts.append(dtext)
                lex_texts.append(ltext)
                doc_texts.append(c.doc)
        self.report.deleted.extend(deleted)

        if not full_commit and not rows and not gone_ids:
            # Only skipped files came or went, or only mtimes moved: metadata, same generation.
            if files or deleted:
                store.commit(self.con, gen=self.snap.gen, info={}, full=False, removed_paths=deleted,
                             files=files + stat_only, chunks=[])
            elif stat_only:
                store.update_stats(self.con, stat_only)
            return

        vecs = np.zeros((len(rows), self.emb.dim), dtype=np.float32)
        dense = sorted([i for i, _ in reuse_from] + to_embed)  # the rows that have a vector
        if to_embed:
            count = done_before

            def on_batch(n: int) -> None:
                nonlocal count
                count += n
                self.progress("embed", count, total)

            vecs[to_embed] = self.emb.encode([embed_texts[i] for i in to_embed], on_batch=on_batch)
        for pos, old_id in reuse_from:
            vecs[pos] = self.snap.vectors.reconstruct(old_id)
        self.report.embedded += len(to_embed)
        self.report.reused += len(reuse_from)

        if full_commit:
            vectors = faiss.IndexIDMap2(faiss.IndexFlatIP(self.emb.dim))
            lexical, doclex = Lexical.empty(), Lexical.empty()
        else:
            vectors, lexical, doclex = self.snap.vectors, self.snap.lexical, self.snap.doclex
            if gone_ids:
                vectors.remove_ids(faiss.IDSelectorBatch(np.asarray(gone_ids, dtype=np.int64)))
                lexical.remove(gone_ids)
                doclex.remove(gone_ids)
        if rows:
            ids = np.asarray([r.id for r in rows], dtype=np.int64)
            vectors.add_with_ids(vecs[dense], ids[dense])
            lexical.add(ids, lex_texts)
            doclex.add(ids, doc_texts)

        gen = int(info.get("gen", "0")) + 1
        store.write_atomic(store.vectors_path(self.dir, gen), lambda p: faiss.write_index(vectors, str(p)))
        store.write_atomic(store.lexical_path(self.dir, gen), lexical.save)
        store.write_atomic(store.doclex_path(self.dir, gen), doclex.save)
        new_info = {"format": store.FORMAT, "model": self.emb.name, "dim": str(self.emb.dim),
                    "weights": getattr(self.emb, "fingerprint", ""), "next_id": str(next_id)}
        if full_commit:
            new_info["built_at"] = str(time.time())
        store.commit(self.con, gen=gen, info=new_info, full=full_commit, removed_paths=modified + deleted,
                     files=files + stat_only, chunks=rows)
        self.snap = store.Snapshot(gen, store.read_info(self.con), vectors, lexical, doclex)
        store.remove_stale(self.dir, gen)


def _batches(changes: list[_Change]) -> list[list[_Change]]:
    """Consecutive files, about BATCH_CHUNKS chunks per batch (a file is never split)."""
    out: list[list[_Change]] = []
    cur: list[_Change] = []
    n = 0
    for ch in changes:
        if cur and n + len(ch.chunks) > BATCH_CHUNKS:
            out.append(cur)
            cur, n = [], 0
        cur.append(ch)
        n += len(ch.chunks)
    if cur:
        out.append(cur)
    return out
