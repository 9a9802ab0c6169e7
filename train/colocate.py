"""Colocated RL: composer-serve's native engine and the trainer in one process on one device, the new
weights handed to the engine in memory after every optimizer step (no checkpoint on the disk).

verl's hybrid engine is the model: one set of devices takes turns at sampling and training. Here the
turns of one synchronous step (`--max-staleness 0`) are:

1. rollouts through the real agent loop and tools, over loopback HTTP to the engine's own OpenAI API
   (the same app composer-serve runs, in a thread of this process);
2. `sleep`: the engine's KV cache is freed (its tensors keep their identity, their storage goes), so
   the trainer's step has that memory; requests that come meanwhile wait;
3. the trainer's optimizer step;
4. `hand_over`: the trainer's gradients are dropped (they are rebuilt by the next step) and every
   weight is copied into the engine's existing tensors (`copy_weights_`): dense weights cast to the
   serving dtype, q/k/v into the fused projection where the engine fused them, oneDNN-packed layers
   repacked and copied into their packed storage, block-FP8 layers quantized into theirs, MXFP8 experts quantized on the device (the same rule
   as a saved checkpoint's) into the engine's data and scale buffers, and their dense CPU copies and
   blocked CPU layouts rewritten. Nothing is reallocated, so CUDA graphs captured on those storages
   stay valid. The prefix cache is emptied and the engine serves the new policy version;
5. `wake`: the KV cache gets its memory back (zeroed). If it came back at other addresses the decode
   graphs are dropped and recaptured at their first step (counted in `wake`'s answer).

What the engine serves after a hand-over is, bit for bit, what it would load from the checkpoint the
disk path writes (tests/train/test_colocate.py checks every tensor). The disk path (`/v1/load_weights`)
stays for servers on other machines.

How others do it (read, not copied): verl's hybrid engine and TRL's `vllm_mode="colocate"` put vLLM in
the trainer's processes and call its sleep mode (level 1: weights offloaded, KV cache discarded) before
the update and `wake_up` after, then `load_weights` from the trainer's state dict; vLLM's sleep mode
allocates through its own CUDA virtual-memory pool (cuMemMap), so waking maps new pages under the same
addresses and its CUDA graphs survive. Our engine keeps its weights resident (the trainer's copy and the
engine's are both needed: float32 masters vs bf16/MXFP8 served), so only the KV cache sleeps.

Limits: synchronous RL only (an asynchronous run samples while the trainer steps, so the KV cache cannot
be freed); one process, one device (no FSDP). torch's caching allocator gives the KV cache's memory back
wherever it has room, not necessarily at the old addresses: then the decode graphs are captured again
(once per batch size, at first use); `wake` says whether it moved (`kv_moved`). On a CPU both run,
taking turns on the cores.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kernels import MXFP8Tensor, cpu_pack
from kernels.fp8_block import quantize_block_fp8
from kernels.moe import block_experts
from kernels.mxfp8 import dequantize_mxfp8_reference, quantize_mxfp8
from serve.model.fp8 import FP8Linear
from serve.model.qwen3_moe import DenseMLP, Qwen3MoeModel, SparseMoE

if TYPE_CHECKING:
    from serve.engine.native import NativeEngine
    from train.trainer import Trainer


@dataclass
class ColocateConfig:
    kv_cache_tokens: int | None = None
    """The engine's KV cache in tokens. Default: on a GPU what the colocated memory plan leaves once the
    trainer's resident state and the engine's weights are counted (train/memory_plan.py); on a CPU the
    engine's own default."""
    max_num_seqs: int = 64
    """Sequences the engine runs at once."""
    release_kv: bool = True
    """Free the KV cache while the trainer steps (off: it stays, and the plan counts it in the step)."""
    max_model_len: int | None = None
    """The engine's context length (default: the checkpoint's)."""
    static_decode: bool | None = None
    """The engine's decode steps through the static-shape step (EngineConfig.static_decode; default: on a
    GPU only). True on a CPU runs the GPU's step without capture (the tests hand over weights under it)."""

    def __post_init__(self) -> None:
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError("kv_cache_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")


# -- the copy ------------------------------------------------------------------------------------------


class _Count:
    def __init__(self) -> None:
        self.tensors = 0
        self.bytes = 0
        self.experts_quantized = 0

    def wrote(self, t: torch.Tensor) -> None:
        self.tensors += 1
        self.bytes += t.numel() * t.element_size()


def _tensor(dst: torch.Tensor, src: torch.Tensor, n: _Count) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"cannot hand over a {tuple(src.shape)} tensor into the engine's {tuple(dst.shape)}")
    dst.copy_(src)
    n.wrote(dst)


