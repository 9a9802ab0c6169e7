"""The query-kind prior (index/query_kind.py): what a definition is, what a query's first word asks for,
the table built from mined pairs, and the prior inside CodeIndex.search with the shipped embedder."""

from __future__ import annotations

from pathlib import Path

import pytest

from index import query_kind
from index.code_index import CodeIndex, Weights
from index.embed_mine import Pair

TYPES = {
    "python class with a decorator": "@dataclass(frozen=True)\nclass Point:\n    x: int\n",
    "java class under its javadoc": "/**\n * A point.\n */\n@Immutable\npublic final class Point {\n}\n",
    "java interface": "public interface Shape extends Comparable<Shape> {\n",
    "java record": "record Pair(int a, int b) {}\n",
    "rust struct under attributes": "/// A point.\n#[derive(Debug, Clone)]\npub(crate) struct Point {\n    x: i32,\n}\n",
    "rust impl block": "impl<T: Display> fmt::Display for Wrapper<T> {\n",
    "rust trait": "pub trait Shape {\n",
    "go struct": "// Point is a point.\ntype Point struct {\n\tX int\n}\n",
    "c typedef": "typedef struct point {\n    int x;\n} point_t;\n",
    "c struct": "struct list_head {\n",
    "typescript interface": "export interface Options {\n  depth: number;\n}\n",
    "typescript alias": "export type Answer = typeof NONE | typeof PROVEN;\n",
    "javascript class": "export default class Parser extends Base {\n",
    "java annotation type": "/** Marks a test. */\n@Retention(RUNTIME)\n@interface Flaky {\n",
    "c++ template class": "// A stack.\ntemplate <typename T>\nclass Stack : public Base<T> {\n",
    "c++ template struct, one line": "template <class T> struct Node {\n",
    "rust tuple struct": "pub struct Meters(pub f64);\n",
}
FUNCTIONS = {
    "python method": "    def parse(self, text):\n        return text\n",
    "python function named like a class": "def class_name(obj):\n    return type(obj).__name__\n",
    "java method": "/** Returns x. */\n@Override\npublic static int classify(int x) {\n",
    "rust fn": "#[inline]\npub fn structure(&self) -> &Tree {\n",
    "go func": "func (p *Point) Type() string {\n",
    "c function": "static int interface_count(struct list_head *head)\n{\n",
    "javascript function": "export function typeOf(value) {\n",
    "a later slice of a function": "        if let Some(short) = arg.short {\n",
    "c function returning a struct": "struct point *make_point(int x, int y)\n{\n",
    "c function returning a static struct": "static struct list_head lh_init(void)\n{\n",
    "c++ template function": "template <typename T>\nT max_of(T a, T b) {\n",
}


@pytest.mark.parametrize("name", sorted(TYPES))
def test_types_are_types(name):
    assert query_kind.definition_kind(TYPES[name]) == "type"


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_functions_are_functions(name):
    assert query_kind.definition_kind(FUNCTIONS[name]) == "function"


def test_first_word():
    assert query_kind.first_word('"Returns the path."') == "returns"
    assert query_kind.first_word("  Mix-in for parsers") == "mix-in"
    assert query_kind.first_word("`parse` the config") == "parse"
    assert query_kind.first_word("42 is the answer") == ""


def test_build_table_counts_the_kind_of_each_documented_definition():
    def pair(query, positive, kind="sentence"):
        return Pair("python", "pypi:x", "x.py", kind, query, positive)

    pairs = [
        pair("Return the sum.", "sum\ncalc\n    def sum(self, xs):\n        return 0"),
        pair("Returns a copy.", "copy\n    def copy(self):\n        pass"),
        pair("A point in the plane.", "point\nclass Point:\n    x = 0"),
        pair("A point in the plane.", "point\nclass Point:\n    x = 0", kind="doc"),  # not a first sentence
        pair("A helper that adds.", "add\ndef add(a, b):\n    return a + b"),
    ] + [pair("Raised when it breaks.", "broken\nclass Broken(Exception):\n    pass")] * 3
    table = query_kind.build_table(pairs)
    assert table["docs"] == {"type": 4, "function": 3}
    assert table["words"] == {"raised": [3, 0]}  # words seen fewer than MIN_COUNT times are left out


def test_the_shipped_table_reads_verbs_as_functions_and_noun_phrases_as_types():
    for q in ("Return the domain of an address.", "Parse the header.", "Get the value."):
        b = query_kind.biases(q)
        assert b["type"] < -1 and b["function"] > 0
    for q in ("A mailbox with a display name.", "Raised when the address is empty.", "Base class for parsers."):
        b = query_kind.biases(q)
        assert b["type"] > 0.5 and b["function"] < 0
    assert query_kind.biases("zyzzyva the flux") == {"type": 0.0, "function": 0.0}


def test_negative_weight_is_refused():
    with pytest.raises(ValueError, match="bad fusion weights"):
        Weights(kind=-0.1)


ADDR = """\
class MissingDomainError(ValueError):
    pass


def require_domain(address):
    if "@" not in address:
        raise MissingDomainError(address)
    return address.partition("@")[2]


class Mailbox:
    def __init__(self, name, address):
        self.name = name
        self.address = address

    def domain(self):
        return require_domain(self.address)
"""


def _search(root: Path, index_dir: Path, embedder, weights: Weights, query: str):
    ix = CodeIndex(root, embedder=embedder, index_dir=index_dir, weights=weights)
    try:
        ix.sync()
        return ix.search(query, 5)
    finally:
        ix.close()


def test_search_moves_types_and_functions_by_the_query(tmp_path, embedder):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "addr.py").write_text(ADDR)
    ix_dir = tmp_path / "ix"
    query = "A mailbox, with a name and an address."
    off = _search(root, ix_dir, embedder, Weights(kind=0.0), query)
    on = _search(root, ix_dir, embedder, Weights(), query)
    # Without the prior the constructor, whose code holds both words, comes first; a query that
    # starts like a class's doc puts the class first.
    assert [h.symbol for h in off[:2]] == ["Mailbox.__init__", "Mailbox"]
    assert [h.symbol for h in on[:2]] == ["Mailbox", "Mailbox.__init__"]
    b = query_kind.biases(query)
    before, after = {h.symbol: h.score for h in off}, {h.symbol: h.score for h in on}
    assert after["Mailbox"] - before["Mailbox"] == pytest.approx(Weights().kind * b["type"], abs=2e-6)
    assert after["Mailbox.__init__"] - before["Mailbox.__init__"] == pytest.approx(
        Weights().kind * b["function"], abs=2e-6)
    # A query that starts like a function's doc leaves the function first and pushes the classes down.
    q2 = "Check that an address has a domain."
    off2, on2 = _search(root, ix_dir, embedder, Weights(kind=0.0), q2), _search(root, ix_dir, embedder, Weights(), q2)
    assert off2[0].symbol == on2[0].symbol == "require_domain"
    for h_off, h_on in ((a, b) for a in off2 for b in on2 if a.symbol == b.symbol):
        moved = h_on.score - h_off.score
        assert (moved < 0) if h_on.symbol in ("Mailbox", "MissingDomainError") else (moved >= 0)
