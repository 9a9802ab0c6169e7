"""Chunk inventory on code written the way real projects write it: docs stay with their definitions but
out of the code text, small definitions keep chunks of their own, slices of a long body say whose they
are, and every chunk of a definition names it (so search can collapse them)."""

from __future__ import annotations

import pytest

from index.chunker import chunk_file

from .conftest import STDLIB

# Kernel style: a kernel-doc comment longer than the function it documents, then a tiny helper.
C_SRC = """\
#include <linux/rbtree.h>

/**
 * rb_first - find the first node of a tree
 * @root: the tree
 *
 * This function returns the first node (in sort order) of the tree. It walks
 * down the left spine from the root, so it costs O(height), and it returns
 * NULL when the tree is empty. Callers iterating a tree call it once, then
 * rb_next() on each node it returns, until that returns NULL; callers that
 * need the last node instead use rb_last(), which mirrors this function.
 */
struct rb_node *rb_first(const struct rb_root *root)
{
	struct rb_node	*n;

	n = root->rb_node;
	if (!n)
		return NULL;
	while (n->rb_left)
		n = n->rb_left;
	return n;
}

static inline int rb_is_red(struct rb_node *n) { return !rb_color(n); }
static inline int rb_is_black(struct rb_node *n) { return rb_color(n); }
"""

JS_SRC = """\
'use strict';

/**
 * Send a response with the given body, setting Content-Type from its type
 * when none was set: a string is sent as HTML, a Buffer as octet-stream,
 * an object as JSON.
 *
 * @param {string|number|boolean|object|Buffer} body
 * @public
 */
res.send = function send(body) {
  var chunk = body;
  return this.end(chunk);
};

function noop() {}
const identity = (x) => x;
"""

RUST_SRC = """\
use std::fmt;

impl Span {
    /// Create a new span with the given positions.
    #[inline]
    pub fn new(start: Position, end: Position) -> Span {
        Span { start, end }
    }

    /// Returns true if and only if this span is empty.
    pub fn is_empty(&self) -> bool {
        self.start.offset == self.end.offset
    }
}
"""

JAVA_SRC = """\
package java.util.regex;

public final class Matcher {
    int from;
    int to;

    /**
     * Attempts to match the entire region against the pattern.
     *
     * @return true if, and only if, the entire region sequence matches
     */
    public boolean matches() {
        return match(from, ENDANCHOR);
    }

    int getTextLength() { return text.length(); }
}
"""


def _by_symbol(chunks):
    """The first chunk of each symbol."""
    out = {}
    for c in chunks:
        out.setdefault(c.symbol, c)
    return out


def test_a_doc_longer_than_its_function_stays_with_it_and_out_of_the_code():
    # The doc and code together exceed the budget; the code alone fits: one chunk, doc kept apart.
    chunks = chunk_file("lib/rbtree.c", C_SRC, budget=100)  # doc 128, code 69
    first = _by_symbol(chunks)["rb_first"]
    assert first.start_line == 3 and first.end_line == 23  # the doc's first line to the closing brace
    assert "returns the first node" in first.doc and "returns the first node" in first.text
    assert "returns the first node" not in first.code and "rb_node" in first.code
    assert first.doc.startswith("rb_first - find the first node")  # comment markers removed
    assert not any("returns the first node" in c.text for c in chunks if c is not first)


@pytest.mark.parametrize(
    "name,src,small",
    [
        ("lib/rbtree.c", C_SRC, ["rb_is_red", "rb_is_black"]),
        ("lib/response.js", JS_SRC, ["noop", "identity"]),
        ("src/util/Matcher.java", JAVA_SRC, ["Matcher.getTextLength"]),
    ],
)
def test_small_definitions_keep_chunks_of_their_own(name, src, small):
    chunks = chunk_file(name, src)  # the default minimum chunk size would have merged them before
    named = _by_symbol(chunks)
    for sym in small:
        c = named[sym]
        assert c.unit[0] == c.start_line  # the chunk starts with the definition, nothing before it
        assert (
            sum(other.rsplit(".", 1)[-1] + "(" in c.code or other + " =" in c.code for other in small) == 1
        ), c.code


def test_rust_doc_and_attribute_travel_with_the_method_and_methods_carry_the_impl():
    chunks = chunk_file("src/ast.rs", RUST_SRC, budget=400)
    new = _by_symbol(chunks)["Span.new"]
    assert new.start_line == 4 and "#[inline]" in new.code and "///" not in new.code
    assert new.doc == "Create a new span with the given positions."
    assert new.context == "impl Span {"
    empty = _by_symbol(chunks)["Span.is_empty"]
    assert empty.doc.startswith("Returns true") and "pub fn is_empty" in empty.code


def test_javadoc_and_jsdoc_go_to_the_doc_field():
    matches = _by_symbol(chunk_file("Matcher.java", JAVA_SRC))["Matcher.matches"]
    assert matches.doc.startswith("Attempts to match the entire region")
    assert "Attempts" not in matches.code and matches.context == "public final class Matcher {"
    send = _by_symbol(chunk_file("response.js", JS_SRC))["res.send"]
    assert "Content-Type" in send.doc and "Content-Type" not in send.code
    assert send.code.lstrip().startswith("res.send = function send(body)")


def test_python_docstrings_are_doc_not_code():
    text = (STDLIB / "textwrap.py").read_text()
    chunks = chunk_file("textwrap.py", text, budget=220)
    dedent = _by_symbol(chunks)["dedent"]
    assert dedent.doc.startswith("Remove any common leading whitespace")
    assert "common leading whitespace" not in dedent.code and "def dedent(text):" in dedent.code


def test_slices_of_a_long_body_carry_its_signature_and_name_one_unit():
    text = (STDLIB / "argparse.py").read_text()
    chunks = chunk_file("argparse.py", text, budget=120)
    slices = [c for c in chunks if c.symbol == "ArgumentParser._parse_known_args"]
    assert len(slices) >= 3
    assert len({c.unit for c in slices}) == 1
    unit = slices[0].unit
    assert all(unit[0] <= c.start_line and c.end_line <= unit[1] for c in slices)
    head, rest = slices[0], slices[1:]
    assert "def _parse_known_args(" in head.code
    for c in rest:
        assert "def _parse_known_args(self, arg_strings, namespace" in c.context
        assert c.context.startswith("class ArgumentParser(")  # the class around it, outermost first
        assert c.tokens <= 120


def test_stdlib_chunks_never_hold_two_definitions():
    # Over a whole real module: each chunk with a unit holds at most one definition's first line.
    text = (STDLIB / "shlex.py").read_text()
    lines = text.split("\n")
    starts = {i + 1 for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))}
    for c in chunk_file("shlex.py", text):
        heads = [n for n in range(c.start_line, c.end_line + 1) if n in starts]
        assert len(heads) <= 1 or lines[heads[0] - 1].lstrip().startswith("class "), (c.symbol, heads)
