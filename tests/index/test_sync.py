"""Building and incrementally syncing a real index (real model, real stdlib files, real git repos)."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest

from index import store
from index.code_index import CodeIndex, dense_depth
from tests.conftest import git

from .conftest import STDLIB, copy_modules, make_repo, waiting


def top_paths(ix: CodeIndex, query: str, k: int = 3, **kw) -> list[str]:
    return [h.path for h in ix.search(query, k, **kw)]


def vector_ids(ix: CodeIndex) -> set[int]:
    import faiss

    return set(faiss.vector_to_array(ix._current().vectors.id_map).tolist())


def consistent(ix: CodeIndex) -> None:
    """Database rows and BM25 rows describe the same chunks; FAISS holds one vector per definition,
    on its first chunk, and none elsewhere (these workspaces are Python files)."""
    snap = ix._current()
    rows = ix._con.execute("SELECT id, path, unit FROM chunks ORDER BY id").fetchall()
    ids = [r[0] for r in rows]
    assert len(ids) == len(snap.lexical) == len(snap.doclex)
    assert list(snap.lexical.ids) == ids
    firsts: dict = {}
    for cid, path, unit in rows:
        if unit:
            firsts.setdefault((path, unit), cid)
    assert vector_ids(ix) == set(firsts.values()) and snap.vectors.ntotal == len(firsts)
    assert len(firsts) < len(ids)  # the later slices and the code between definitions have none
    per_file = dict(ix._con.execute("SELECT path, COUNT(*) FROM chunks GROUP BY path").fetchall())
    recorded = dict(ix._con.execute("SELECT path, n_chunks FROM files WHERE n_chunks > 0").fetchall())
    assert per_file == recorded


def test_first_build(tmp_path: Path, embedder):
    repo = make_repo(tmp_path / "repo", ["textwrap.py", "colorsys.py"])
    ix = CodeIndex(repo, embedder=embedder)
    first = ix.sync()
    assert first.rebuilt == "no index yet"
    assert first.chunks > 10 and first.indexed_files == len(first.added) == 2
    assert first.embedded == ix._current().vectors.ntotal < first.chunks  # one per definition
    assert top_paths(ix, "wrap a paragraph of text to a fixed line width")[0] == "textwrap.py"
    consistent(ix)


def test_incremental_add_modify_delete_rename(indexed_repo: Path, embedder):
    stdlib_repo = indexed_repo
    ix = CodeIndex(stdlib_repo, embedder=embedder)
    again = ix.sync()
    assert (again.changed, again.embedded, again.rebuilt) == (0, 0, None)
    assert top_paths(ix, "wrap a paragraph of text to a fixed line width")[0] == "textwrap.py"

    # Add a file: a module the index has not seen.
    shutil.copy2(STDLIB / "getopt.py", stdlib_repo / "getopt.py")
    r = ix.sync()
    assert r.added == ["getopt.py"] and not r.modified and not r.deleted
    assert "getopt.py" in top_paths(ix, "parse command line options like the unix getopt function")

    # Modify one function: only its chunk is embedded again, the rest of the file keeps its vectors.
    tw = stdlib_repo / "textwrap.py"
    text = tw.read_text()
    assert "def dedent(text):" in text
    tw.write_text(text.replace("def dedent(text):",
                               "def strip_common_margin(text):\n    return dedent(text)\n\n\ndef dedent(text):"))
    r = ix.sync()
    assert r.modified == ["textwrap.py"]
    assert 1 <= r.embedded <= 3 and r.reused > 10
    hits = ix.search("strip_common_margin", 3)
    assert any(h.path == "textwrap.py" and "strip_common_margin" in h.text for h in hits)

    # Delete a file: its chunks go.
    (stdlib_repo / "colorsys.py").unlink()
    r = ix.sync()
    assert r.deleted == ["colorsys.py"]
    assert all(h.path != "colorsys.py" for h in ix.search("convert rgb color to hls", 10))

    # Rename (git mv): the old path disappears, the new one answers.
    (stdlib_repo / "lexing").mkdir()
    git(stdlib_repo, "mv", "shlex.py", "lexing/shlex.py")
    r = ix.sync()
    assert r.deleted == ["shlex.py"] and r.added == ["lexing/shlex.py"]
    # (since format 4 the path is not in the vector: textwrap's _split may come first for this query)
    hits = top_paths(ix, "split a string using shell-like syntax", 3)
    assert "lexing/shlex.py" in hits and "shlex.py" not in hits
    assert not ix._con.execute("SELECT 1 FROM chunks WHERE path = 'shlex.py'").fetchall()
    consistent(ix)

    # What is on disk answers like what is in memory (another process sees the same index).
    fresh = CodeIndex(stdlib_repo, embedder=embedder)
    q = "heap queue priority push pop"
    assert [(h.path, h.start_line) for h in fresh.search(q, 5)] == [(h.path, h.start_line) for h in ix.search(q, 5)]
    files = {p.name for p in ix.dir.iterdir()}
    assert sum(n.startswith("vectors-") for n in files) == 1, files  # old generations are removed


def test_path_restricts_results(indexed_repo: Path, embedder):
    ix = CodeIndex(indexed_repo, embedder=embedder)
    assert {h.path.split("/")[0] for h in ix.search("decode a string", 8, path="json")} == {"json"}
    assert set(top_paths(ix, "decode a string", 8, path="json/decoder.py")) == {"json/decoder.py"}
    assert ix.search("decode a string", 5, path="no/such/folder") == []


def test_a_workspace_outside_git_is_indexed(tmp_path: Path, embedder):
    root = tmp_path / "plain"
    root.mkdir()
    copy_modules(root, ["fnmatch.py", "colorsys.py"])
    (root / ".gitignore").write_text("colorsys.py\n")
    ix = CodeIndex(root, embedder=embedder)
    r = ix.sync()
    assert r.added == [".gitignore", "fnmatch.py"]
    assert top_paths(ix, "match a filename against a shell pattern", 1) == ["fnmatch.py"]
    assert (root / ".composer" / ".gitignore").read_text().splitlines()[1] == "*"


def test_edit_within_the_same_mtime_tick_is_noticed(tmp_path: Path, embedder):
    # Same size, same mtime, different bytes: caught because a freshly written file's mtime is not
    # trusted (it is recorded as unknown, so the next sync hashes it).
    f = tmp_path / "m.py"
    f.write_text("def alpha_function():\n    return 'aaaa'\n")
    ix = CodeIndex(tmp_path, embedder=embedder)
    ix.sync()
    st = f.stat()
    f.write_text("def omega_function():\n    return 'zzzz'\n")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = ix.sync()
    assert r.modified == ["m.py"]
    assert "omega_function" in ix.search("omega", 1)[0].text


def test_non_utf8_and_binary_files(git_repo: Path, embedder):
    (git_repo / "legacy.py").write_bytes(
        "# Fonctions de la pâtisserie\ndef crème_brûlée(sucre):\n    return sucre * 2\n".encode("latin-1"))
    (git_repo / "data.bin").write_bytes(bytes(range(256)) * 4)
    (git_repo / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    (git_repo / "utf16.txt").write_bytes("notes about the bakery oven\n".encode("utf-16"))
    copy_modules(git_repo, ["bisect.py"])
    ix = CodeIndex(git_repo, embedder=embedder)
    r = ix.sync()
    status = dict(ix._con.execute("SELECT path, status FROM files").fetchall())
    assert status == {"legacy.py": "indexed", "data.bin": "binary", "logo.png": "binary",
                      "utf16.txt": "indexed", "bisect.py": "indexed"}
    assert r.skipped == {"binary": 2}
    hit = ix.search("crème_brûlée", 1)[0]
    assert hit.path == "legacy.py" and "crème_brûlée" in hit.text
    assert top_paths(ix, "bakery oven notes", 1) == ["utf16.txt"]


@pytest.mark.slow
def test_model_change_forces_rebuild(tmp_path: Path, embedder):
    from sentence_transformers import SentenceTransformer, models

    from index.embed import load_embedder

    stdlib_repo = make_repo(tmp_path / "repo", ["textwrap.py", "colorsys.py"])
    ix = CodeIndex(stdlib_repo, embedder=embedder)
    ix.sync()
    assert ix.info()["model"] == embedder.name and ix.info()["dim"] == "384"
    # A genuinely different model: MiniLM plus a projection to 64 dimensions, saved as a folder.
    import torch

    torch.manual_seed(0)
    word = models.Transformer(str(Path(embedder.model[0].auto_model.name_or_path)))
    pool = models.Pooling(word.get_embedding_dimension())
    dense = models.Dense(word.get_embedding_dimension(), 64)
    folder = tmp_path / "minilm-64"
    SentenceTransformer(modules=[word, pool, dense], device="cpu").save(str(folder))
    other = load_embedder(str(folder))
    assert other.dim == 64

    ix2 = CodeIndex(stdlib_repo, embedder=other)
    r = ix2.sync()
    assert r.rebuilt and "embedding model changed" in r.rebuilt
    assert ix2.info()["model"] == str(folder) and ix2.info()["dim"] == "64"
    assert r.embedded == ix2._current().vectors.ntotal > 0
    assert ix2.search("wrap text", 3)
    # The original index object notices the switch rather than mixing vectors of two models.
    with pytest.raises(ValueError, match="built with"):
        ix.search("wrap text", 3)
    assert ix.sync().rebuilt.startswith("embedding model changed")
    assert ix.info()["dim"] == "384"


def test_a_failed_commit_keeps_the_previous_index(indexed_repo: Path, embedder, monkeypatch):
    stdlib_repo = indexed_repo
    ix = CodeIndex(stdlib_repo, embedder=embedder)
    gen = ix.info()["gen"]
    shutil.copy2(STDLIB / "getopt.py", stdlib_repo / "getopt.py")

    def crash(*a, **kw):  # the new generation's files are written; the switch never happens
        raise OSError("disk full")

    monkeypatch.setattr(store, "commit", crash)
    with pytest.raises(OSError, match="disk full"):
        ix.sync()
    monkeypatch.undo()
    reader = CodeIndex(stdlib_repo, embedder=embedder)
    assert reader.info()["gen"] == gen
    assert "getopt.py" not in top_paths(reader, "parse command line options like the unix getopt function", 5)
    assert top_paths(reader, "wrap a paragraph of text to a fixed line width", 1) == ["textwrap.py"]
    consistent(reader)
    r = ix.sync()  # the half-updated in-memory state was dropped; the retry works from disk
    assert r.added == ["getopt.py"]
    consistent(ix)


def test_a_busy_index_is_reported_not_waited_for(indexed_repo: Path, embedder):
    ix = CodeIndex(indexed_repo, embedder=embedder)
    with store.writer_lock(ix.dir), pytest.raises(store.IndexBusy):
        ix.sync(wait=False)


def test_empty_workspace(tmp_path: Path, embedder):
    ix = CodeIndex(tmp_path, embedder=embedder)
    r = ix.sync()
    assert r.chunks == 0
    assert ix.search("anything", 5) == []
    with pytest.raises(ValueError):
        ix.search("   ", 5)


def partly_embedded(ix: CodeIndex) -> set[int]:
    """Every row is in the database and both BM25 indexes; the vectors are some of the definitions'
    (each on its first chunk). Returns the vector ids."""
    snap = ix._current()
    rows = ix._con.execute("SELECT id, path, unit FROM chunks ORDER BY id").fetchall()
    assert list(snap.lexical.ids) == [r[0] for r in rows] and len(snap.doclex) == len(rows)
    firsts: dict = {}
    for cid, path, unit in rows:
        if unit:
            firsts.setdefault((path, unit), cid)
    have = vector_ids(ix)
    assert have <= set(firsts.values()) and snap.vectors.ntotal == len(have)
    return have


def test_a_time_budget_commits_every_file_by_its_words_and_the_next_sync_embeds_the_rest(
        tmp_path: Path, embedder, monkeypatch):
    from index import sync

    repo = make_repo(tmp_path / "repo", ["textwrap.py", "colorsys.py", "fnmatch.py", "bisect.py"])
    monkeypatch.setattr(sync, "BATCH_CHUNKS", 4)
    ix = CodeIndex(repo, embedder=embedder)
    first = ix.sync(budget_s=0)  # one batch of vectors, then the budget is spent
    assert first.added == ["bisect.py", "colorsys.py", "fnmatch.py", "textwrap.py"]
    assert first.embedded == 4 and 3 <= first.pending <= 4
    assert f"the vectors of {first.pending} files follow on the next searches" in first.summary()
    assert len(partly_embedded(ix)) == 4 and len(waiting(ix)) == first.pending
    partial_info, partial_depth = ix.info(), dense_depth(ix._current(), 100)
    # every file answers by its words already
    assert top_paths(ix, "textwrap wrap paragraph width", 1) == ["textwrap.py"]
    assert top_paths(ix, "fnmatch translate shell pattern", 1) == ["fnmatch.py"]
    monkeypatch.undo()
    rest = ix.sync()
    assert rest.changed == 0 and rest.rebuilt is None and rest.pending == 0
    assert rest.embedded == ix._current().vectors.ntotal - 4 > 0  # nothing embedded twice
    # the partial index knew how many vectors were to come, and read its dense list that much shallower
    assert int(partial_info["unembedded_vectors"]) == rest.embedded
    assert partial_depth == math.ceil(100 * 4 / (4 + rest.embedded)) < 100
    assert ix.info()["unembedded_vectors"] == "0" and dense_depth(ix._current(), 100) == 100
    assert rest.summary().startswith(f"embedded {rest.embedded} more definitions")
    assert waiting(ix) == []
    consistent(ix)
    assert top_paths(ix, "wrap a paragraph of text to a fixed line width", 1) == ["textwrap.py"]
    assert ix.sync().summary().startswith("index up to date")


def test_a_build_killed_between_batches_keeps_its_vectors_and_the_next_sync_embeds_only_the_rest(
        tmp_path: Path, embedder, monkeypatch):
    from index import sync

    repo = make_repo(tmp_path / "repo", ["textwrap.py", "colorsys.py", "fnmatch.py", "bisect.py"])
    monkeypatch.setattr(sync, "BATCH_CHUNKS", 4)  # a few vectors a batch
    commit, calls = store.commit, []

    def killed_at_the_third(*a, **kw):  # the rows, one batch of vectors, then the process dies
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return commit(*a, **kw)

    monkeypatch.setattr(store, "commit", killed_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        CodeIndex(repo, embedder=embedder).sync()
    monkeypatch.setattr(store, "commit", commit)
    ix = CodeIndex(repo, embedder=embedder)
    kept = partly_embedded(ix)
    assert len(kept) == 4 and waiting(ix)
    # one waiting file is edited meanwhile: it is chunked anew, the others are embedded as they were
    edited = sorted(waiting(ix))[-1]
    (repo / edited).write_text((repo / edited).read_text() + "\n\ndef added_later():\n    return 1\n")
    edited_ids = {r[0] for r in ix._con.execute("SELECT id FROM chunks WHERE path = ?", (edited,))}
    rest = ix.sync()
    assert rest.modified == [edited] and rest.added == [] and rest.pending == 0
    assert kept - edited_ids <= vector_ids(ix)  # what was embedded before stays
    # and is not embedded again (the edited file's old vectors are reused where its text is unchanged)
    assert rest.embedded == ix._current().vectors.ntotal - len(kept)
    assert waiting(ix) == []
    consistent(ix)
    assert "added_later" in {h.symbol for h in ix.search("added later", 5)}


def test_a_long_definition_has_one_vector_of_its_whole_code(indexed_repo: Path, embedder):
    """Format 6: the vector of a definition cut into several chunks is its name as words, where it
    lives, and its whole code (no doc, no path or symbol header), stored on its first chunk; its later
    slices have none."""
    from index.sync import chunk_for, dense_texts

    ix = CodeIndex(indexed_repo, embedder=embedder)
    consistent(ix)
    chunks = chunk_for("textwrap.py", (indexed_repo / "textwrap.py").read_text(), embedder)
    texts = dense_texts(chunks, path="textwrap.py")
    units = [c.unit for c in chunks]
    long_unit = max((u for u in set(units) if u), key=units.count)
    slices = [i for i, c in enumerate(chunks) if c.unit == long_unit]
    assert len(slices) >= 2 and texts[slices[0]] and all(texts[i] is None for i in slices[1:])
    whole = texts[slices[0]]
    assert chunks[slices[-1]].code.strip().split("\n")[-1] in whole  # the last slice's code too
    assert "textwrap.py" not in whole and '"""' not in whole.split("\n", 3)[2]  # no header, no doc
    (cid,) = [r[0] for r in ix._con.execute(
        "SELECT id FROM chunks WHERE path = 'textwrap.py' AND start_line = ?", (chunks[slices[0]].start_line,))]
    stored = ix._current().vectors.reconstruct(cid)
    assert float(stored @ embedder.encode([whole])[0]) > 0.999
    ix.close()


