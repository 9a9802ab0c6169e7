"""A query that is one name puts the definitions of that name first (code_index.definitions_first).

The repository is the agent eval's find-def kind: a function, a test that calls it seven times and a
report that calls everything. With the shipped weights both retrievers rank the test above the
definition for the query `letter` (cosine 0.666 against 0.658), so the order comes from the rule."""

from __future__ import annotations

from pathlib import Path

from index.code_index import CodeIndex

GRADES = """\
def letter(score):
    if score >= 90:
        return 'A'
    if score >= 80:
        return 'B'
    if score >= 70:
        return 'C'
    return 'F'


def average_score(scores):
    return sum(scores) / len(scores)


def passed_count(scores, bar):
    return len([s for s in scores if s >= bar])


class Curve:
    def feed(self, score, bonus):
        return min(100, score + bonus)
"""

TESTS = """\
from pkg.grades import letter, average_score, passed_count


def test_letter():
    assert letter(95) == 'A'
    assert letter(90) == 'A'
    assert letter(85) == 'B'
    assert letter(80) == 'B'
    assert letter(72) == 'C'
    assert letter(70) == 'C'
    assert letter(10) == 'F'


def test_average_score():
    assert average_score([90, 80, 70]) == 80


def test_feed():
    from pkg.grades import Curve
    assert Curve().feed(95, 10) == 100
    assert Curve().feed(50, 10) == 60
"""

REPORT = """\
from pkg.grades import letter, average_score, passed_count


def summary():
    return {
        'letter': letter(95),
        'average_score': average_score([90, 80, 70]),
        'passed_count': passed_count([50, 60, 70], 60),
    }
"""


def _repo(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "grades.py").write_text(GRADES)
    (root / "pkg" / "report.py").write_text(REPORT)
    (root / "tests" / "test_grades.py").write_text(TESTS)
    return root


def test_a_name_query_finds_the_definition_first(tmp_path: Path, embedder):
    ix = CodeIndex(_repo(tmp_path / "repo"), embedder=embedder, index_dir=tmp_path / "ix")
    try:
        ix.sync()
        hits = ix.search("letter", k=3)
        assert (hits[0].path, hits[0].symbol) == ("pkg/grades.py", "letter")
        assert "tests/test_grades.py" in [h.path for h in hits[1:]]  # the test is still found, after it
        feed = ix.search("Curve.feed", k=3)  # a qualified name: the method, not the test named after it
        assert (feed[0].path, feed[0].symbol) == ("pkg/grades.py", "Curve.feed")
        # Not a name: the fused order stands (the rule does not touch prose queries).
        prose = ix.search("which letter grade does a score get", k=3)
        assert prose and all(h.score >= n.score for h, n in zip(prose, prose[1:], strict=False))
    finally:
        ix.close()


def test_prose_and_unknown_names_keep_the_fused_order(tmp_path: Path, embedder):
    from index import store
    from index.code_index import definitions_first

    ix = CodeIndex(_repo(tmp_path / "repo"), embedder=embedder, index_dir=tmp_path / "ix")
    try:
        ix.sync()
        rows = ix.chunks(store.ids_under(ix._con, ""))  # every chunk
        ids = list(rows)
    finally:
        ix.close()
    fused = [(cid, 1.0 / (i + 1)) for i, cid in enumerate(sorted(ids, reverse=True))]
    assert definitions_first("where is letter defined", fused, rows) == fused
    assert definitions_first("no_such_name", fused, rows) == fused
    assert definitions_first("letter grade", fused, rows) == fused
    for q in ("def letter", "function letter", "pkg.grades.letter", "letter()", "`letter`"):
        assert rows[definitions_first(q, fused, rows)[0][0]].symbol == "letter", q
    moved = definitions_first("letter", fused, rows)
    assert sorted(moved) == sorted(fused) and rows[moved[0][0]].symbol == "letter"
