"""Incremental sync: bring the index in line with the workspace, words first, vectors after.

Scan: files whose size and mtime match what the index recorded are skipped without being read; the
rest are hashed, and only those whose content hash changed are chunked again. Deleted files lose their
chunks. Within a changed file, chunks whose embedded text is unchanged keep their vectors (most edits
touch one function), so only new text is embedded.

Two phases. First every change is committed at once: the chunk rows and the BM25 rows of every changed
file, the vectors kept from before, the deleted files gone. Chunking and BM25 are cheap (the Python
standard library, 29,000 chunks: ~15 s), embedding is not (minutes on 2 cores), so from then on a
search finds every file by its words. Then the new vectors are embedded and committed in batches of
about `BATCH_CHUNKS`, each batch its own generation (store.py). Which files still wait for vectors,
and how many vectors, is recorded with each commit (`info["unembedded"]`, `"unembedded_vectors"`: a
search reads the dense list only as deep as it will be when complete, `code_index.dense_depth`), so a
build that is killed, or stopped by a time budget, keeps what it finished and the next sync embeds the
rest, chunking those files again (unchanged, they chunk the same) rather than storing what their
vectors read. With a time budget, a small first batch always runs (every sync makes progress) and
measures the pace, each next batch is sized to the time left, and the report says how many files wait
for vectors: the agent's tool uses this so that a first search in a large repository answers within a
minute, over every file.

A full rebuild (new model, new format, or asked for) starts from empty structures; its first commit
replaces the whole old index.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from index import store
from index.chunker import Chunk, chunk_file
from index.embed import Embedder
from index.files import decode, list_files, noise_reason
from index.languages import language_for, parser_for
from index.lexical import Lexical

# Vectors embedded per committed batch: 15-40 s of embedding on 2 CPU cores; each commit rewrites the
# vector file (the BM25 files are linked from the last generation), well under a second at this size.
BATCH_CHUNKS = 2048
# With a time budget: the first batch (it always runs, and measures the pace), and the fewest vectors
# worth a batch (fewer are left for the next sync).
FIRST_BATCH = 256
MIN_BATCH = 128
# Tokens kept free in each chunk for the symbol part of the header.
SYMBOL_RESERVE = 16
# Files modified this recently are re-hashed next time even if size and mtime match: a write in the
# same mtime tick as our stat would otherwise go unnoticed (the "racy git" problem).
RACY_NS = 2_000_000_000

Progress = Callable[[str, int, int], None]  # (stage, done, total); stages: "scan", "chunk", "embed"


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
    pending: int = 0  # files whose vectors are left for the next sync (time budget reached)
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
        elif self.embedded:
            head = f"embedded {self.embedded} more definitions; {self.chunks} chunks"
        elif self.pending:
            head = f"{self.indexed_files} files, {self.chunks} chunks"
        else:
            return f"index up to date: {self.indexed_files} files, {self.chunks} chunks"
        return f"{head} in {self.seconds:.1f}s{self._pending_note()}"

    def _pending_note(self) -> str:
        if not self.pending:
            return ""
        files = "1 file" if self.pending == 1 else f"{self.pending} files"
        return (f"; the vectors of {files} follow on the next searches (until then those files are found "
                "by their words only)")


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
        for i, ch in enumerate(changes):
            if i % 50 == 0:
                self.progress("chunk", i, len(changes))
            if ch.text is not None:
                ch.chunks = chunk_for(ch.row.path, ch.text, self.emb)
                ch.text = None  # the chunks hold what is needed; let the file text go
        if changes:
            self.progress("chunk", len(changes), len(changes))
        touched = {ch.row.path for ch in changes} | set(deleted)
        # Files an earlier sync left without their vectors, unchanged since (a changed one is re-chunked
        # above and its new rows wait for vectors anyway).
        left = [] if self.full else [p for p in _unembedded(store.read_info(self.con))
                                     if p in stored and p not in touched]
        # Left files are untouched by this sync's commits, so which of their chunks have vectors is
        # read once.
        have = _vector_ids(self.snap.vectors) if left else set()
        wanted = self._estimate(left, have)
        todo = self._commit_rows(changes, deleted, stat_only, left, wanted)
        self._embed(todo, left, have, len(todo) + wanted, t0)
        self.report.chunks = len(self.snap.lexical) if self.snap is not None else 0
        self.report.indexed_files = self.con.execute(
            "SELECT COUNT(*) FROM files WHERE n_chunks > 0").fetchone()[0]
        return self.report, self.snap

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

    # -- phase 1: every change's rows and BM25 rows, in one generation --------------------------------

    def _commit_rows(self, changes: list[_Change], deleted: list[str], stat_only: list[store.FileRow],
                     left: list[str], left_vectors: int) -> list[_Todo]:
        """Commit the changed files' chunks (with the vectors kept from before; no embedding) and the
        deletions; returns the chunks still to embed. `left`: files an earlier sync left waiting for
        `left_vectors` vectors, recorded as still waiting."""
        import faiss

        full_commit = self.full
        info = store.read_info(self.con)
        next_id = int(info.get("next_id", "1"))
        modified = [ch.row.path for ch in changes if ch.kind == "modified"]
        # Old chunks of modified files: vectors reusable where the embedded text is unchanged.
        old = store.chunk_hashes(self.con, modified + deleted) if not self.full else {}
        have = _vector_ids(self.snap.vectors) if old else set()
        reusable = {h: cid for p in modified for cid, h in old.get(p, []) if cid in have}
        gone_ids = [cid for chunks in old.values() for cid, _ in chunks]

        rows: list[store.ChunkRow] = []
        files: list[store.FileRow] = []
        lex_texts: list[str] = []
        doc_texts: list[str] = []
        todo: list[_Todo] = []
        reuse_from: list[tuple[int, int]] = []  # (row position, old chunk id)
        for ch in changes:
            r = ch.row
            if r.status == "indexed":
                r = store.FileRow(r.path, r.size, r.mtime_ns, r.hash,
                                  "indexed" if ch.chunks else "empty", len(ch.chunks))
            else:
                self.report.skipped[r.status] = self.report.skipped.get(r.status, 0) + 1
            files.append(r)
            getattr(self.report, ch.kind).append(r.path)
            lang = language_for(r.path) or "text"
            for c, dtext, ltext, th in _texts(r.path, lang, ch.chunks):
                rows.append(store.ChunkRow(next_id, r.path, c.start_line, c.end_line, c.symbol, lang, th,
                                           c.text, unit_key(c)))
                if dtext is None:
                    pass
                elif th in reusable:
                    reuse_from.append((len(rows) - 1, reusable.pop(th)))
                else:
                    todo.append(_Todo(next_id, r.path, dtext))
                next_id += 1
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
            return todo

        kept = [self.snap.vectors.reconstruct(old_id) for _, old_id in reuse_from]  # before any removal
        if full_commit:
            vectors = faiss.IndexIDMap2(faiss.IndexFlatIP(self.emb.dim))
            lexical, doclex = Lexical.empty(), Lexical.empty()
        else:
            vectors, lexical, doclex = self.snap.vectors, self.snap.lexical, self.snap.doclex
            if gone_ids:
                vectors.remove_ids(faiss.IDSelectorBatch(np.asarray(gone_ids, dtype=np.int64)))
                lexical.remove(gone_ids)
                doclex.remove(gone_ids)
        if reuse_from:
            vectors.add_with_ids(np.stack(kept), np.asarray([rows[pos].id for pos, _ in reuse_from], dtype=np.int64))
            self.report.reused += len(reuse_from)
        if rows:
            ids = np.asarray([r.id for r in rows], dtype=np.int64)
            lexical.add(ids, lex_texts)
            doclex.add(ids, doc_texts)

        gen = int(info.get("gen", "0")) + 1
        store.write_atomic(store.vectors_path(self.dir, gen), lambda p: faiss.write_index(vectors, str(p)))
        store.write_atomic(store.lexical_path(self.dir, gen), lexical.save)
        store.write_atomic(store.doclex_path(self.dir, gen), doclex.save)
        new_info = {"format": store.FORMAT, "model": self.emb.name, "dim": str(self.emb.dim),
                    "weights": getattr(self.emb, "fingerprint", ""), "next_id": str(next_id),
                    "unembedded": _paths_json([*left, *(t.path for t in todo)]),
                    "unembedded_vectors": str(len(todo) + left_vectors)}
        if full_commit:
            new_info["built_at"] = str(time.time())
        store.commit(self.con, gen=gen, info=new_info, full=full_commit, removed_paths=modified + deleted,
                     files=files + stat_only, chunks=rows)
        self.snap = store.Snapshot(gen, store.read_info(self.con), vectors, lexical, doclex)
        store.remove_stale(self.dir, gen)
        return todo

    # -- phase 2: vectors, in batches -----------------------------------------------------------------

    def _embed(self, todo: list[_Todo], left: list[str], have: set[int], total: int, t0: float) -> None:
        """Embed `todo`, then the chunks of `left` that lack vectors (`have`: the ids that have one), a
        batch a generation, until done or the budget is spent; `total`: about how many that is."""
        if not todo and not left:
            return
        done = 0
        self.progress("embed", 0, total)
        queue, later = list(todo), list(left)
        stale: list[str] = []  # left files that no longer chunk as their rows say
        # With a budget, a small first batch measures the pace; each next one is sized to the time left.
        size = BATCH_CHUNKS if self.budget_s is None else min(BATCH_CHUNKS, FIRST_BATCH)
        while queue or later:
            started = time.monotonic()
            while len(queue) < size and later:
                path = later.pop(0)
                found = self._todo_of(path, have)
                if found is None:
                    stale.append(path)
                else:
                    queue.extend(found)
            batch, queue = queue[:size], queue[size:]  # empty: only the list of waiting files changes
            count = done

            def on_batch(n: int) -> None:
                nonlocal count
                count += n
                self.progress("embed", count, max(total, count))

            vecs = self.emb.encode([t.text for t in batch], on_batch=on_batch) if batch else None
            done += len(batch)
            waiting = {"unembedded": _paths_json([*(t.path for t in queue), *later]),
                       "unembedded_vectors": str(0 if not (queue or later) else max(total - done, len(queue)))}
            self._commit_vectors(batch, vecs, waiting, stale)
            stale = []
            if self.budget_s is not None:
                # The next batch is as large as the time left allows at this batch's pace; none if that is
                # only a sliver.
                now = time.monotonic()
                size = min(BATCH_CHUNKS, int(len(batch) * (self.budget_s - (now - t0)) / max(now - started, 1e-3)))
                if size < min(MIN_BATCH, BATCH_CHUNKS):
                    break
        self.report.pending = len({t.path for t in queue} | set(later))

    def _commit_vectors(self, batch: list[_Todo], vecs, waiting: dict[str, str], stale: list[str]) -> None:
        """A generation with `batch`'s vectors added: the vector file anew, the BM25 files linked."""
        import faiss

        vectors = self.snap.vectors
        if batch:
            vectors.add_with_ids(np.asarray(vecs, dtype=np.float32),
                                 np.asarray([t.id for t in batch], dtype=np.int64))
            self.report.embedded += len(batch)
        old_gen = self.snap.gen
        gen = old_gen + 1  # the writer lock is held: the snapshot is the committed generation
        store.write_atomic(store.vectors_path(self.dir, gen), lambda p: faiss.write_index(vectors, str(p)))
        for path_of in (store.lexical_path, store.doclex_path):
            store.write_atomic(path_of(self.dir, gen), lambda p, src=path_of(self.dir, old_gen): _link(src, p))
        # A stale file is looked at afresh by the next scan: no mtime and no hash recorded.
        files = [replace(f, mtime_ns=0, hash="") for f in store.read_files(self.con).values()
                 if f.path in stale] if stale else []
        store.commit(self.con, gen=gen, info=waiting, full=False, removed_paths=[],
                     files=files, chunks=[])
        self.snap = store.Snapshot(gen, store.read_info(self.con), vectors, self.snap.lexical, self.snap.doclex)
        store.remove_stale(self.dir, gen)

    def _todo_of(self, path: str, have: set[int]) -> list[_Todo] | None:
        """The chunks of a file committed earlier that still lack vectors, with the texts to embed:
        the file chunked again, its rows matched by their text hashes. None when the file is gone or
        no longer chunks as its rows say."""
        rows = self.con.execute("SELECT id, text_hash, lang FROM chunks WHERE path = ? ORDER BY id",
                                (path,)).fetchall()
        try:
            ft = decode((self.root / path).read_bytes(), max_bytes=self.max_file_bytes)
        except OSError:
            return None
        if ft.text is None or not rows:
            return None
        texts = _texts(path, rows[0][2], chunk_for(path, ft.text, self.emb))
        if len(texts) != len(rows) or any(th != r[1] for (_, _, _, th), r in zip(texts, rows, strict=True)):
            return None
        return [_Todo(r[0], path, dtext) for (_, dtext, _, _), r in zip(texts, rows, strict=True)
                if dtext is not None and r[0] not in have]

    def _estimate(self, paths: list[str], have: set[int]) -> int:
        """About how many chunks of `paths` wait for vectors (for progress, and `unembedded_vectors`):
        their definitions' first chunks, and every chunk of a file without a grammar, less those with
        vectors. Read from the stored rows, without chunking the files again."""
        n = 0
        for path in paths:
            seen = set()
            for cid, unit, lang in self.con.execute("SELECT id, unit, lang FROM chunks WHERE path = ? ORDER BY id",
                                                    (path,)):
                first = unit and unit not in seen
                seen.add(unit)
                n += (first or lang == "text") and cid not in have
        return n


