"""Routed experts on the wire: which experts each MoE layer sent each token to (routing replay, "R3").

A trainer that recomputes the server's log-probs routes every token again; where two experts' router
probabilities are nearly tied, the two sides' float rounding (other kernels, another CPU) can pick
different experts, and one such flip moves the log-probs of every later token by ~1e-4. Training on
the experts the server actually used removes that source of mismatch (Ma et al. 2025, "Stabilizing
MoE reinforcement learning by aligning training and inference routers"; SGLang and vLLM return them).

A chat completion with `return_routed_experts: true` answers, per choice, `routed_experts`:

    {"start": S, "shape": [T, M, K], "dtype": "uint8" | "int16", "data": base64}

for the tokens at positions S .. S+T-1 of prompt + completion (every token the model read: all but the
last sampled one), M MoE layers, K experts per token, as a C-order array (little-endian). The server
answers with S = 0; a client that stores only what earlier turns did not already give keeps the same
shape with its own S (agent/client.py). `routed_experts` is null where the engine cannot capture routes (hf, vllm) or the request was cut
short (a stop string, a client that left).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def encode(routes_TMK: np.ndarray, start: int) -> dict[str, Any]:
    small = routes_TMK.size == 0 or (routes_TMK.min() >= 0 and routes_TMK.max() < 256)
    dtype = np.uint8 if small else np.dtype("<i2")
    arr = np.ascontiguousarray(routes_TMK, dtype=dtype)
    return {"start": int(start), "shape": list(arr.shape), "dtype": np.dtype(dtype).name,
            "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def decode(obj: dict[str, Any]) -> tuple[int, np.ndarray]:
    """(start, routes [T, M, K] int16); ValueError on anything malformed."""
    try:
        dtype = {"uint8": np.uint8, "int16": np.dtype("<i2")}[obj["dtype"]]
        shape = tuple(int(x) for x in obj["shape"])
        start = int(obj["start"])
        raw = base64.b64decode(obj["data"], validate=True)
        arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed routed_experts: {type(e).__name__}: {e}") from None
    if len(shape) != 3 or start < 0:
        raise ValueError(f"malformed routed_experts: shape {list(shape)}, start {start}")
    return start, arr.astype(np.int16)