def test_an_index_of_an_older_format_rebuilds_itself(indexed_repo: Path, embedder):
    ix = CodeIndex(indexed_repo, embedder=embedder)
    assert ix.info()["format"] == store.FORMAT == "composer-index-7"
    n = ix.chunk_count()
    # What a format 6 index looks like to this code: the same tables, another format name.
    ix._con.execute("UPDATE info SET value = 'composer-index-6' WHERE key = 'format'")
    ix.close()
    ix = CodeIndex(indexed_repo, embedder=embedder)
    assert ix.search("wrap a paragraph of text", 3) == []  # nothing of the old format is read
    r = ix.sync()
    assert r.rebuilt == "index format changed" and r.chunks == n
    assert ix.info()["format"] == "composer-index-7"
    assert top_paths(ix, "wrap a paragraph of text to a fixed line width", 1) == ["textwrap.py"]
    consistent(ix)
    ix.close()


def test_progress_goes_scan_chunk_embed(tmp_path: Path, embedder):
    repo = make_repo(tmp_path / "repo", ["bisect.py", "colorsys.py"])
    seen: list[tuple[str, int, int]] = []
    CodeIndex(repo, embedder=embedder).sync(progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert list(dict.fromkeys(stage for stage, _, _ in seen)) == ["scan", "chunk", "embed"]
    assert ("chunk", 2, 2) in seen
    stage, done, total = seen[-1]
    assert stage == "embed" and done == total > 0