def _linear(dst: nn.Module, w: torch.Tensor, b: torch.Tensor | None, n: _Count) -> None:
    if isinstance(dst, cpu_pack.PackedLinear):  # oneDNN's blocked layout: pack anew, copy into the old storage
        new = cpu_pack.pack(w.to(dst.packed.dtype))
        if new.shape != dst.packed.shape:
            raise ValueError(f"packed weight {tuple(new.shape)} does not fit the engine's {tuple(dst.packed.shape)}")
        dst.packed.copy_(new)
        n.wrote(dst.packed)
    elif isinstance(dst, FP8Linear):  # block FP8 (--quant-dense fp8 on a GPU): quantized anew into its buffers
        data, scale_inv = quantize_block_fp8(w.detach(), dst.block)
        _tensor(dst.weight, data, n)
        _tensor(dst.weight_scale_inv, scale_inv.float(), n)
    elif isinstance(dst, nn.Linear):
        _tensor(dst.weight, w, n)
    else:
        raise TypeError(f"the engine holds a {type(dst).__name__} where a linear layer was expected")
    if (dst.bias is None) != (b is None):
        raise ValueError("the engine's and the trainer's layers disagree on a bias")
    if b is not None:
        _tensor(dst.bias, b, n)


def _experts(moe: SparseMoE, name: str, master: torch.Tensor, n: _Count) -> None:
    dst = getattr(moe, name)
    if isinstance(dst, MXFP8Tensor):
        if dst.shape != master.shape:
            raise ValueError(f"experts {tuple(master.shape)} do not fit the engine's {tuple(dst.shape)}")
        data, scales = quantize_mxfp8(master.detach())  # on the device; the rule a saved checkpoint uses
        dst.data.copy_(data)
        dst.scales.view(torch.uint8).copy_(scales.view(torch.uint8))
        n.wrote(dst.data)
        n.wrote(dst.scales)
        n.experts_quantized += 1
        if dst.dense is not None:  # the CPU's dequantized copy (serve/engine/native.py _dequantize_experts)
            dst.dense.copy_(dequantize_mxfp8_reference(data, scales, dst.dense.dtype))
            n.wrote(dst.dense)
    elif dst.dim() == 4:  # blocked for the CPU expert kernel (pack_for_cpu)
        _tensor(dst, block_experts(master.detach().to(dst.dtype), moe.cpu_kernels.moe_block_columns()), n)
    else:  # plain, or stored input-major (a transposed view): copy_ follows the strides
        _tensor(dst, master.detach(), n)


@torch.inference_mode()
def copy_weights_(dst: Qwen3MoeModel, src: Qwen3MoeModel) -> dict[str, int]:
    """Write `src`'s weights (the trainer's model: plain layout, any float dtype) into `dst`'s existing
    tensors (an engine's model, in its serving dtype and layouts: fused q/k/v, oneDNN-packed linears, MXFP8
    or blocked experts). Nothing in `dst` is reallocated. Returns counts: tensors, bytes, experts_quantized."""
    if dst.cfg.num_hidden_layers != src.cfg.num_hidden_layers or (dst.lm_head is None) != (src.lm_head is None):
        raise ValueError("the engine's model and the trainer's have different shapes")
    n = _Count()
    _tensor(dst.embed_tokens.weight, src.embed_tokens.weight, n)
    _tensor(dst.norm.weight, src.norm.weight, n)
    if dst.lm_head is not None:
        _linear(dst.lm_head, src.lm_head.weight, None, n)
    for d, s in zip(dst.layers, src.layers, strict=True):
        _tensor(d.input_layernorm.weight, s.input_layernorm.weight, n)
        _tensor(d.post_attention_layernorm.weight, s.post_attention_layernorm.weight, n)
        da, sa = d.self_attn, s.self_attn
        if sa.qkv_proj is not None:
            raise ValueError("the trainer's model has fused q/k/v: hand over from the plain layout")
        _tensor(da.q_norm.weight, sa.q_norm.weight, n)
        _tensor(da.k_norm.weight, sa.k_norm.weight, n)
        projs = (sa.q_proj, sa.k_proj, sa.v_proj)
        if da.qkv_proj is not None:  # fused by the engine (fuse_qkv): q, k, v stacked along the outputs
            bias = torch.cat([p.bias for p in projs]) if sa.q_proj.bias is not None else None
            _linear(da.qkv_proj, torch.cat([p.weight for p in projs]), bias, n)
        else:
            for dp, sp in zip((da.q_proj, da.k_proj, da.v_proj), projs, strict=True):
                _linear(dp, sp.weight, sp.bias, n)
        _linear(da.o_proj, sa.o_proj.weight, sa.o_proj.bias, n)
        if isinstance(s.mlp, SparseMoE):
            _linear(d.mlp.gate, s.mlp.gate.weight, None, n)
            _experts(d.mlp, "w13", s.mlp.w13, n)
            _experts(d.mlp, "w2", s.mlp.w2, n)
        elif isinstance(s.mlp, DenseMLP):
            for attr in ("gate_proj", "up_proj", "down_proj"):
                _linear(getattr(d.mlp, attr), getattr(s.mlp, attr).weight, None, n)
    return {"tensors": n.tensors, "bytes": n.bytes, "experts_quantized": n.experts_quantized}


