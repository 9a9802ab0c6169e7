"""The index on disk: SQLite metadata plus per-generation FAISS and BM25 files, committed atomically.

Layout of `<workspace>/.composer/index/`:
  meta.sqlite          files (path, size, mtime, content hash, status), chunks (id, path, lines, symbol,
                       text, hash of the embedded text) and info (model, dim, weights, format, generation,
                       next id)
  vectors-<gen>.faiss  IndexIDMap2 over IndexFlatIP; ids are chunk ids (one per definition, sync.py)
  lexical-<gen>.npz    BM25 term counts of the code (and signatures, names), rows are chunk ids
  doclex-<gen>.npz     BM25 term counts of the doc prose, a separate field, rows are chunk ids
  lock                 flock'd by the one process writing

Atomicity: a writer first writes the next generation's three files (temp name, fsync, rename), then in
ONE SQLite transaction replaces the changed rows and sets `gen` to the new generation. SQLite makes
that commit atomic, so a crash or kill at any point leaves either the old generation (whose files are
only deleted after the commit) or the new one, never a mix. Readers take no lock: they read `gen`,
then open that generation's files, and retry if a writer removed them in between.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Bump when the chunker, the embedded text or the layout changes: an older index is then rebuilt.
# 4: one vector per definition (its whole code), none for later slices or the code between
# definitions; chunks and BM25 rows as in 3. 5: the definition's name as words before its code. 6: and
# a line naming where it lives (the enclosing definitions, or the file's stem). 7: the same texts, the
# default embedder now code-minilm (issue 55): vectors of 6 are MiniLM's and must not be mixed in.
# Besides the format, info records the embedder's name, size and weights fingerprint ("weights",
# embed.SETTINGS_FILE): any of them changing rebuilds the index (code_index._rebuild_reason), so
# retrained weights shipped under the same model name need no format bump.
FORMAT = "composer-index-7"
DB_NAME = "meta.sqlite"

SCHEMA = """
CREATE TABLE IF NOT EXISTS info (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    path TEXT PRIMARY KEY, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, hash TEXT NOT NULL,
    status TEXT NOT NULL, n_chunks INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY, path TEXT NOT NULL, start_line INTEGER NOT NULL, end_line INTEGER NOT NULL,
    symbol TEXT NOT NULL, lang TEXT NOT NULL, text_hash TEXT NOT NULL, text TEXT NOT NULL,
    unit TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS chunks_by_path ON chunks(path);
"""


class IndexBusy(RuntimeError):
    """Another process is writing the index."""


@dataclass
class Snapshot:
    """One committed generation, loaded: what searches read and syncs update."""

    gen: int
    info: dict[str, str]
    vectors: object  # faiss.IndexIDMap2 over IndexFlatIP
    lexical: object  # index.lexical.Lexical, over code
    doclex: object  # index.lexical.Lexical, over doc prose


@dataclass(frozen=True)
class FileRow:
    path: str
    size: int
    mtime_ns: int
    hash: str
    status: str  # "indexed", or why the file is skipped ("binary", "too large", ...)
    n_chunks: int = 0


@dataclass(frozen=True)
class ChunkRow:
    id: int
    path: str
    start_line: int
    end_line: int
    symbol: str
    lang: str
    text_hash: str
    text: str
    unit: str = ""  # "first-last" lines of the definition the chunk is (part of); "" outside any


def connect(index_dir: Path) -> sqlite3.Connection:
    index_dir.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(index_dir / DB_NAME, timeout=30, isolation_level=None, check_same_thread=False)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=FULL")  # the commit that switches generations must survive power loss
    cols = [r[1] for r in con.execute("PRAGMA table_info(chunks)")]
    if cols and "unit" not in cols:  # an index of an older format: its rows go, the next sync rebuilds
        con.execute("DROP TABLE chunks")
        con.execute("DELETE FROM info WHERE key = 'format'")
    con.executescript(SCHEMA)
    return con


def read_info(con: sqlite3.Connection) -> dict[str, str]:
    return dict(con.execute("SELECT key, value FROM info").fetchall())


def read_files(con: sqlite3.Connection) -> dict[str, FileRow]:
    rows = con.execute("SELECT path, size, mtime_ns, hash, status, n_chunks FROM files").fetchall()
    return {r[0]: FileRow(*r) for r in rows}


def chunk_hashes(con: sqlite3.Connection, paths: list[str]) -> dict[str, list[tuple[int, str]]]:
    """(id, text_hash) of the chunks of each path."""
    out: dict[str, list[tuple[int, str]]] = {p: [] for p in paths}
    for batch in _batches(paths, 500):
        marks = ",".join("?" * len(batch))
        for cid, path, h in con.execute(f"SELECT id, path, text_hash FROM chunks WHERE path IN ({marks})",
                                        batch):
            out[path].append((cid, h))
    return out


def chunks_by_id(con: sqlite3.Connection, ids: list[int]) -> dict[int, ChunkRow]:
    out: dict[int, ChunkRow] = {}
    for batch in _batches(ids, 500):
        marks = ",".join("?" * len(batch))
        for r in con.execute("SELECT id, path, start_line, end_line, symbol, lang, text_hash, text, unit "
                             f"FROM chunks WHERE id IN ({marks})", batch):
            out[r[0]] = ChunkRow(*r)
    return out


def ids_under(con: sqlite3.Connection, prefix: str) -> list[int]:
    """Chunk ids of files at or below a POSIX path prefix ("" is everything)."""
    if not prefix:
        return [r[0] for r in con.execute("SELECT id FROM chunks")]
    # A range scan instead of LIKE: no escaping of `%`/`_` in folder names needed.
    rows = con.execute("SELECT id FROM chunks WHERE path = ? OR (path >= ? AND path < ?)",
                       (prefix, prefix + "/", prefix + "0"))  # "0" sorts right after "/"
    return [r[0] for r in rows]


def _batches(items: list, n: int) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


# -- generation files ----------------------------------------------------------------------------------

def load(con: sqlite3.Connection, index_dir: Path, current: Snapshot | None = None) -> Snapshot | None:
    """The committed generation (`current` itself if it still is), or None when there is no index
    in this format or its files are missing or inconsistent."""
    import faiss

    from index.lexical import Lexical

    for _ in range(5):
        info = read_info(con)
        if info.get("format") != FORMAT or "gen" not in info:
            return None
        gen = int(info["gen"])
        if current is not None and current.gen == gen:
            return current
        try:
            vectors = faiss.read_index(str(vectors_path(index_dir, gen)))
            lexical = Lexical.load(lexical_path(index_dir, gen))
            doclex = Lexical.load(doclex_path(index_dir, gen))
            n = con.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
            if vectors.ntotal <= n == len(lexical) == len(doclex):  # not every chunk has a vector
                return Snapshot(gen, info, vectors, lexical, doclex)
        except (OSError, RuntimeError, ValueError, KeyError):
            pass
        # A writer may have just replaced this generation: look again; if not, it is damaged.
        if read_info(con).get("gen") == info["gen"]:
            return None
    return None


def vectors_path(index_dir: Path, gen: int) -> Path:
    return index_dir / f"vectors-{gen}.faiss"


def lexical_path(index_dir: Path, gen: int) -> Path:
    return index_dir / f"lexical-{gen}.npz"


def doclex_path(index_dir: Path, gen: int) -> Path:
    return index_dir / f"doclex-{gen}.npz"


def write_atomic(path: Path, write) -> None:
    """`write(tmp_path)` then fsync and rename over `path`: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def remove_stale(index_dir: Path, keep_gen: int) -> None:
    """Delete other generations' files and temp files left by killed writers (call under the lock)."""
    for p in index_dir.iterdir():
        name = p.name
        if name.startswith(".") and name.endswith(".tmp"):
            p.unlink(missing_ok=True)
        elif name.startswith(("vectors-", "lexical-", "doclex-")):
            stem = name.split("-", 1)[1].split(".", 1)[0]
            if stem.isdigit() and int(stem) != keep_gen:
                p.unlink(missing_ok=True)


@contextlib.contextmanager
def writer_lock(index_dir: Path, *, wait: bool = True) -> Iterator[None]:
    """Exclusive across processes (flock); released by the OS if the holder dies."""
    index_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: one writer per process is all we can promise
        yield
        return
    with open(index_dir / "lock", "a+") as f:
        flags = fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(f.fileno(), flags)
        except BlockingIOError:
            raise IndexBusy("the index is being updated by another process") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def commit(con: sqlite3.Connection, *, gen: int, info: dict[str, str], full: bool,
           removed_paths: list[str], files: list[FileRow], chunks: list[ChunkRow]) -> None:
    """The one transaction that makes generation `gen` current."""
    con.execute("BEGIN IMMEDIATE")
    try:
        if full:
            con.execute("DELETE FROM chunks")
            con.execute("DELETE FROM files")
        for batch in _batches(removed_paths, 500):
            marks = ",".join("?" * len(batch))
            con.execute(f"DELETE FROM chunks WHERE path IN ({marks})", batch)
            con.execute(f"DELETE FROM files WHERE path IN ({marks})", batch)
        con.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)",
                        [(f.path, f.size, f.mtime_ns, f.hash, f.status, f.n_chunks) for f in files])
        con.executemany("INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [(c.id, c.path, c.start_line, c.end_line, c.symbol, c.lang, c.text_hash, c.text,
                          c.unit)
                         for c in chunks])
        info = {**info, "gen": str(gen), "updated_at": str(time.time())}
        con.executemany("INSERT OR REPLACE INTO info VALUES (?, ?)", list(info.items()))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def update_stats(con: sqlite3.Connection, files: list[FileRow]) -> None:
    """Refresh size/mtime of files whose content did not change (no new generation needed)."""
    con.execute("BEGIN IMMEDIATE")
    try:
        con.executemany("UPDATE files SET size = ?, mtime_ns = ? WHERE path = ?",
                        [(f.size, f.mtime_ns, f.path) for f in files])
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