@dataclass
class _Todo:
    id: int  # chunk id
    path: str
    text: str  # what its vector reads (dense_texts)


def _texts(path: str, lang: str, chunks: list[Chunk]) -> list[tuple[Chunk, str | None, str, str]]:
    """Each chunk with its dense text (None: no vector), its BM25 text and the hash that names them."""
    parsed = lang != "text" and parser_for(lang) is not None
    out = []
    for c, dtext in zip(chunks, dense_texts(chunks, parsed=parsed, path=path), strict=True):
        ltext = lexical_text(path, c.symbol, c.code, c.context)
        # The hash names the vector's text; a chunk without one never matches a chunk with one.
        th = content_hash((dtext if dtext is not None else "\0" + ltext).encode("utf-8", errors="surrogatepass"))
        out.append((c, dtext, ltext, th))
    return out


def _vector_ids(vectors) -> set[int]:
    import faiss

    return set(faiss.vector_to_array(vectors.id_map).tolist())


def _unembedded(info: dict[str, str]) -> list[str]:
    try:
        paths = json.loads(info.get("unembedded", "[]"))
    except ValueError:
        return []
    return [p for p in paths if isinstance(p, str)] if isinstance(paths, list) else []


def _paths_json(paths) -> str:
    return json.dumps(list(dict.fromkeys(paths)))


def _link(src: Path, dst: Path) -> None:
    """`dst` as the same file as `src` (a hard link), or a copy where links are not supported."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
