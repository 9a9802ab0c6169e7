"""The transformers reference engine: correct and slow, the baseline for parity and speed.

transformers' own model (`AutoModelForCausalLM`) runs the forward passes; decoding is a plain loop
with a KV cache, one request at a time on a worker thread (no batching: that is the point of a
baseline). Greedy decoding picks the argmax of the same logits `generate()` uses, so its output is
identical to `model.generate(do_sample=False)`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from serve.engine.base import DONE, Engine, EngineStats, GenToken, SamplingParams, drain


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)


def resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model_dir: str, *, dtype: str = "auto", device: str | None = None,
                 max_model_len: int | None = None):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.torch_dtype = resolve_dtype(dtype, self.device)
        config = AutoConfig.from_pretrained(model_dir)
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", 4096)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.torch_dtype).to(self.device)
        self.model.eval()
        self._queue: queue.Queue = queue.Queue()
        self._running = 0
        self._thread = threading.Thread(target=self._work, name="hf-engine", daemon=True)
        self._thread.start()

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def stats(self) -> EngineStats:
        return EngineStats(running=self._running, waiting=self._queue.qsize())

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenToken]:
        loop = asyncio.get_running_loop()
        req = _Request(list(prompt_ids), params, loop, asyncio.Queue())
        self._queue.put(req)
        try:
            async for tok in drain(req.out):
                yield tok
        finally:
            req.cancelled.set()

    async def stop(self) -> None:
        self._queue.put(None)

    def _work(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
            if req.cancelled.is_set():
                continue
            self._running = 1
            try:
                self._decode(req)
            except BaseException as e:  # noqa: BLE001 - surfaced to the request's consumer
                req.loop.call_soon_threadsafe(req.out.put_nowait, e)
            finally:
                self._running = 0
                req.loop.call_soon_threadsafe(req.out.put_nowait, DONE)

    def _decode(self, req: _Request) -> None:
        import torch
        from transformers import DynamicCache

        from serve.engine.sampling import make_generator, sample

        gen = make_generator(req.params)
        cache = DynamicCache()
        ids = torch.tensor([req.prompt_ids], device=self.device)
        stop = set(req.params.stop_token_ids)
        length = len(req.prompt_ids)
        with torch.inference_mode():
            for _ in range(req.params.max_tokens):
                if req.cancelled.is_set() or length >= self.max_model_len:
                    return
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                token, logprob, top = sample(out.logits[0, -1], req.params, gen)
                req.loop.call_soon_threadsafe(req.out.put_nowait, GenToken(token, logprob, top))
                length += 1
                if token in stop:
                    return
                ids = torch.tensor([[token]], device=self.device)
