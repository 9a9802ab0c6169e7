"""Our code embedder (issue 55): pair mining on real third-party code, the standard-library exclusion,
the training loss and the float16 export, and selecting the model that ships with the package."""

from __future__ import annotations

import importlib.util
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from index import embed_mine
from index.embed import CODE_MODEL, CODE_MODEL_DIR, MINILM, EmbedderError, load_embedder

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Real third-party code that the `index` extra installs: sentence-transformers' utilities. Found, not
# imported: importing it at collection imports transformers -> torchao -> triton before tests/kernels sets
# TRITON_INTERPRET, and every interpreted kernel of the run then fails (tests/kernels/conftest.py).
ST_UTIL = Path(importlib.util.find_spec("sentence_transformers").origin).parent / "util"


def _tree(tmp_path: Path) -> tuple[Path, list[Path]]:
    root = tmp_path / "st_util"
    shutil.copytree(ST_UTIL, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root, sorted(root.rglob("*.py"))


def test_pairs_mined_from_third_party_code(tmp_path: Path):
    root, files = _tree(tmp_path)
    pairs, stats = embed_mine.mine([("pypi:st", root, files)])
    assert len(pairs) >= 10 and stats["pypi:st"]["pairs"] == len(pairs)
    assert {p.kind for p in pairs} >= {"sentence", "doc"}
    for p in pairs:
        assert p.lang == "python" and p.package == "pypi:st"
        assert p.negative and p.negative != p.positive  # a hard negative from the same package
        assert '"""' not in p.positive  # the definition without its docstring, as the index embeds it
        if p.kind == "sentence":
            assert p.query not in p.positive and len(p.query.split()) >= 4
    # The positive is exactly what the index embeds for that definition.
    from index.chunker import chunk_file
    from index.sync import dense_texts

    embedded = set()
    for f in files:
        rel = f.relative_to(root).as_posix()
        text = f.read_bytes().decode("utf-8")  # as the index reads it: "\r\n" stays
        embedded |= set(dense_texts(chunk_file(rel, text), path=rel))
    assert all(p.positive in embedded for p in pairs)


def test_duplicates_and_evaluation_code_are_left_out(tmp_path: Path):
    root, files = _tree(tmp_path)
    first, _ = embed_mine.mine([("a", root, files)])
    # The same code under another package name (another version of it): nothing new.
    both, stats = embed_mine.mine([("a", root, files), ("b", root, files)])
    assert len(both) == len(first) and "b" not in stats
    # Definitions whose code is in an evaluation corpus are excluded by their key.
    keys = frozenset(embed_mine.code_key(p.positive) for p in first)
    again, _ = embed_mine.mine([("a", root, files)], exclude_hashes=keys)
    assert not {p.positive for p in again} & {p.positive for p in first}


def test_hard_negatives_include_undocumented_definitions(tmp_path: Path):
    """The index holds every definition, documented or not; the tiny undocumented ones whose names carry
    a query's words are what outranks the answer, so they are drawn as hard negatives too. Evaluation
    code stays out even as a negative."""
    pkg = tmp_path / "mailparse"
    pkg.mkdir()
    (pkg / "addresses.py").write_text(
        "import re\n\n\n"
        "def split_address_list(text):\n"
        '    """Split a comma separated list of mail addresses into single addresses."""\n'
        "    return [a.strip() for a in re.split(r',(?=(?:[^\"]*\"[^\"]*\")*[^\"]*$)', text) if a.strip()]\n\n\n"
        "def quote_display_name(name):\n"
        '    """Quote a display name when it holds special characters."""\n'
        "    return '\"' + name.replace('\"', '\\\\\"') + '\"' if re.search(r'[(),;:<>@]', name) else name\n\n\n"
        "class AddressList:\n"
        "    def __init__(self, items):\n"
        "        self._items = items\n\n"
        "    @property\n"
        "    def addresses(self):\n"
        "        return [i for i in self._items if '@' in i]\n")
    files = [pkg / "addresses.py"]
    pairs, stats = embed_mine.mine([("pypi:mailparse", pkg, files)], per_package=10)
    split = next(p for p in pairs if "split address list" in p.positive)
    # BM25's best after the answer is undocumented (the class, or its property): no pair's positive.
    assert "AddressList" in split.negative or "def addresses" in split.negative
    assert split.negative not in {p.positive for p in pairs}
    assert stats["pypi:mailparse"]["definitions"] >= 3
    # Excluded (evaluation) code is in no pair, as a positive or as a negative.
    key = embed_mine.code_key(split.negative)
    again, _ = embed_mine.mine([("pypi:mailparse", pkg, files)], per_package=10, exclude_hashes=frozenset({key}))
    assert again and all(key not in (embed_mine.code_key(p.negative), embed_mine.code_key(p.positive)) for p in again)


def test_standard_library_copies_are_not_third_party(tmp_path: Path):
    pkg = tmp_path / "site-packages" / "somepkg"
    pkg.mkdir(parents=True)
    shutil.copy2(STDLIB / "textwrap.py", pkg / "textwrap.py")  # a vendored copy of the stdlib
    shutil.copy2(ST_UTIL / "misc.py" if (ST_UTIL / "misc.py").exists() else sorted(ST_UTIL.glob("*.py"))[-1],
                 pkg / "real.py")
    kept = embed_mine.third_party(sorted(pkg.glob("*.py")), embed_mine.stdlib_hashes())
    assert [p.name for p in kept] == ["real.py"]


def test_doc_descriptions_lose_tags_and_sections():
    doc = "Returns the {@code int} value of this <b>number</b>.\nMore words here.\n@param x the thing"
    assert embed_mine.description(doc) == "Returns the int value of this number. More words here."
    assert embed_mine.first_sentence(embed_mine.description(doc)) == "Returns the int value of this number."
    py = "Split a string into tokens.\n\nArgs:\n    s: the string"
    assert embed_mine.description(py) == "Split a string into tokens."
    assert embed_mine.names_query("Lexer.split_tokens", "def split_tokens(self, text: str, maxsplit=1):") \
        == "split tokens text maxsplit"


def test_contrastive_loss_prefers_the_right_pairs():
    import torch

    from index.embed_train import contrastive_loss

    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(8, 16, generator=g), dim=1)
    noise = torch.nn.functional.normalize(torch.randn(8, 16, generator=g), dim=1)
    right = contrastive_loss(q, q, noise)
    wrong = contrastive_loss(q, q.roll(1, 0), noise)
    assert float(right) < 0.1 < float(wrong)


