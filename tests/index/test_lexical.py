"""BM25: identifier-aware terms, ranking, incremental rows, persistence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from index.lexical import Lexical, terms, words

from .conftest import STDLIB


def test_identifiers_are_kept_whole_and_split():
    assert words("parse_known_args") == ["parse_known_args", "parse", "known", "args"]
    assert words("HTTPServerRequest") == ["httpserverrequest", "http", "server", "request"]
    assert words("getURL2x") == ["geturl2x", "get", "url"]
    assert words("größe_max café") == ["größe_max", "größe", "max", "café"]
    # Function words carry no signal and would make the longest posting lists.
    assert words("return the value of self") == ["value"]


def test_terms_are_stemmed_so_prose_meets_code():
    assert terms("parses parsing parsed") == terms("parse parse parse")
    assert terms("Read the configuration files") == terms("read_configuration_file")[1:]


def _docs() -> dict[int, str]:
    texts = {}
    for i, rel in enumerate(["textwrap.py", "shlex.py", "colorsys.py", "heapq.py", "bisect.py"], start=1):
        texts[i] = (STDLIB / rel).read_text()
    return texts


def test_bm25_finds_the_module_about_the_query():
    docs = _docs()
    lex = Lexical.empty()
    lex.add(list(docs), list(docs.values()))
    ids, scores = lex.search("convert rgb color to hls", 3)
    assert ids[0] == 3  # colorsys
    assert list(scores) == sorted(scores, reverse=True)
    ids, _ = lex.search("shell-like lexical analyzer quotes", 3)
    assert ids[0] == 2  # shlex
    empty_ids, _ = lex.search("zzzqqq nothingmatches", 3)
    assert len(empty_ids) == 0


def test_remove_and_add_match_a_fresh_build(tmp_path: Path):
    docs = _docs()
    grown = Lexical.empty()
    grown.add([1, 2, 3], [docs[1], docs[2], docs[3]])
    grown.remove([2])
    grown.add([4, 5], [docs[4], docs[5]])
    fresh = Lexical.empty()
    fresh.add([1, 3, 4, 5], [docs[1], docs[3], docs[4], docs[5]])
    for q in ["heap push pop smallest", "wrap text width", "insort bisect sorted list"]:
        a_ids, a_scores = grown.search(q, 4)
        b_ids, b_scores = fresh.search(q, 4)
        assert list(a_ids) == list(b_ids)
        np.testing.assert_allclose(a_scores, b_scores, rtol=1e-5)
    # The restriction to some chunk ids (a folder filter) only drops the others.
    ids, _ = grown.search("heap push pop smallest", 4, allowed=np.array([1, 3]))
    assert set(ids) <= {1, 3}
    grown.save(tmp_path / "lex.npz")
    loaded = Lexical.load(tmp_path / "lex.npz")
    assert list(loaded.search("wrap text width", 4)[0]) == list(grown.search("wrap text width", 4)[0])


def test_ids_must_grow():
    lex = Lexical.empty()
    lex.add([5], ["alpha"])
    with pytest.raises(ValueError):
        lex.add([3], ["beta"])


def test_ceiling_bounds_every_score_and_is_reached_by_a_full_match():
    lex = Lexical.empty()
    lex.add([1, 2, 3], ["parse header value", "parse parse parse config", "header header folding rules"])
    query = "parse the header"
    ids, scores = lex.search(query, 10)
    ceiling = lex.ceiling(query)
    assert len(ids) == 3 and ceiling >= float(scores.max()) > 0
    # One chunk holding each query term at that term's best weight would score the ceiling: here chunk
    # 2 has "parse" at its best and chunk 3 "header", so the ceiling is their best weights summed.
    best_parse = float(lex.search("parse", 10)[1].max())
    best_header = float(lex.search("header", 10)[1].max())
    assert ceiling == pytest.approx(best_parse + best_header)
    assert lex.ceiling("words nobody wrote") == 0.0