# -- the engine in this process --------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Colocated:
    """The native engine on the trainer's device, serving the OpenAI API on a loopback port from a thread
    of this process (the interface of train/server.py's Server: base_url, model, api_key, version, stop),
    plus the turns of a colocated step: sleep, hand_over, wake."""

    def __init__(self, model_dir: str | Path, trainer: Trainer, config: ColocateConfig | None = None,
                 name: str = "policy"):
        from serve.engine.native import EngineConfig, NativeEngine

        if getattr(trainer, "world", None):
            raise ValueError("colocated training runs one process on one device: not with FSDP")
        self.config = c = config or ColocateConfig()
        self.trainer = trainer
        self.device = trainer.device
        kv_tokens = c.kv_cache_tokens
        self.plan = None
        if self.device.type == "cuda":
            from train.memory_plan import capacity_bytes

            self.plan = colocated_memory_plan(model_dir, trainer.memory_plan, serve_bytes=trainer.dtype.itemsize,
                                              mxfp8_experts=trainer.config.mxfp8_experts, config=c, on_gpu=True,
                                              capacity=capacity_bytes("cuda"))
            if kv_tokens is None:
                kv_tokens = self.plan.kv_tokens
        # random weights made on the device from config.json (no read of the checkpoint): the first
        # hand-over, below, gives the engine the trainer's own
        ec = EngineConfig(dtype=str(trainer.dtype).removeprefix("torch."),
                          quant="mxfp8" if trainer.config.mxfp8_experts else "none", device=str(self.device),
                          max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs, kv_cache_tokens=kv_tokens,
                          load_format="dummy", batch_invariant=trainer.config.batch_invariant,
                          static_decode=c.static_decode)
        self.engine: NativeEngine = NativeEngine(str(model_dir), ec)
        self.model = name
        self.api_key = "sk-colocated-" + secrets.token_hex(12)
        try:
            self.first_hand_over = self.hand_over()
            self._serve(Path(model_dir), name)
        except BaseException:
            asyncio.run(self.engine.stop())  # its thread would outlive this failed start
            raise

    def _serve(self, model_dir: Path, name: str) -> None:
        import uvicorn

        from serve.api import ServerState, create_app
        from serve.chat_format import ChatFormat

        state = ServerState(self.engine, ChatFormat(model_dir), name, self.engine.max_model_len, self.api_key,
                            str(model_dir), log_interval=0)
        sock = socket.socket(socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self._uvicorn = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning", access_log=False,
                                                      timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._uvicorn.serve(sockets=[sock])),
                                        name="colocated-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the colocated engine's API did not start")
            time.sleep(0.02)

    # -- the Server interface (train/server.py) ---------------------------------------------------------

    def version(self) -> int:
        return self.engine.policy_version

    def load_weights(self, path: str | Path, version: int) -> float:
        raise RuntimeError("a colocated engine takes its weights from the trainer in memory (hand_over), "
                           "not from a checkpoint")

    def stop(self) -> None:
        self._uvicorn.should_exit = True  # its lifespan stops the engine
        self._thread.join(30)

    # -- the turns of a step ----------------------------------------------------------------------------

    def sleep(self) -> dict[str, Any]:
        """Free the KV cache for the trainer's step (a no-op with release_kv off)."""
        t0 = time.perf_counter()
        freed = self.engine.release_kv_cache() if self.config.release_kv else 0
        if self.device.type == "cuda":
            _sync(self.device)
        return {"kv_freed_bytes": freed, "sleep_s": time.perf_counter() - t0}

    def hand_over(self) -> dict[str, Any]:
        """The trainer's current weights into the engine's tensors, served as its policy version."""
        t0 = time.perf_counter()
        tr = self.trainer
        tr.optimizer.zero_grad(set_to_none=True)  # rebuilt by the next step: their memory goes to the KV cache
        _sync(self.device)
        counts = self.engine.update_weights_in_place(lambda m: copy_weights_(m, tr.model), tr.policy_version)
        _sync(self.device)
        return counts | {"hand_over_s": time.perf_counter() - t0, "policy_version": tr.policy_version}

    def wake(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        got = self.engine.restore_kv_cache()
        _sync(self.device)
        return {"kv_restored_bytes": got["bytes"], "kv_moved": got["moved"], "wake_s": time.perf_counter() - t0}


# -- memory ------------------------------------------------------------------------------------------------


def colocated_memory_plan(model_dir: str | Path, train_plan, *, serve_bytes: int, mxfp8_experts: bool,
                          config: ColocateConfig, on_gpu: bool, capacity: float):
    """The trainer's plan (`train_plan`) with the engine beside it (train/memory_plan.py colocated_plan),
    checked against `capacity`: the KV cache gets what the rollout phase leaves unless config gives it.
    Raises PlanDoesNotFit."""
    from serve.model.config import ModelConfig
    from train.memory_plan import colocated_plan

    cfg = ModelConfig.from_dir(model_dir)
    # NativeEngine._step_reserve: the largest decode step's sampling tensors plus 1 GiB, on a GPU
    reserve = max(config.max_num_seqs, 1) * cfg.vocab_size * 48 + 2**30 if on_gpu else 0
    plan = colocated_plan(train_plan, cfg, serve_bytes=serve_bytes, mxfp8_experts=mxfp8_experts,
                          engine_reserve=reserve, kv_tokens=config.kv_cache_tokens, release_kv=config.release_kv,
                          capacity=capacity)
    plan.check(capacity)
    return plan