def test_float16_export_embeds_like_the_original(tmp_path: Path):
    from index.embed import _bundled_model_dir
    from index.embed_train import export_fp16

    src = _bundled_model_dir(MINILM)
    export_fp16(src, tmp_path / "half")
    assert (tmp_path / "half" / "model.safetensors").stat().st_size < 0.6 * (src / "model.safetensors").stat().st_size
    texts = ["parse a header value into tokens", "def add(a, b):\n    return a + b"]
    a = load_embedder(str(src)).encode(texts)
    b = load_embedder(str(tmp_path / "half")).encode(texts)
    assert np.all(np.sum(a * b, axis=1) > 0.999)
    # The fingerprint indexes record; no fusion until one is tuned for these weights.
    from index.embed import model_settings, weights_sha256

    assert model_settings(tmp_path / "half") == {"weights_sha256": weights_sha256(tmp_path / "half")}


@pytest.mark.skipif(not (CODE_MODEL_DIR / "model.safetensors").is_file(), reason="code-minilm not built")
def test_the_shipped_code_model_loads_offline_and_embeds():
    emb = load_embedder("code-minilm")
    assert emb.name == CODE_MODEL and emb.dim == 384 and emb.folder == CODE_MODEL_DIR
    assert (CODE_MODEL_DIR / "model.safetensors").stat().st_size < 50 * 2**20  # float16
    query = "split a command line into words as a shell would"
    code = ["split\nshlex\ndef split(s, comments=False, posix=True):\n    lex = shlex(s, posix=posix)\n"
            "    lex.whitespace_split = True\n    return list(lex)",
            "hls to rgb\ncolorsys\ndef hls_to_rgb(h, l, s):\n    if s == 0.0:\n        return l, l, l"]
    v = emb.encode([query, *code])  # a few texts: the NumPy forward pass, no torch
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)
    assert v[0] @ v[1] > v[0] @ v[2]


