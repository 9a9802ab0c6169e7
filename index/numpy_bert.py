"""A BERT forward pass in NumPy, for encoding a few short texts (search queries) without torch.

Why: importing torch and sentence-transformers costs seconds (5-30 s measured on the 2 shared cores),
which a one-shot `composer-agent search` from a shell would pay before answering. A query is a few
dozen tokens; a 6-layer, 384-wide encoder over it is a handful of small matrix products, which NumPy
does in milliseconds. It needs `tokenizers` (the Rust tokenizer the Hugging Face fast tokenizers
wrap) and NumPy; the weights are memory-mapped from `model.safetensors`, so a query reads only the
embedding rows it uses.

Scope: sentence-transformers folders whose transformer is a BERT (BertModel: MiniLM, BGE, E5, GTE...)
stored as `model.safetensors`, with mean or CLS pooling and optional normalisation; anything else
reports `supported() == False` and the caller uses sentence-transformers. GELU uses the tanh form,
within 1e-3 of the exact one: vectors agree with sentence-transformers' to cosine >= 0.9999 (tested).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def supported(folder: Path) -> bool:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        cfg.get("model_type") == "bert"
        and cfg.get("hidden_act") in ("gelu", "gelu_new")
        and cfg.get("position_embedding_type", "absolute") == "absolute"
        and (folder / "model.safetensors").is_file()
        and (folder / "tokenizer.json").is_file()
        and _pooling(folder) in ("mean", "cls")
    )


def _pooling(folder: Path) -> str:
    try:
        p = json.loads((folder / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return "mean"
    if p.get("pooling_mode_cls_token"):
        return "cls"
    if (
        p.get("pooling_mode_mean_tokens", True)
        and not p.get("pooling_mode_max_tokens")
        and not p.get("pooling_mode_mean_sqrt_len_tokens")
    ):
        return "mean"
    return "other"


class NumpyBert:
    """Sentence embeddings from a sentence-transformers BERT folder; `encode` returns unit vectors."""

    def __init__(self, folder: Path, tokenizer, max_tokens: int):
        cfg = json.loads((folder / "config.json").read_text())
        self.heads = int(cfg["num_attention_heads"])
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.pooling = _pooling(folder)
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        w = _mapped(folder / "model.safetensors")
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in w else ""

        def g(name: str) -> np.ndarray:
            return w[prefix + name]

        self.word = g("embeddings.word_embeddings.weight")  # mapped: only the rows a query uses are read
        self.pos = g("embeddings.position_embeddings.weight")
        self.type0 = g("embeddings.token_type_embeddings.weight")[0]
        self.ln0 = (g("embeddings.LayerNorm.weight"), g("embeddings.LayerNorm.bias"))
        self.layers = []
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            qkv = np.concatenate([g(p + f"attention.self.{n}.weight") for n in ("query", "key", "value")])
            qkv_b = np.concatenate([g(p + f"attention.self.{n}.bias") for n in ("query", "key", "value")])
            # Weights stay [out, in] as stored; `x @ w.T` hands BLAS the transpose without a copy.
            self.layers.append(
                (
                    qkv.T,
                    qkv_b,
                    g(p + "attention.output.dense.weight").T,
                    g(p + "attention.output.dense.bias"),
                    (g(p + "attention.output.LayerNorm.weight"), g(p + "attention.output.LayerNorm.bias")),
                    g(p + "intermediate.dense.weight").T,
                    g(p + "intermediate.dense.bias"),
                    g(p + "output.dense.weight").T,
                    g(p + "output.dense.bias"),
                    (g(p + "output.LayerNorm.weight"), g(p + "output.LayerNorm.bias")),
                )
            )

    def encode(self, texts: list[str]) -> np.ndarray:
        # One BLAS thread: these products are tiny, and on busy cores OpenBLAS's worker threads wait
        # on each other (measured: 2.1 s instead of 0.1 s for a 6-token query at load average 12).
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return self._encode(texts)
        with threadpool_limits(1, user_api="blas"):
            return self._encode(texts)

    def _encode(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.word.shape[1]), dtype=np.float32)
        for i, text in enumerate(texts):  # one at a time: no padding, and queries come alone
            ids = self.tokenizer.encode(text).ids[: self.max_tokens]
            if len(ids) > 2 and ids[-1] != self.tokenizer.token_to_id("[SEP]"):
                ids[-1] = self.tokenizer.token_to_id("[SEP]")  # truncated: end as the model was trained
            out[i] = self._forward(np.asarray(ids, dtype=np.int64))
        return out

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        n = len(ids)
        x = self.word[ids].astype(np.float32) + self.pos[:n] + self.type0
        x = _layer_norm(x, *self.ln0, self.eps)
        h = self.heads
        d = x.shape[1] // h
        for qkv, qkv_b, wo, bo, ln1, wi, bi, wo2, bo2, ln2 in self.layers:
            q, k, v = np.split(x @ qkv + qkv_b, 3, axis=1)
            q = q.reshape(n, h, d).transpose(1, 0, 2)
            k = k.reshape(n, h, d).transpose(1, 2, 0)
            v = v.reshape(n, h, d).transpose(1, 0, 2)
            att = (q @ k) / np.sqrt(d)
            att = np.exp(att - att.max(axis=-1, keepdims=True))
            att /= att.sum(axis=-1, keepdims=True)
            ctx = (att @ v).transpose(1, 0, 2).reshape(n, h * d)
            x = _layer_norm(x + ctx @ wo + bo, *ln1, self.eps)
            inter = x @ wi + bi
            inter = 0.5 * inter * (1 + np.tanh(0.7978845608028654 * (inter + 0.044715 * inter**3)))
            x = _layer_norm(x + inter @ wo2 + bo2, *ln2, self.eps)
        v = x[0] if self.pooling == "cls" else x.mean(axis=0)
        return v / max(float(np.linalg.norm(v)), 1e-12)


_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _mapped(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as read-only memory-mapped arrays (float32: float16 weights
    other than the word-piece table are converted, which reads them). The format is an 8-byte header length, a JSON header giving
    each tensor's dtype, shape and byte range, then the data."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__" or meta["dtype"] not in _DTYPES:
            continue
        a, b = meta["data_offsets"]
        arr = data[a:b].view(_DTYPES[meta["dtype"]]).reshape(meta["shape"])
        # The word-piece table stays mapped in its stored dtype (rows are cast when gathered):
        # converting a float16 table whole would read all 23 MB of it for every query process.
        out[name] = arr if arr.dtype == np.float32 or "word_embeddings" in name else arr.astype(np.float32)
    return out


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b
