"""The native engine: Qwen3-MoE with MXFP8 experts, paged KV cache, continuous batching, prefix caching.

One engine thread loops: take new requests, schedule a step (scheduler.py), run one forward over all
scheduled tokens (model_runner.py), sample the sequences that finished their tokens, stream each new
token to its request's asyncio queue, retire finished or cancelled sequences. Requests that arrive
mid-flight join at the next step.

Failures stay with the request that caused them: a sequence that cannot be scheduled or sampled fails
alone, a forward pass that raises is retried one sequence at a time to find the culprit, and anything
else fails the sequences in flight, never the thread. If the thread ends all the same (stop, or a
BaseException), every waiting caller gets EngineStopped, new requests are refused and `running()`
says so (/health reports it).

Weight loads (`load_weights`, for RL training) are commands in the same inbox, so they are ordered
with the requests: sequences accepted before one finish on the old weights (or are aborted), those
after it are held until the new weights are in. The swap happens only with no sequence left, so one
sequence never sees two sets of weights, and each is stamped with the policy version it runs on.

In-process training (train/colocate.py: trainer and engine in one process on one device) uses three more
commands of the same kind, run on the engine thread once no sequence is left (`call_idle`):
`update_weights_in_place` (the caller copies new weights into the engine's own tensors, so CUDA graphs
captured on them stay valid; the prefix cache is emptied and the version set), and `release_kv_cache` /
`restore_kv_cache` (the KV cache's storage freed while the trainer steps, requests held meanwhile; the
same tensor objects get their memory back, zeroed; the graphs are dropped for recapture only if the
memory came back at other addresses).

Decode steps on a GPU (every scheduled sequence computing its next token) take the static step of
serve/engine/static_decode.py: persistent buffers, one forward and sampling on the device, replayed from
CUDA graphs, one transfer each way. Steps with prefill chunks take ModelRunner.run (torch SDPA over
gathered pages for the decodes among them) and sample on the host side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kernels import cpu_ext
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
from serve.engine.block_manager import BlockManager
from serve.engine.drafter import DEFAULT_CACHE_TOKENS, DEFAULT_TOKENS, SpecConfig
from serve.engine.model_runner import ModelRunner, StaticConfig
from serve.engine.sampling import make_generator, picks_of, sample_batch
from serve.engine.scheduler import Scheduler
from serve.engine.sequence import Sequence
from serve.engine.speculation import Speculator, sample_verify, walk
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
from serve.model.config import ModelConfig
from serve.model.fp8 import describe_checkpoint
from serve.model.loader import load_model, shard_files

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    dtype: str = "auto"
    """auto: bfloat16 on GPU, float32 on CPU."""
    quant: str = "auto"
    """Expert weights: auto (mxfp8 on GPU, none on CPU), none, or mxfp8."""
    quant_dense: str = "none"
    """Attention projections and LM head: none (the model's dtype) or fp8 (block FP8 e4m3, 128x128 scales;
    serve/model/fp8.py: the Triton W8A16 kernel on a GPU; a CPU serves the FP8-rounded values in the model's
    dtype). Off by default until measured on a GPU. A block-FP8 checkpoint's dense layers are FP8 either way
    on a GPU (dequantized on a CPU)."""
    device: str | None = None
    max_model_len: int | None = None
    """Context length; default the checkpoint's max_position_embeddings."""
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    """Tokens per step: the chunk size of long prefills."""
    kv_cache_tokens: int | None = None
    """KV-cache capacity in tokens; default: 90% of free GPU memory; on a CPU 8 x max_model_len, at most
    a quarter of the memory available. Never less than one full context."""
    prefix_caching: bool = True
    cpu_pack: bool = True
    """On a CPU, reorder linear weights for oneDNN at load (kernels/cpu_pack.py): faster small batches."""
    cpu_kernels: bool = True
    """On a CPU, decode attention (reading the KV pages in place) and the routed experts run our C++
    kernels (kernels/cpu_ext.py) once they are built for this machine (a first start builds them in the
    background and runs the torch paths); off: the torch paths."""
    static_decode: bool | None = None
    """Decode steps (every scheduled sequence computes its next token) through the static-shape step
    (serve/engine/static_decode.py: persistent buffers, sampling on the device, CUDA graphs on a GPU).
    None: on a GPU only (a CPU decodes faster through its C++ kernels; True runs the same static path
    there, without capture)."""
    enforce_eager: bool = False
    """On a GPU, run the static decode step directly instead of replaying CUDA graphs (vLLM's
    --enforce-eager)."""
    load_format: str = "auto"
    """auto: the checkpoint's weights; dummy: random weights made on the device from the checkpoint's
    config.json alone (vLLM's --load-format dummy), for measuring speed at a full model's shape."""
    batch_invariant: bool | str = False
    """Batch-invariant numerics (serve/model/numerics.py): a sequence's logits do not depend on the rest of
    the batch, on chunked prefill or on the prefill/decode split, so its log-probs are a function of its
    token ids and the trainer reproduces them bit for bit. True: the device's mode ("fixed": fixed-order
    Triton kernels on a GPU; "float64": float64 sums on a CPU), or name one. No C++ kernels, no oneDNN
    packing; float64 runs no static decode step either (fixed runs its kernels in it, CUDA graphs on a GPU):
    slower; bench/train_serve_gap.py (CPU) and bench/gpu.py --sections invariant (GPU) measure it."""
    speculative: str = "off"
    """Speculative decoding from text the server already has (serve/engine/speculation.py): suffix, ngram
    or off."""
    num_speculative_tokens: int = DEFAULT_TOKENS
    """Most draft tokens a sequence verifies in one step."""
    speculative_cache_tokens: int = DEFAULT_CACHE_TOKENS
    """Tokens of recent outputs the suffix drafter keeps (over all API keys, each drafting only from its
    own)."""
    speculative_adaptive: bool = True
    """Draft only where verifying is expected to pay; False: every proposal, up to num_speculative_tokens."""
    speculative_prefill: bool = True
    """Draft a prompt's first tokens too, verified in the prefill's forward (False: decode steps only)."""

    def __post_init__(self) -> None:
        self.spec = SpecConfig(self.speculative, self.num_speculative_tokens, self.speculative_cache_tokens,
                               self.speculative_adaptive, self.speculative_prefill)
        if self.quant not in ("auto", "none", "mxfp8"):
            raise ValueError(f"quant must be auto, none or mxfp8, not {self.quant!r}")
        if self.quant_dense not in ("none", "fp8"):
            raise ValueError(f"quant_dense must be none or fp8, not {self.quant_dense!r}")
        if self.quant_dense == "fp8" and self.batch_invariant:
            raise ValueError("quant_dense fp8 has no batch-invariant path: leave one of them off")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, not {self.load_format!r}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_batched_tokens < self.block_size:
            raise ValueError("block_size, max_num_seqs and max_batched_tokens must be positive "
                             "(and max_batched_tokens >= block_size)")