def test_models_are_chosen_by_name_and_alias():
    assert load_embedder("minilm") is load_embedder(MINILM)
    assert load_embedder("all-MiniLM-L6-v2").name == MINILM
    with pytest.raises(EmbedderError, match="no such model folder"):
        load_embedder("./no/such/model")


@pytest.mark.skipif(not (CODE_MODEL_DIR / "model.safetensors").is_file(), reason="code-minilm not built")
def test_switching_model_rebuilds_the_index(tmp_path: Path):
    from index.code_index import CodeIndex

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy2(STDLIB / "colorsys.py", repo / "colorsys.py")  # a few definitions: NumPy-encoded
    ix = CodeIndex(repo, model="minilm", index_dir=tmp_path / "ix")
    ix.sync()
    assert ix.info()["model"] == MINILM
    ix.close()
    ix = CodeIndex(repo, model="code-minilm", index_dir=tmp_path / "ix")
    r = ix.sync()
    assert r.rebuilt == f"embedding model changed from {MINILM} to {CODE_MODEL}"
    assert ix.info()["model"] == CODE_MODEL
    hits = ix.search("convert hue lightness saturation to red green blue", 8)
    assert {h.symbol for h in hits} >= {"hls_to_rgb"} and {h.path for h in hits} == {"colorsys.py"}
    ix.close()


def test_the_schedule_ends_where_the_budget_does():
    from index.embed_train import budget_horizon, lr_at

    # 10 steps in 60 s, 600 s of budget: 90 more steps fit, of 300 planned.
    assert budget_horizon(10, 60.0, 600.0, 300) == 100
    assert budget_horizon(10, 60.0, 6000.0, 300) == 300  # never past the planned steps
    assert budget_horizon(10, 700.0, 600.0, 300) == 11  # already over: the next step ends it
    assert budget_horizon(0, 0.0, 600.0, 300) == 300
    assert lr_at(99, 100, 0.1) == pytest.approx(1 / 90) and lr_at(100, 100, 0.1) == 0.0


def test_a_short_training_run_scores_the_dev_set_on_schedule(tmp_path: Path):
    """Real fine-tuning steps of MiniLM on a few pairs: the development set is scored before training
    and evals_per_epoch times after, the learning rate reaches zero at the end, the best is saved."""
    from sentence_transformers import SentenceTransformer

    from index.embed import _bundled_model_dir
    from index.embed_train import Recipe, train

    pairs = [embed_mine.Pair("python", "p", "a.py", "sentence", f"return the {w} of a list",
                             f"{w}\na\ndef {w}(xs):\n    return {w}(xs)", f"other\na\ndef other{i}(): pass")
             for i, w in enumerate(["sum", "max", "min", "len", "sorted", "set", "list", "any"])]
    model = SentenceTransformer(str(_bundled_model_dir(MINILM)), device="cpu")
    scores = iter([50.0, 60.0, 55.0, 58.0])
    report = train(model, pairs, Recipe(batch=2, max_seq=32, threads=1, evals_per_epoch=3, bf16=False),
                   tmp_path, lambda m: {"MRR@10": next(scores)}, log=lambda s: None)
    assert [c["step"] for c in report["curve"]] == [0, 2, 3, 4]
    assert report["steps"] == report["planned_steps"] == 4 and not report["stopped_by_budget"]
    assert report["curve"][-1]["lr"] == 0.0
    assert (tmp_path / "best").is_dir() and (tmp_path / "last").is_dir()
    with pytest.raises(ValueError, match="bad recipe"):
        Recipe(evals_per_epoch=0)
