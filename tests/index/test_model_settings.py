"""Settings stored with an embedding model (index/embed.py SETTINGS_FILE): the weights' fingerprint,
which the index records so that new weights under the same model name rebuild it, and the fusion
tuned for that model, which searches use unless told otherwise."""

from __future__ import annotations

import json
import shutil
import sysconfig
from dataclasses import asdict
from pathlib import Path

import pytest

from index.code_index import CodeIndex, Weights
from index.embed import (
    CODE_MODEL_DIR,
    MINILM,
    SETTINGS_FILE,
    Embedder,
    EmbedderError,
    _bundled_model_dir,
    load_embedder,
    model_settings,
    weights_sha256,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _model(tmp_path: Path, name: str, settings: dict | None) -> Path:
    """A copy of the bundled MiniLM folder with the given settings file (or none)."""
    d = tmp_path / name
    shutil.copytree(_bundled_model_dir(MINILM), d)
    if settings is not None:
        (d / SETTINGS_FILE).write_text(json.dumps(settings))
    return d


def _open(folder: Path, name: str = "test/model") -> Embedder:
    return Embedder(name, str(folder), folder=folder, device="cpu", dtype="float32")


def test_new_weights_under_the_same_name_rebuild_the_index(tmp_path: Path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy2(STDLIB / "colorsys.py", repo / "colorsys.py")
    old = _model(tmp_path, "old", {"weights_sha256": "a" * 64})
    ix = CodeIndex(repo, embedder=_open(old), index_dir=tmp_path / "ix")
    assert ix.sync().rebuilt == "no index yet"
    assert ix.info()["weights"] == "a" * 16
    assert ix.sync().rebuilt is None  # same weights: nothing to do
    ix.close()
    new = _model(tmp_path, "new", {"weights_sha256": "b" * 64})
    ix = CodeIndex(repo, embedder=_open(new), index_dir=tmp_path / "ix")
    with pytest.raises(ValueError, match="other weights of test/model"):
        ix.search("convert hue lightness saturation to red green blue")  # not synced yet
    assert ix.sync().rebuilt == "the weights of test/model changed"
    assert ix.info()["weights"] == "b" * 16
    assert ix.search("convert hue lightness saturation to red green blue", 3)
    ix.close()


def test_an_index_from_before_fingerprints_is_rebuilt_for_a_fingerprinted_model(tmp_path: Path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy2(STDLIB / "colorsys.py", repo / "colorsys.py")
    ix = CodeIndex(repo, embedder=_open(_model(tmp_path, "plain", None)), index_dir=tmp_path / "ix")
    ix.sync()
    assert ix.info()["weights"] == ""  # a model without settings (MiniLM): no fingerprint
    ix.close()
    ix = CodeIndex(repo, embedder=_open(_model(tmp_path, "ours", {"weights_sha256": "c" * 64})),
                   index_dir=tmp_path / "ix")
    assert ix.sync().rebuilt == "the weights of test/model changed"
    ix.close()


def test_the_fusion_stored_with_a_model_is_the_one_searches_use(tmp_path: Path):
    fusion = {"method": "abs", "dense": 0.8, "lexical": 0.2, "power": 2.0}
    emb = _open(_model(tmp_path, "m", {"weights_sha256": "d" * 64, "fusion": fusion}))
    assert Weights.for_model(emb) == Weights("abs", 0.8, 0.2, power=2.0)
    repo = tmp_path / "repo"
    repo.mkdir()
    assert CodeIndex(repo, embedder=emb, index_dir=tmp_path / "ix").weights == Weights("abs", 0.8, 0.2, power=2.0)
    # Given weights win; a model without fusion settings gets the defaults.
    given = Weights("sum", 0.5, 0.5)
    assert CodeIndex(repo, embedder=emb, index_dir=tmp_path / "ix", weights=given).weights == given
    assert Weights.for_model(_open(_model(tmp_path, "plain", None))) == Weights()
    assert Weights.for_model(load_embedder("minilm")) == Weights()


def test_bad_settings_are_clear_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="fusion stored with test/model is not valid"):
        Weights.for_model(_open(_model(tmp_path, "a", {"fusion": {"method": "abs", "dense_weight": 1}})))
    with pytest.raises(ValueError, match="fusion method 'max'"):
        Weights.for_model(_open(_model(tmp_path, "b", {"fusion": {"method": "max"}})))
    with pytest.raises(ValueError, match="bad fusion weights"):
        Weights("abs", -0.1, 1.1)
    bad = _model(tmp_path, "c", None)
    (bad / SETTINGS_FILE).write_text("{not json")
    with pytest.raises(EmbedderError, match="not readable as JSON"):
        model_settings(bad)
    (bad / SETTINGS_FILE).write_text(json.dumps({"weights_sha256": 5}))
    with pytest.raises(EmbedderError, match="weights_sha256"):
        model_settings(bad)


@pytest.mark.skipif(not (CODE_MODEL_DIR / "model.safetensors").is_file(), reason="code-minilm not built")
def test_the_shipped_code_model_records_its_own_weights_and_a_valid_fusion():
    """Shipping new weights without their fingerprint would let old indexes keep old vectors."""
    settings = model_settings(CODE_MODEL_DIR)
    assert settings["weights_sha256"] == weights_sha256(CODE_MODEL_DIR)
    emb = load_embedder("code-minilm")
    assert emb.fingerprint == settings["weights_sha256"][:16]
    # Its fusion: the one stored with it, or (none stored) the defaults.
    assert asdict(Weights.for_model(emb)) == {**asdict(Weights()), **settings.get("fusion", {})}
