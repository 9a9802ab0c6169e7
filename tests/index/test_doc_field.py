"""The index keeps doc prose out of the code's vector and BM25 bag, searches it as its own field, and
collapses the chunks of one definition into one result; a search from a fresh process needs no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from index.code_index import CodeIndex, collapse
from index.store import ChunkRow
from index.sync import context_words, name_words

ROOT = Path(__file__).resolve().parents[2]

DOCUMENTED = '''\
def frobnicate_widgets(widgets, factor):
    """Scale every gizmo by the quokka coefficient and drop the broken ones."""
    return [w * factor for w in widgets if w]


def undocumented_twin(widgets, factor):
    return [w + factor for w in widgets if w]
'''


def _long_function(n: int) -> str:
    body = "\n".join(f"    total_{i} = compute_part({i}, values) * weight_{i % 7}" for i in range(n))
    return f"def accumulate_weighted_totals(values):\n{body}\n    return total_0\n"


def test_doc_is_its_own_field_not_in_the_code_vector_or_bag(tmp_path: Path, embedder):
    (tmp_path / "widgets.py").write_text(DOCUMENTED)
    ix = CodeIndex(tmp_path, embedder=embedder)
    ix.sync()
    snap = ix._current()
    rows = ix.chunks(list(range(1, 100)))
    frob = next(r for r in rows.values() if r.symbol == "frobnicate_widgets")
    assert "quokka coefficient" in frob.text  # shown to the reader as written
    # BM25 over code does not see the doc's words; the doc field does.
    assert len(snap.lexical.search("quokka coefficient", 10)[0]) == 0
    assert list(snap.doclex.search("quokka coefficient", 10)[0]) == [frob.id]
    # The stored vector is the name as words, where it lives (the file's stem, for a top-level
    # function) and the code, without the docstring line (no path or symbol header).
    code = "\n".join(line for line in frob.text.split("\n") if "quokka" not in line)
    without = embedder.encode([f"frobnicate widgets\nwidgets\n{code}"])[0]
    with_doc = embedder.encode([f"frobnicate widgets\nwidgets\n{frob.text}"])[0]
    assert name_words(frob.symbol) == "frobnicate widgets"
    assert context_words(frob.symbol, "widgets.py") == "widgets"
    stored = snap.vectors.reconstruct(frob.id)
    assert float(stored @ without) > 0.999 > float(stored @ with_doc)
    # The doc still helps as a weak signal: the prose query finds the documented function.
    assert ix.search("scale gizmos by the quokka coefficient", 1)[0].symbol == "frobnicate_widgets"
    ix.close()


def test_slices_of_one_definition_collapse_into_one_result(tmp_path: Path, embedder):
    (tmp_path / "totals.py").write_text(_long_function(60) + "\n\n" + DOCUMENTED)
    ix = CodeIndex(tmp_path, embedder=embedder)
    ix.sync()
    slices = [r for r in ix.chunks(list(range(1, 200))).values() if r.symbol == "accumulate_weighted_totals"]
    assert len(slices) >= 3 and len({r.unit for r in slices}) == 1
    hits = ix.search("accumulate weighted totals compute part", 10)
    assert [h.symbol for h in hits].count("accumulate_weighted_totals") == 1
    assert hits[0].symbol == "accumulate_weighted_totals"
    ix.close()


def test_collapse_keeps_the_best_chunk_of_each_definition():
    def row(cid: int, unit: str, path: str = "a.py") -> ChunkRow:
        return ChunkRow(cid, path, cid, cid, "f", "python", "", "", unit)

    rows = {1: row(1, "1-9"), 2: row(2, "1-9"), 3: row(3, ""), 4: row(4, ""), 5: row(5, "1-9", "b.py")}
    fused = [(2, 0.9), (3, 0.8), (1, 0.7), (4, 0.6), (5, 0.5), (6, 0.4)]  # 6: not in rows (deleted)
    assert collapse(fused, rows) == [(2, 0.9), (3, 0.8), (4, 0.6), (5, 0.5)]


def test_a_search_from_a_fresh_process_imports_no_torch(indexed_repo: Path):
    code = (
        "import json, sys; from pathlib import Path; from index.cli import main_search; "
        "rc = main_search(['wrap a paragraph of text to a fixed width', '-k', '3', '--json'], "
        "Path(sys.argv[1])); "
        "heavy = sorted(m for m in ('torch', 'sentence_transformers', 'transformers', 'scipy', 'git') "
        "if m in sys.modules); print(json.dumps(heavy)); sys.exit(rc)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("COMPOSER_QUERY_ENCODER", None)
    out = subprocess.run(
        [sys.executable, "-c", code, str(indexed_repo)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    hits_json, heavy = out.stdout.rsplit("\n", 2)[:2]
    assert json.loads(heavy) == []
    hits = json.loads(hits_json)
    assert hits[0]["path"] == "textwrap.py"
    # The same query through sentence-transformers ranks the same way (vectors agree).
    from index.embed import load_embedder

    emb = load_embedder()
    q = "wrap a paragraph of text to a fixed width"
    light = emb.encode([q])
    os.environ["COMPOSER_QUERY_ENCODER"] = "torch"
    try:
        full = emb.encode([q])
    finally:
        del os.environ["COMPOSER_QUERY_ENCODER"]
    assert float(np.sum(light * full)) > 0.999


def test_per_definition_lets_a_later_slice_and_the_head_reinforce_each_other():
    from index.code_index import per_definition

    def row(cid: int, unit: str) -> ChunkRow:
        return ChunkRow(cid, "a.py", cid, cid, "f", "python", "", "", unit)

    rows = {1: row(1, "1-30"), 2: row(2, "1-30"), 3: row(3, "1-30"), 4: row(4, "40-50"), 5: row(5, "")}
    dense = ([1, 4, 5], [0.7, 0.6, 0.5])  # the definition's vector sits on its first chunk
    lexical = ([3, 2, 4], [0.9, 0.5, 0.4])  # BM25 finds its third slice, then its second
    d, lx = per_definition([dense, lexical], rows)
    # One id per definition in every list (the slice BM25 ranks best), each list's best score kept.
    assert d == ([3, 4, 5], [0.7, 0.6, 0.5])
    assert lx == ([3, 4], [0.9, 0.4])


def test_only_definitions_have_vectors_except_in_files_without_a_grammar():
    from index.chunker import chunk_file
    from index.sync import dense_texts

    code = "import os\nimport sys\n\nLIMIT = 3\n\n\n" + DOCUMENTED
    chunks = chunk_file("widgets.py", code, budget=40)
    texts = dense_texts(chunks, path="pkg/widgets.py")
    assert any(c.unit is None for c in chunks) and any(c.unit for c in chunks)
    assert [t is None for t in texts] == [c.unit is None for c in chunks]  # imports, LIMIT: no vector
    assert texts[-1].startswith("undocumented twin\nwidgets\ndef undocumented_twin(")
    prose = "# Notes\n\n" + "\n".join(f"Line {i} about gizmos and their upkeep." for i in range(40))
    chunks = chunk_file("NOTES.md", prose, budget=40)
    assert len(chunks) > 1 and all(dense_texts(chunks, parsed=False))


def test_where_a_definition_lives_is_named_in_words():
    """Format 6's second line: the enclosing definitions' names, or a top-level definition's file stem
    (on the JDK set the class a method belongs to was the dense list's largest gain: +7 MRR@10)."""
    assert context_words("ScheduledThreadPoolExecutor.DelayedWorkQueue.take", "x/Y.java") == \
        "scheduled thread pool executor delayed work queue"
    assert context_words("LocalDateTime.minusSeconds", "java/time/LocalDateTime.java") == "local date time"
    assert context_words("decode_json", "json/json_decoder.py") == "json decoder"
    assert context_words("main", "Makefile") == "makefile"