@dataclass
class IdleCall:
    """Work for the engine thread once no sequence is in flight (held like a weight load); the result, or
    the exception, comes back through `future`."""

    fn: Callable[[], object]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class NativeEngine(Engine):
    name = "native"

    def __init__(self, model_dir: str, config: EngineConfig | None = None):
        from serve.engine.hf import resolve_dtype

        c = self.config = config or EngineConfig()
        self.device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(c.dtype, self.device.type)
        self.serve_dtype = str(self.dtype).removeprefix("torch.")
        self.batch_invariant = bool(c.batch_invariant)
        self.quant = c.quant if c.quant != "auto" else ("mxfp8" if self.device.type == "cuda" else "none")
        self._inbox: queue.Queue = queue.Queue()
        self._reload: Reload | None = None  # the load waiting for the running sequences to finish
        self._held: list = []  # what came into the inbox after it: handled once the new weights are in
        self.kv_released = False  # release_kv_cache: requests wait in _held until restore_kv_cache
        self._kv_ptrs: list[int] = []
        self._load_lock = asyncio.Lock()  # one load at a time, so versions are checked against the latest
        self._stop = threading.Event()
        self._closed = False  # set by the engine thread as it ends; nothing enters the inbox after
        self._inbox_lock = threading.Lock()
        # The engine thread owns torch for the engine's lifetime: it loads and packs the model, then runs
        # every step. A model loaded on one thread and stepped on another gives libgomp two OpenMP pools,
        # and on a small CPU every op then pays a futex sleep/wake (a batch-8 step: ~29 ms -> ~45-51 ms).
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(model_dir, ready), name="native-engine", daemon=True)
        self._thread.start()
        ready.result()  # the load's exception, if any, raised here

    def _setup(self, model_dir: str) -> None:
        """On the engine thread: load and pack the model, size the KV cache, build scheduler and runner."""
        c = self.config
        if c.load_format == "dummy":
            from serve.model.dummy import random_model

            self.model = random_model(model_dir, device=self.device, dtype=self.dtype, quant=self.quant)
        else:
            self.model = load_model(model_dir, device=self.device, dtype=self.dtype, quant=self.quant,
                                    keep_fp8=self._keep_fp8())
        # float64 (served so that greedy output is the same on every CPU) runs torch's paths but for two
        # float64 kernels (a batch-1 step's attention, a few rows' experts): the other C++ kernels
        # accumulate in float32 and take bfloat16 or float32. Batch-invariant numerics: torch's paths only.
        self.kernels_wanted = (self.device.type == "cpu" and c.cpu_kernels and not c.batch_invariant
                               and self.dtype in (torch.bfloat16, torch.float32, torch.float64))
        built = cpu_ext.load() if self.kernels_wanted else None
        self.cpu_kernels = built if self.dtype != torch.float64 else None
        self.f64_kernels = built if self.dtype == torch.float64 else None  # few-query attention and experts
        self.packing = self._prepare(self.model)
        self.policy_version = read_policy_version(model_dir) or 0
        self.max_model_len = c.max_model_len or self.model.cfg.max_position_embeddings
        per_token = ModelRunner.kv_bytes_per_token(self.model, self.dtype)
        tokens = c.kv_cache_tokens or self._default_kv_tokens(per_token)
        if tokens < self.max_model_len and not c.kv_cache_tokens:
            raise ValueError(
                f"one {self.max_model_len}-token context needs {self.max_model_len * per_token / 2**30:.1f} GiB "
                f"of KV cache, more than this machine can spare ({tokens * per_token / 2**30:.1f} GiB); "
                "pass a smaller --max-model-len (e.g. 32768) or --kv-cache-tokens")
        num_blocks = max(tokens // c.block_size, -(-self.max_model_len // c.block_size) + 1)
        self.blocks = BlockManager(num_blocks, c.block_size, c.prefix_caching)
        self.scheduler = Scheduler(self.blocks, c.max_num_seqs, c.max_batched_tokens)
        static = c.static_decode if c.static_decode is not None else self.device.type == "cuda"
        fixed = self.model.batch_invariant == "fixed"  # its kernels run in the static step too (numerics)
        if c.batch_invariant and c.static_decode and not fixed:
            raise ValueError("the static decode step has no float64 batch-invariant path: leave static_decode unset")
        static = static and (fixed or not c.batch_invariant)
        self.spec = Speculator(c.spec, self.max_model_len) if c.spec.on else None
        self.runner = ModelRunner(self.model, num_blocks, c.block_size, self.device, self.dtype, self.cpu_kernels,
                                  StaticConfig(c.max_num_seqs, self.max_model_len, graphs=not c.enforce_eager,
                                               max_draft=c.spec.num_tokens if c.spec.on else 0)
                                  if static else None,
                                  few_query_kernel=getattr(self.f64_kernels, "few_query_attention", None))
        self.kv_cache_bytes = num_blocks * c.block_size * per_token

    def _prepare(self, model) -> str:
        """What every loaded model gets before it serves: batch-invariant numerics, or (on a CPU) the packed
        layouts of pack_for_cpu. Returns what packing did."""
        if self.config.batch_invariant:
            mode = model.set_batch_invariant(self.config.batch_invariant).batch_invariant
            return f"batch-invariant numerics ({'fixed-order kernels' if mode == 'fixed' else 'float64 sums, eager paths'})"
        dense = ""
        if self.config.quant_dense == "fp8":
            from serve.model.fp8 import quantize_dense

            n, err = quantize_dense(model, keep_fp8=self._keep_fp8())
            dense = (f"{n} dense layers in block FP8" + ("" if self._keep_fp8() else f" values (held in {self.serve_dtype})")
                     + f", relative RMS error <= {err:.4f}; ")
            log.info("--quant-dense fp8: %s", dense.rstrip("; "))
        done = model.pack_for_cpu(cpu_kernels=self.cpu_kernels or self.f64_kernels) \
            if self.device.type == "cpu" and self.config.cpu_pack \
            else ""
        if self.device.type == "cpu" and _dequantize_experts(model, self.dtype):
            narrow = next((m.w13.narrow for m in model.moe_layers() if getattr(m.w13, "narrow", None) is not None), None)
            done += ("; " if done else "") + f"MXFP8 experts also held in {self.serve_dtype}" \
                + (f" (and, for the expert kernel, exactly in {str(narrow.dtype).removeprefix('torch.')})"
                   if narrow is not None else "")
        return dense + done if done else dense.rstrip("; ")

    def _keep_fp8(self) -> bool:
        """FP8 dense layers run as FP8 (serve/model/fp8.py's kernel) on a GPU; a CPU holds their values."""
        return self.device.type == "cuda" and not self.config.batch_invariant

    def _default_kv_tokens(self, per_token: int) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(0, int(free * 0.9) - self._step_reserve()) // per_token
        return min(8 * self.max_model_len, _available_memory() // 4 // per_token)

    def _step_reserve(self) -> int:
        """GPU bytes kept out of the KV cache for a step's activations and the CUDA graphs' memory pool:
        what the largest decode step holds at once is dominated by its [B, V] sampling tensors (float32
        logits, scaled, sorted, probabilities, noise, logprobs; int64 hash and sort order: ~48 bytes per
        element), plus a prefill chunk's activations and the MoE buffers, bounded here by 1 GiB."""
        rows = max(self.config.max_num_seqs, 1)
        return rows * self.model.cfg.vocab_size * 48 + 2**30

    def weight_bytes(self) -> int:
        dense, experts = self.model.weight_bytes()
        return dense + experts

    def describe(self) -> str:
        dense, experts = self.model.weight_bytes()
        where = self.device.type
        if where == "cpu":
            n = torch.get_num_threads()
            where += f" ({n} thread{'s' if n != 1 else ''})"
        return (f"engine native, {where}, {self.dtype}, experts {self.quant}, weights "
                f"{(dense + experts) / 2**20:.1f} MiB (experts {experts / 2**20:.1f} MiB), KV cache "
                f"{self.kv_cache_bytes / 2**20:.1f} MiB ({len(self.blocks.blocks) * self.config.block_size} tokens)"
                + (f"; {self.packing}" if self.packing else "") + describe_checkpoint(self.model)
                + ("; decode attention: paged CPU kernel" if self.runner.cpu_kernels is not None else "")
                + ("; batch-1 decode and verify attention: float64 CPU kernel"
                   if self.runner.few_query_kernel is not None else "")
                + (f"; {self.runner.static.describe()}" if self.runner.static is not None else "")
                + ("; decode steps: every layer in one C++ call"
                   if self.model.decode_plan(self.runner.cpu_kernels) is not None else "")
                + (f"; {self.spec.describe()}" if self.spec is not None else "")
                + ("; CPU kernels not built yet (torch paths; `python -m kernels.cpu_ext` builds them)"
                   if self.kernels_wanted and self.cpu_kernels is None and self.f64_kernels is None else ""))

    def stats(self) -> EngineStats:
        waiting = len(self.scheduler.waiting) + self._inbox.qsize() + len(self._held)
        spec = self.spec
        return EngineStats(running=len(self.scheduler.running), waiting=waiting, kv_cache_usage=self.blocks.usage,
                           prefix_cache_hits=self.blocks.hit_tokens, prefix_cache_queries=self.blocks.query_tokens,
                           policy_version=self.policy_version, spec_drafted=spec.drafted if spec else 0,
                           spec_accepted=spec.accepted if spec else 0, spec_verifies=spec.verifies if spec else 0)

    def running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def _submit(self, item: Sequence | Reload) -> None:
        with self._inbox_lock:
            if self._closed:
                raise EngineStopped()
            self._inbox.put(item)

    async def generate(self, prompt_ids: list[int], params: SamplingParams):
        if not prompt_ids:
            raise ValueError("the prompt is empty: there is no token to continue from")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit in {self.max_model_len}")
        seq = Sequence(list(prompt_ids), params, asyncio.get_running_loop(), asyncio.Queue())
        seq.generator = make_generator(params, self.device)
        self._submit(seq)
        try:
            async for tok in drain(seq.out):
                yield tok
        finally:
            seq.cancelled.set()
            self._inbox.put(None)  # wake the loop so the slot is freed now

    async def load_weights(self, path: str, policy_version: int | None = None,
                           abort_in_flight: bool = False) -> WeightsLoaded:
        """See Engine.load_weights. The checkpoint's config is checked here first (cheap), so a wrong
        path neither waits for nor aborts anything; the load itself runs on the engine thread."""
        async with self._load_lock:
            folder = checkpoint_dir(path)
            version = next_version(self.policy_version, policy_version, folder)
            self._check_fits(folder)
            cmd = Reload(str(folder), version, abort_in_flight)
            self._submit(cmd)
            return await asyncio.wrap_future(cmd.future)

    def _check_fits(self, folder) -> None:
        try:
            cfg = ModelConfig.from_dir(folder)
            shard_files(folder)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightLoadError(f"{folder}: not a checkpoint this engine can load: {e}") from None
        # the shape must match; the dtype is cast anyway, and stored experts (plain or MXFP8) load either way
        running = {k: v for k, v in asdict(self.model.cfg).items() if k not in ("torch_dtype", "quantization_config")}
        if diff := config_mismatch(running, asdict(cfg)):
            raise WeightLoadError(f"{folder} does not fit the running model: {diff}")

    async def stop(self) -> None:
        """Stop the engine thread and wait for it to end (a step under way finishes first)."""
        self._stop.set()
        self._inbox.put(None)
        await join_worker(self._thread)

    # -- the engine thread ---------------------------------------------------------------------------

    def _run(self, model_dir: str, ready: concurrent.futures.Future) -> None:
        try:
            self._setup(model_dir)
        except BaseException as e:  # noqa: BLE001 - handed to the constructor, which raises it
            self._closed = True
            ready.set_exception(e)
            return
        ready.set_result(None)
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iterate()
                except Exception as e:  # noqa: BLE001 - no one sequence to blame: fail those in flight, go on
                    log.exception("engine iteration failed")
                    self._fail(self.scheduler.drop_all(), e)
        finally:
            self._close()

    def _iterate(self) -> None:
        self._drain_inbox(block=not self.scheduler.has_work() and self._reload is None)
        for seq in self.scheduler.drop_cancelled():
            self.runner.forget(seq)
            self._emit(seq, DONE)
        if self._reload is not None and not self.scheduler.has_work():
            if isinstance(self._reload, IdleCall):
                self._run_idle(self._reload)
            else:
                self._swap_weights(self._reload)
            return
        if self.spec is not None:
            try:
                self.spec.plan(self.scheduler.running, self._admissible(), self.scheduler.max_batched_tokens)
            except Exception:  # noqa: BLE001 - drafting is an optimisation: never a reason to fail requests
                log.exception("drafting failed: this step verifies no draft")
                for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                    seq.draft = []
        batch = self.scheduler.schedule()
        for seq, e in self.scheduler.take_failed():
            self._fail([seq], e)
        if batch:
            self._step(batch)

    def _admissible(self) -> list[Sequence]:
        """The waiting sequences the scheduler could admit this step (their prefills may verify drafts)."""
        room = self.scheduler.max_num_seqs - len(self.scheduler.running)
        return list(itertools.islice(self.scheduler.waiting, max(room, 0)))

    def _close(self) -> None:
        """The thread is ending: refuse new work, and answer everything still waiting so no caller hangs."""
        with self._inbox_lock:
            self._closed = True
        pending = [self._reload, *self._held]
        while not self._inbox.empty():
            pending.append(self._inbox.get_nowait())
        self._reload, self._held = None, []
        seqs = self.scheduler.drop_all() + [x for x in pending if isinstance(x, Sequence)]
        self._fail(seqs, EngineStopped())
        for cmd in pending:
            if isinstance(cmd, IdleCall):
                cmd.future.set_exception(EngineStopped())
            if isinstance(cmd, Reload):
                cmd.future.set_exception(WeightLoadError("the engine stopped before loading the weights", param=None))

    def _fail(self, seqs: list[Sequence], e: Exception) -> None:
        """End these requests with `e` (raised in each caller's task), freeing their blocks."""
        for seq in seqs:
            self._finish(seq)  # idempotent: dropped sequences are already finished
        self._emit_many([(s, x) for s in seqs for x in (e, DONE)])

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while True:
            self._accept(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _accept(self, item: Sequence | Reload | None) -> None:
        if item is None:  # a wake-up
            return
        if self._reload is not None or (self.kv_released and isinstance(item, Sequence)):
            self._held.append(item)
        elif isinstance(item, IdleCall):
            self._reload = item
        elif isinstance(item, Reload):
            self._reload = item
            if item.abort:
                item.aborted = self._abort_all(item.version)
        else:
            item.policy_version = self.policy_version
            self.scheduler.add(item)

    def _abort_all(self, new_version: int) -> int:
        gone = self.scheduler.drop_all()
        for seq in gone:
            self.runner.forget(seq)
        self._emit_many([(s, x) for s in gone for x in (RequestAborted(s.policy_version, new_version), DONE)])
        return len(gone)

    def _swap_weights(self, cmd: Reload) -> None:
        """With no sequence left: load the checkpoint into a new model (same device, dtype, quant and CPU
        packing as at start-up), swap it in, empty the prefix cache (its K/V came from the old weights),
        then let the held requests in. On failure the old model stays."""
        start = time.monotonic()
        try:
            if cmd.version <= self.policy_version:  # a load whose caller went away let another one pass
                raise WeightLoadError(f"policy_version must increase: {cmd.version} is not above the current "
                                      f"{self.policy_version}", param="policy_version")
            try:
                model = load_model(cmd.path, device=self.device, dtype=self.dtype, quant=self.quant,
                                   keep_fp8=self._keep_fp8())
            except Exception as e:  # noqa: BLE001 - any failure to read it is the caller's checkpoint's
                raise WeightLoadError(f"cannot load {cmd.path}: {type(e).__name__}: {e}") from None
            self._prepare(model)
            self.blocks.reset_prefix_cache()  # before the swap: if it refused, nothing would have changed
            old, self.model = self.model, model
            self.runner.set_model(model)
            self.policy_version = cmd.version
            del old
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            log.info("now serving %s as policy version %d", cmd.path, cmd.version)
            cmd.future.set_result(WeightsLoaded(cmd.version, time.monotonic() - start,
                                                0.0 if cmd.abort else start - cmd.queued_at, cmd.aborted))
        except Exception as e:  # noqa: BLE001 - reported to the caller; the old weights keep serving
            cmd.future.set_exception(e)
        finally:
            self._resume()

    def _resume(self) -> None:
        """After a reload or an idle call: what came in meanwhile is accepted, in arrival order."""
        self._reload = None
        held, self._held = self._held, []
        for item in held:
            self._accept(item)

    # -- in-process training (train/colocate.py) --------------------------------------------------------

    def call_idle(self, fn: Callable[[], object], timeout: float | None = None):
        """fn() on the engine thread once no sequence is in flight (requests that come meanwhile wait);
        returns its result or raises its exception. From any thread but the engine's own."""
        cmd = IdleCall(fn)
        self._submit(cmd)
        return cmd.future.result(timeout)

    def _run_idle(self, cmd: IdleCall) -> None:
        try:
            cmd.future.set_result(cmd.fn())
        except Exception as e:  # noqa: BLE001 - the caller's to handle; the engine serves on
            cmd.future.set_exception(e)
        finally:
            self._resume()

    def update_weights_in_place(self, copy: Callable[[object], object], version: int):
        """Run copy(model) on the engine thread with no sequence in flight: it writes new weights into the
        model's existing tensors (train/colocate.py copy_weights_), so every storage a CUDA graph or the CPU
        decode plan holds stays where it is. Then the prefix cache is emptied (its K/V came from the old
        weights) and `version` is served. Returns copy's result."""

        def do():
            if version < self.policy_version:
                raise WeightLoadError(f"policy_version must not go back: {version} < {self.policy_version}",
                                      param="policy_version")
            out = copy(self.model)
            self.model._decode_plan_for = None  # its float32 copies of the norms (bf16 models) are regathered
            self.blocks.reset_prefix_cache()
            self.policy_version = version
            return out

        return self.call_idle(do)

    def kv_tensors(self) -> list[torch.Tensor]:
        return [t for pair in self.runner.kv for t in pair]

    def release_kv_cache(self) -> int:
        """Free the KV cache's memory (the tensors stay, with empty storage) until restore_kv_cache; requests
        that come meanwhile wait. The prefix cache is emptied. Returns the bytes freed."""

        def do() -> int:
            if self.kv_released:
                return 0
            self.blocks.reset_prefix_cache()
            kv = self.kv_tensors()
            self._kv_ptrs = [t.data_ptr() for t in kv]
            freed = sum(t.untyped_storage().nbytes() for t in kv)
            for t in kv:
                t.untyped_storage().resize_(0)
            self.kv_released = True
            return freed

        return self.call_idle(do)

    def restore_kv_cache(self) -> dict:
        """Give the KV cache its memory back (zeroed: a masked padding row must not read NaN) and let held
        requests in. Where the memory came back at other addresses, the CUDA graphs that wrote the old ones
        are dropped (recaptured at their first step). Returns {"bytes", "moved"}."""

        def do() -> dict:
            if not self.kv_released:
                return {"bytes": 0, "moved": False}
            kv = self.kv_tensors()
            total = 0
            for t in kv:
                n = t.numel() * t.element_size()
                t.untyped_storage().resize_(n)
                t.zero_()
                total += n
            moved = [t.data_ptr() for t in kv] != self._kv_ptrs
            if moved and self.runner.static is not None:
                self.runner.static.set_model(self.model)  # drops the graphs captured on the old addresses
            self.kv_released = False
            return {"bytes": total, "moved": moved}

        return self.call_idle(do)

    def _step(self, batch: list[tuple[Sequence, int]]) -> None:
        verifying = any(seq.draft for seq, _ in batch)
        decodes = [seq.num_computed > 0 and seq.num_computed + 1 == len(seq) for seq, _ in batch]
        decoding, prefilling = all(decodes), not any(decodes)
        start = time.perf_counter()
        try:
            if self.runner.can_decode(batch):
                sampled, rows = [seq for seq, _ in batch], self.runner.decode(batch)
                logits = None
            else:
                sampled, logits = self.runner.run(batch)
                rows = None
        except Exception as e:  # noqa: BLE001 - find the culprit: nothing was committed, so a rerun is safe
            if len(batch) == 1:
                log.warning("a sequence failed in the forward pass: %s: %s", type(e).__name__, e)
                self._fail([batch[0][0]], e)
                return
            for seq, n in batch:  # each alone, a verifying one as a plain decode
                n, seq.draft = n - len(seq.draft), []
                self._step([(seq, n)])
            return
        if self.spec is not None and prefilling:  # what a draft row in a prefill costs
            self.spec.cost.observe_prefill(sum(n for _, n in batch), time.perf_counter() - start)
        for seq, n in batch:
            if not seq.draft:
                seq.num_computed += n
                self.blocks.register(seq)
            else:  # a prefill that verifies a draft: its tokens before the last are computed; the last and
                seq.num_computed += n - len(seq.draft) - 1  # the draft's count as their picks are kept
        if not sampled:
            return
        if verifying:
            if rows is None:  # host sampling: grammars mask each row
                rows = sample_verify(logits, sampled)
            per_seq = _split(rows, sampled)
            picks = [walk(seq, r) for seq, r in zip(sampled, per_seq, strict=True)]
        else:
            if rows is not None:
                flat = picks_of(rows, [s.params for s in sampled], [s.generator for s in sampled])
            else:
                flat = sample_batch(logits, [s.params for s in sampled], [s.generator for s in sampled],
                                    [s.matcher for s in sampled])  # grammars: masks per sequence
            picks = [[p] for p in flat]
        if self.spec is not None and decoding:  # the step cost model learns from decode and verify steps
            self.spec.cost.observe(sum(n for _, n in batch), time.perf_counter() - start + self.spec.plan_s)
        out: list[tuple[Sequence, object]] = []
        for seq, seq_picks in zip(sampled, picks, strict=True):
            try:
                out += self._emit_picks(seq, seq_picks)
            except Exception as e:  # noqa: BLE001 - that request fails alone; the others' tokens still go out
                log.exception("handling a sequence's new tokens failed")
                self._finish(seq)
                out += [(seq, e), (seq, DONE)]
        self._emit_many(out)

    def _emit_picks(self, seq: Sequence, picks: list) -> list[tuple[Sequence, object]]:
        """Append a sequence's new tokens (one, or a verified draft's kept ones) and stop where it ends."""
        out: list[tuple[Sequence, object]] = []
        draft, seq.draft = seq.draft, []
        kept = 0
        for i, pick in enumerate(picks):
            if isinstance(pick, Exception):
                self._finish(seq)
                return out + [(seq, pick), (seq, DONE)]
            token, logprob, top = pick
            seq.token_ids.append(token)
            kept += 1
            if draft:
                seq.num_computed += 1  # the row that produced this token: its K/V are the sequence's now
            tok = GenToken(token, logprob, top, seq.policy_version,
                           cached_tokens=seq.num_cached if seq.num_generated == 1 else None,
                           drafted=len(draft) if i == 0 else 0, accepted=i < len(draft) and token == draft[i])
            out.append((seq, tok))
            if (token in seq.params.stop_token_ids or seq.num_generated >= seq.params.max_tokens
                    or len(seq) >= self.max_model_len or seq.cancelled.is_set()):
                if draft:
                    self._verified(seq, draft, kept, picks)
                if seq.params.return_routed_experts and not seq.cancelled.is_set():  # before its blocks are freed
                    tok.routed_experts = self.runner.routes_of(seq)
                self._finish(seq)
                out.append((seq, DONE))
                return out
        if draft:
            self._verified(seq, draft, kept, picks)
        return out

    def _verified(self, seq: Sequence, draft: list[int], kept: int, picks: list) -> None:
        self.blocks.register(seq)
        accepted = sum(1 for i in range(min(kept, len(draft))) if picks[i][0] == draft[i])
        self.spec.verified(seq, len(draft), accepted)

    def _finish(self, seq: Sequence) -> None:
        if self.spec is not None and seq.spec is not None:
            try:
                self.spec.finished(seq)
            except Exception:  # noqa: BLE001 - a drafting cache's trouble must not keep a request from ending
                log.exception("adding a finished sequence to the draft cache failed")
                seq.spec = None
        seq.draft = []
        self.scheduler.finish(seq)
        self.runner.forget(seq)

    @staticmethod
    def _emit(seq: Sequence, item) -> None:
        NativeEngine._emit_many([(seq, item)])

    @staticmethod
    def _emit_many(items: list[tuple[Sequence, object]]) -> None:
        """One wake-up per event loop per step, however many sequences got a token: waking the API's
        loop once per token per sequence makes it fight the engine thread for the GIL."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for seq, item in items:
            if seq.loop is not None and seq.out is not None and not seq.loop.is_closed():
                by_loop.setdefault(seq.loop, []).append((seq.out, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)


def _dequantize_experts(model, dtype: torch.dtype, budget: int = 2**30) -> bool:
    """On a CPU, MXFP8 experts run torch's reference path, which dequantizes each expert a token picks at
    every step (half of a float64 decode step; and verifying a draft picks more of them). Where the dense
    copies are small (the built-in model's: 13 MiB in float64, and 3 MiB more in bfloat16 for the expert
    kernel: MXFP8Tensor.narrow), hold them once: the same values, so the same results bit for bit."""
    from kernels import MXFP8Tensor

    moes = [m for m in model.moe_layers() if isinstance(m.w13, MXFP8Tensor) and isinstance(m.w2, MXFP8Tensor)]
    size = torch.empty(0, dtype=dtype).element_size() + (2 if dtype == torch.float64 else 0)  # + `narrow`
    need = sum((m.w13.data.numel() + m.w2.data.numel()) * size for m in moes)
    if not moes or need > min(budget, _available_memory() // 8):
        return False
    for m in moes:
        m.w13, m.w2 = m.w13.with_dense(dtype), m.w2.with_dense(dtype)
    return True


def _available_memory() -> int:
    """Bytes of memory a new allocation can take (Linux: MemAvailable, which counts reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _split(rows: list[list[float]], seqs: list[Sequence]) -> list[list[list[float]]]:
    """A step's rows, per sequence (1 + len(draft) each)."""
    out, r = [], 0
    for seq in seqs:
        n = 1 + len(seq.draft)
        out.append(rows[r : r + n])
        r += n
    return out


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in puts:
        q.put_nowait(item)
