"""The transformers reference engine: correct and slow, the baseline for parity and speed.

transformers' own model (`AutoModelForCausalLM`) runs the forward passes; decoding is a plain loop
with a KV cache, one request at a time on a worker thread (no batching: that is the point of a
baseline). Greedy decoding picks the argmax of the same logits `generate()` uses, so its output is
identical to `model.generate(do_sample=False)`.

`load_weights` is a command in the same queue, so requests before it finish on the old model (or are
aborted) and those after it run on the new one, which the worker loads between two requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from serve.engine.base import (
    DONE,
    Engine,
    EngineStats,
    EngineStopped,
    GenToken,
    SamplingParams,
    drain,
    join_worker,
)
from serve.engine.weights import (
    Reload,
    RequestAborted,
    WeightLoadError,
    WeightsLoaded,
    checkpoint_dir,
    config_mismatch,
    next_version,
    read_policy_version,
)

# What must match for a checkpoint to replace the running model (the tokenizer and chat format stay).
SHAPE_KEYS = ["model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
              "num_local_experts", "num_experts_per_tok", "tie_word_embeddings"]


@dataclass(eq=False)  # kept in a set: identity, not fields
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    aborted: RequestAborted | None = None  # set by an aborting load, under HFEngine._mark
    finished: bool = False


def resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
            "float64": torch.float64}[dtype]


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model_dir: str, *, dtype: str = "auto", device: str | None = None,
                 max_model_len: int | None = None):
        import torch
        from transformers import AutoConfig

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.torch_dtype = resolve_dtype(dtype, self.device)
        self.serve_dtype = str(self.torch_dtype).removeprefix("torch.")
        from serve.model.ct_format import refuse_for_transformers

        refuse_for_transformers(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", 4096)
        self.policy_version = read_policy_version(model_dir) or 0
        self._queue: queue.Queue = queue.Queue()
        self._running = 0
        self._inflight: set[_Request] = set()
        self._mark = threading.Lock()  # an abort and the end of a request: either it is aborted or it finished
        self._load_lock = asyncio.Lock()
        # The worker loads the model and runs every forward: one thread owns torch (one OpenMP pool; see
        # serve/engine/native.py).
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._work, args=(model_dir, ready), name="hf-engine", daemon=True)
        self._thread.start()
        ready.result()

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def stats(self) -> EngineStats:
        return EngineStats(running=self._running, waiting=self._queue.qsize(), policy_version=self.policy_version)

    def running(self) -> bool:
        return self._thread.is_alive()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenToken]:
        if not self.running():
            raise EngineStopped()
        if not prompt_ids:
            raise ValueError("the prompt is empty: there is no token to continue from")
        loop = asyncio.get_running_loop()
        req = _Request(list(prompt_ids), params, loop, asyncio.Queue())
        self._inflight.add(req)
        self._queue.put(req)
        try:
            async for tok in drain(req.out):
                yield tok
        finally:
            req.cancelled.set()
            self._inflight.discard(req)

    async def load_weights(self, path: str, policy_version: int | None = None,
                           abort_in_flight: bool = False) -> WeightsLoaded:
        async with self._load_lock:
            folder = checkpoint_dir(path)
            version = next_version(self.policy_version, policy_version, folder)
            self._check_fits(folder)
            cmd = Reload(str(folder), version, abort_in_flight)
            if abort_in_flight:
                with self._mark:
                    victims = [r for r in self._inflight if not r.finished]
                    for r in victims:
                        r.aborted = RequestAborted(self.policy_version, version)
                cmd.aborted = len(victims)
            self._queue.put(cmd)
            return await asyncio.wrap_future(cmd.future)

    def _check_fits(self, folder) -> None:
        from transformers import AutoConfig

        from serve.model.ct_format import refuse_for_transformers

        try:
            refuse_for_transformers(folder)
            new = AutoConfig.from_pretrained(folder).to_dict()
        except (OSError, ValueError, KeyError) as e:
            raise WeightLoadError(f"{folder}: not a checkpoint this engine can load: {e}") from None
        running = self.model.config.to_dict()
        if diff := config_mismatch(running, new, [k for k in SHAPE_KEYS if k in running or k in new]):
            raise WeightLoadError(f"{folder} does not fit the running model: {diff}")

    async def stop(self) -> None:
        """End the worker thread and wait for it (a generate under way finishes first)."""
        self._queue.put(None)
        await join_worker(self._thread)

    def _work(self, model_dir: str, ready: concurrent.futures.Future) -> None:
        from transformers import AutoModelForCausalLM

        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.torch_dtype).to(self.device)
            self.model.eval()
        except BaseException as e:  # noqa: BLE001 - raised by the constructor
            ready.set_exception(e)
            return
        ready.set_result(None)
        while True:
            req = self._queue.get()
            if req is None:
                return
            if isinstance(req, Reload):
                self._swap(req)
                continue
            if req.cancelled.is_set() and req.aborted is None:
                continue
            self._running = 1
            try:
                if req.aborted is None:
                    self._decode(req)
            except BaseException as e:  # noqa: BLE001 - surfaced to the request's consumer
                req.loop.call_soon_threadsafe(req.out.put_nowait, e)
            finally:
                self._running = 0
                with self._mark:
                    req.finished = True
                if req.aborted is not None:
                    req.loop.call_soon_threadsafe(req.out.put_nowait, req.aborted)
                req.loop.call_soon_threadsafe(req.out.put_nowait, DONE)

    def _swap(self, cmd: Reload) -> None:
        """Between requests, on the worker thread: a new transformers model replaces the old one."""
        from transformers import AutoModelForCausalLM

        start = time.monotonic()
        try:
            if cmd.version <= self.policy_version:
                raise WeightLoadError(f"policy_version must increase: {cmd.version} is not above the current "
                                      f"{self.policy_version}", param="policy_version")
            try:
                model, info = AutoModelForCausalLM.from_pretrained(cmd.path, dtype=self.torch_dtype,
                                                                   output_loading_info=True)
            except Exception as e:  # noqa: BLE001 - any failure to read it is the caller's checkpoint's
                raise WeightLoadError(f"cannot load {cmd.path}: {type(e).__name__}: {e}") from None
            if info.get("missing_keys"):  # transformers would serve them randomly initialised
                raise WeightLoadError(f"{cmd.path} lacks weights: {sorted(info['missing_keys'])[:5]}")
            self.model = model.to(self.device).eval()
            self.policy_version = cmd.version
            cmd.future.set_result(WeightsLoaded(cmd.version, time.monotonic() - start,
                                                0.0 if cmd.abort else start - cmd.queued_at, cmd.aborted))
        except Exception as e:  # noqa: BLE001 - reported to the caller; the old model keeps serving
            cmd.future.set_exception(e)

    def _decode(self, req: _Request) -> None:
        import torch
        from transformers import DynamicCache

        from serve.engine.sampling import make_generator, sample

        gen = make_generator(req.params)
        matcher = req.params.grammar.matcher() if req.params.grammar is not None else None  # structured output
        version = self.policy_version  # only this thread changes it, between requests
        cache = DynamicCache()
        ids = torch.tensor([req.prompt_ids], device=self.device)
        stop = set(req.params.stop_token_ids)
        length = len(req.prompt_ids)
        with torch.inference_mode():
            for _ in range(req.params.max_tokens):
                if req.cancelled.is_set() or req.aborted is not None or length >= self.max_model_len:
                    return
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                token, logprob, top = sample(out.logits[0, -1], req.params, gen, matcher)
                req.loop.call_soon_threadsafe(req.out.put_nowait, GenToken(token, logprob, top, version))
                length += 1
                if token in stop:
                    return
                ids = torch.tensor([[token]], device=self.device)
