"""Chunk boundaries per language, on small hand-checked sources, and invariants on real files."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

import pytest

from index.chunker import approx_tokens, chunk_file

from .conftest import STDLIB

DATA = Path(__file__).resolve().parents[1] / "data" / "index"

# With a budget every definition fits into: one chunk per function, doc comments attached; containers
# (classes, impls, namespaces) open into one chunk per member, their header and closing lines apart
# (no minimum size here, so nothing merges); (start line, end line, symbol).
WHOLE = {
    "Sample.java": [(1, 3, ''), (5, 7, 'Sample'), (9, 11, 'Sample.Sample'), (13, 19, 'Sample.addAll'),
                    (21, 21, 'Sample.Visitor'), (22, 22, 'Sample.Visitor.visit'), (23, 23, 'Sample.Visitor'),
                    (24, 24, 'Sample')],
    "sample.c": [(1, 1, ''), (3, 6, 'node'), (8, 17, 'list_length'), (19, 19, 'size_t2'), (21, 25, 'main')],
    "sample.cpp": [(1, 1, ''), (3, 3, 'geo'), (5, 6, 'geo.Polygon'), (7, 7, 'geo.Polygon.Polygon'),
                   (9, 13, 'geo.Polygon.perimeter'), (15, 17, 'geo.Polygon'), (18, 19, 'geo'), (21, 24, 'clamp'),
                   (26, 26, 'geo::area')],
    "sample.go": [(1, 1, ''), (3, 6, 'Stack'), (8, 11, 'Stack.Push'), (13, 18, 'Stack.Pop'), (20, 22, 'New')],
    "sample.js": [(1, 1, ''), (3, 7, 'readConfig'), (9, 9, 'double'), (11, 11, 'Queue'),
                  (12, 14, 'Queue.constructor'), (16, 19, 'Queue.push'), (21, 23, 'Queue.pop'), (24, 24, 'Queue')],
    "sample.py": [(1, 3, ''), (6, 8, 'add_one'), (11, 12, 'Counter'), (14, 15, 'Counter.__init__'),
                  (17, 19, 'Counter.doubled'), (21, 23, 'Counter.bump')],
    "sample.rs": [(1, 1, ''), (3, 7, 'Point'), (9, 9, 'Point'), (10, 12, 'Point.new'), (14, 16, 'Point.norm'),
                  (17, 17, 'Point'), (19, 19, 'Point'), (20, 22, 'Point.fmt'), (23, 23, 'Point')],
    "sample.ts": [(1, 3, 'Shape'), (5, 6, 'Circle'), (7, 7, 'Circle.constructor'), (9, 11, 'Circle.area'),
                  (13, 15, 'Circle.scale'), (16, 16, 'Circle'), (18, 20, 'totalArea')],
    "sample.tsx": [(1, 1, ''), (3, 3, 'Props'), (5, 8, 'Hello'), (10, 12, 'App')],
}

# With a budget of 40 tokens the members that fit are still whole chunks, named Class.method, with
# their decorator or doc comment.
METHODS = {
    "sample.py": [(11, 12, "Counter"), (14, 15, "Counter.__init__"), (17, 19, "Counter.doubled"),
                  (21, 23, "Counter.bump")],
    "sample.js": [(12, 14, "Queue.constructor"), (16, 19, "Queue.push"), (21, 23, "Queue.pop")],
    "sample.ts": [(7, 7, "Circle.constructor"), (9, 11, "Circle.area"), (13, 15, "Circle.scale")],
    "sample.rs": [(10, 12, "Point.new"), (14, 16, "Point.norm")],
    "Sample.java": [(9, 11, "Sample.Sample"), (22, 22, "Sample.Visitor.visit")],
    "sample.cpp": [(7, 7, "geo.Polygon.Polygon")],
    "sample.go": [(8, 11, "Stack.Push")],
}


def spans(name: str, budget: int, min_tokens: int = 0):
    text = (DATA / name).read_text()
    return [(c.start_line, c.end_line, c.symbol) for c in
            chunk_file(name, text, budget=budget, min_tokens=min_tokens)]


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_definitions_that_fit_are_whole_chunks_and_containers_open(name):
    assert spans(name, 400) == WHOLE[name]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_large_classes_split_into_methods(name):
    got = spans(name, 40)
    missing = [s for s in METHODS[name] if s not in got]
    assert not missing, got


def test_a_function_too_big_is_split_into_consecutive_slices():
    # Stack.Pop is 58 tokens: with 40 it becomes two chunks covering lines 13-18, both named after it.
    pop = [s for s in spans("sample.go", 40) if s[2] == "Stack.Pop"]
    assert len(pop) == 2
    assert pop[0][0] == 13 and pop[-1][1] == 18 and pop[0][1] + 1 == pop[1][0]


def test_small_neighbours_merge():
    # Default merging folds the lone closing brace of a split class into the chunk before it.
    unmerged = spans("Sample.java", 40)
    merged = spans("Sample.java", 40, min_tokens=24)
    assert (24, 24, "Sample") in unmerged
    assert not any(s == e == 24 for s, e, _ in merged)
    assert len(merged) < len(unmerged)
    assert [s for s in merged if s[1] == 24][0][0] < 24


def test_text_files_are_line_windows_broken_at_blank_lines():
    paragraphs = [" ".join(f"word{i}_{j}" for j in range(12)) for i in range(40)]
    text = "\n\n".join(paragraphs) + "\n"
    chunks = chunk_file("notes.md", text, budget=100)
    assert len(chunks) > 3
    for c in chunks:
        assert c.tokens <= 100 and c.symbol == ""
        assert c.text.split("\n")[0].strip()  # windows start with text, not the blank line
    assert [c.end_line + 1 for c in chunks[:-1]] == [c.start_line for c in chunks[1:]] or all(
        b.start_line > a.end_line for a, b in zip(chunks, chunks[1:], strict=False))


def test_one_huge_line_stays_one_chunk():
    text = "x = [" + ", ".join(str(i) for i in range(3000)) + "]\n"
    chunks = chunk_file("table.py", text, budget=100)
    assert [(c.start_line, c.end_line) for c in chunks] == [(1, 1)]


def _check_invariants(name: str, text: str, budget: int) -> None:
    chunks = chunk_file(name, text, budget=budget)
    lines = text.split("\n")
    assert chunks, name
    covered = set()
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.end_line < b.start_line, (name, a.start_line, b.start_line)
    for c in chunks:
        assert 1 <= c.start_line <= c.end_line <= len(lines)
        assert c.text == "\n".join(lines[c.start_line - 1:c.end_line])
        if c.start_line != c.end_line:
            assert c.tokens <= budget, (name, c.start_line, c.tokens)
        covered.update(range(c.start_line, c.end_line + 1))
    lost = [i + 1 for i, line in enumerate(lines) if line.strip() and i + 1 not in covered]
    assert not lost, (name, lost[:5])


@pytest.mark.parametrize("rel", ["argparse.py", "typing.py", "email/_header_value_parser.py",
                                 "asyncio/base_events.py", "json/decoder.py"])
def test_real_stdlib_files_are_covered_without_overlap_within_budget(rel):
    text = (STDLIB / rel).read_text(encoding="utf-8")
    _check_invariants(rel, text, 220)
    chunks = chunk_file(rel, text, budget=220)
    # Most chunks are named after a definition: the chunker follows the code's structure.
    named = sum(1 for c in chunks if c.symbol)
    assert named / len(chunks) > 0.8


def test_real_c_headers_keep_the_invariants():
    include = Path(sysconfig.get_paths()["include"])  # CPython's own C headers
    headers = sorted(include.glob("*.h"))[:40]
    if not headers:
        pytest.skip(f"no C headers under {include}")
    for h in headers:
        text = h.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            _check_invariants(h.name, text, 120)


def test_real_cpp_headers_keep_the_invariants():
    spec = importlib.util.find_spec("torch")  # torch ships its C++ API headers
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torch is not installed")
    api = Path(spec.submodule_search_locations[0]) / "include" / "torch" / "csrc" / "api" / "include"
    headers = sorted(api.rglob("*.h"))[:60]
    if not headers:
        pytest.skip(f"no C++ headers under {api}")
    for h in headers:
        text = h.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            _check_invariants(h.name.replace(".h", ".hpp"), text, 120)


def test_approx_tokens_counts_punctuation_and_long_words():
    assert approx_tokens(["", "a", "a.b", "averyveryverylongidentifier"]) == [0, 1, 3, 6]
