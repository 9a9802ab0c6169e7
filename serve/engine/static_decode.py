"""The decode step with static shapes: persistent device buffers, one pure-device forward and sampling,
CUDA graphs per padded batch size, one transfer each way.

A step where every scheduled sequence computes its one next token (the common case while serving) goes
through `StaticDecoder.step`:
1. host: one int32 row per sequence (token id, position, cache slot, context length, sampling parameters,
   seed and draw number) and its block table are written into a (pinned) host buffer, the batch padded up
   to the next captured size with rows of length 0 whose K/V go to a slot nobody reads;
2. one host-to-device copy of that buffer into its persistent device twin;
3. the forward (serve/model/decode.py) and the sampler (serve/engine/sampling.py `sample_rows`) read only
   views of that twin and write one result tensor: replayed from a CUDA graph captured for this batch
   size and sampling mode, or run directly (CPU, `--enforce-eager`, or experts no graph can hold);
4. one device-to-host copy of the results [B, 3 + 2 * top_n] (ids, logprobs, a bad-row flag, top
   logprobs): the step's only synchronisation.

Graphs are captured lazily, at the first step that needs a (size, mode), into one shared memory pool;
sizes are 1, 2, 4, 8 then every multiple of 8 up to max_num_seqs (vLLM's ladder). A weight reload gives
the decoder a new model: the graphs of the old one are dropped and recaptured on demand.

A step that verifies drafts (serve/engine/speculation.py) is this step with a row per token: a
sequence's last token and then each draft token, at consecutive positions, sharing its block table;
every row's K/V are written before attention reads, so each draft token sees those before it. The
ladder of sizes then counts rows (up to max_num_seqs x (1 + draft tokens)), so verification is captured
like decoding, and still one transfer each way.

Limits: steps that mix prefill with decode, sequences with a grammar (structured output masks rows on
the host) and batches past max_num_seqs take the eager path (ModelRunner.run). Graphs need every kernel
of the forward to be capturable: MXFP8 experts through the Triton kernels are, and so are plain bf16
experts through torch's grouped GEMM on sm_90+ (kernels/moe_grouped.py); plain experts elsewhere run
torch's grouped reference, which synchronises, so with those the step runs without capture.
"""

from __future__ import annotations

import logging
import struct
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np
import torch

from kernels import MXFP8Tensor
from kernels.moe_grouped import grouped_available
from serve.engine.sampling import (
    GREEDY_BELOW,
    TOP_LOGPROBS_MAX,
    RowParams,
    SeedStream,
    needs_filter,
    pack_picks,
    sample_rows,
)
from serve.engine.sequence import Sequence
from serve.model.decode import decode_forward, fixed_decode_forward, prepare_for_decode
from serve.model.qwen3_moe import Qwen3MoeModel

log = logging.getLogger(__name__)

# the int32 fields of a row, in the host and device buffers ([FIELDS, B_max], one row per field)
ID, POS, SLOT, LEN, TOP_K, SEED_LO, SEED_HI, DRAWS, TEMP, TOP_P = range(10)
FIELDS = 10


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (itself included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


@dataclass(frozen=True)
class Mode:
    """What a step's sampler computes; one graph per (size, mode). Known on the host from the params."""

    sampled: bool  # some row has a temperature (else every row is argmax)
    filtered: bool  # some row uses top-k or top-p (sorts the vocabulary)
    top_n: int  # 0, or TOP_LOGPROBS_MAX when some row wants top logprobs


def _f32_bits(x: float) -> int:
    """The int32 with the bits of float32 `x`."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


class StaticDecoder:
    def __init__(self, model: Qwen3MoeModel, kv: list[tuple[torch.Tensor, torch.Tensor]], routes: torch.Tensor | None,
                 block_size: int, max_num_seqs: int, max_blocks: int, pad_slot: int, device: torch.device,
                 graphs: bool, max_draft: int = 0):
        self.kv, self.routes, self.block_size, self.device = kv, routes, block_size, device
        self.pad_slot = pad_slot
        # a row per token: max_num_seqs sequences, each with up to max_draft draft tokens when verifying
        self.sizes = capture_sizes(max_num_seqs * (1 + max_draft))
        self.max_blocks = max_blocks
        b_max = self.sizes[-1]
        pinned = device.type == "cuda"
        # one flat buffer: [FIELDS, B_max] fields, then [B_max, N] block tables; a step copies its used prefix
        self.host = torch.zeros(FIELDS * b_max + b_max * max_blocks, dtype=torch.int32, pin_memory=pinned)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros_like(self.host, device=device)
        # padding rows: no context (attention gives zeros), K/V to a slot nobody reads, greedy
        self._pad_row = (0, 0, pad_slot, 0, 0, 0, 0, 0, 0, _f32_bits(1.0))
        self.graphs_wanted = graphs and device.type == "cuda"
        self.graphs: dict[tuple[int, Mode], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.replays = 0  # steps served from a graph (for tests and the start-up line)
        self.steps = 0
        self.set_model(model)

    def set_model(self, model: Qwen3MoeModel) -> None:
        """Serve `model` from now on (a weight reload): graphs captured for the old one are dropped."""
        self.model = model
        if not model.batch_invariant:  # the fixed mode's step runs the layers' own projections (numerics)
            prepare_for_decode(model)
        self.graphs.clear()
        self._pool = None
        self.capturable = self.graphs_wanted and all(
            isinstance(m.w13, MXFP8Tensor) or grouped_available(m.w13.dtype, m.w13.device) for m in model.moe_layers())
        if self.graphs_wanted and not self.capturable:
            log.info("decode steps run without CUDA graphs: plain expert weights in this dtype on this GPU run "
                     "torch's grouped reference, which synchronises (serve MXFP8 or bf16 experts on sm_90+ for graphs)")

    def describe(self) -> str:
        if self.capturable:
            return f"decode steps: CUDA graphs for batch sizes {self.sizes[0]}..{self.sizes[-1]} ({len(self.sizes)} sizes)"
        return "decode steps: static buffers, no graphs"

    def eligible(self, batch: list[tuple[Sequence, int]]) -> bool:
        """Every sequence decodes its next token (one token with context before it, sampled this step) or
        verifies a draft after it, none has a grammar or asks more top logprobs than the API allows, and
        the rows fit the largest size."""
        if not batch or sum(n for _, n in batch) > self.sizes[-1]:
            return False
        for seq, n in batch:
            if n != 1 + len(seq.draft) or seq.num_computed == 0 or seq.num_computed + 1 != len(seq) \
                    or seq.matcher is not None or seq.params.top_logprobs > TOP_LOGPROBS_MAX:
                return False
        return True

    # -- one step -----------------------------------------------------------------------------------

    def step(self, seqs: list[Sequence]) -> list[list[float]]:
        """Decode one token for each sequence (and its draft's rows after it when it has one); returns each
        row's `pack_picks` row, in order (sampling.picks_of or speculation.walk make them picks and advance
        the sequences' streams)."""
        size, mode = self.prepare(seqs)
        out = self._replay(size, mode) if self.capturable else self._compute(size, mode)
        return self.finish(out, sum(1 + len(s.draft) for s in seqs))

    def prepare(self, seqs: list[Sequence]) -> tuple[int, Mode]:
        """Host side: fill the host buffer, padded to the next captured size, and copy it to the device in
        one transfer. Returns (padded size, mode)."""
        B = sum(1 + len(s.draft) for s in seqs)
        size = self.sizes[bisect_left(self.sizes, B)]
        params = [s.params for s in seqs]
        mode = Mode(sampled=any(p.temperature >= GREEDY_BELOW for p in params), filtered=needs_filter(params),
                    top_n=TOP_LOGPROBS_MAX if any(p.logprobs and p.top_logprobs for p in params) else 0)
        self._fill(seqs, size)
        used = FIELDS * self.sizes[-1] + size * self.max_blocks
        self.dev[:used].copy_(self.host[:used], non_blocking=True)
        return size, mode

    def finish(self, out: torch.Tensor, B: int) -> list[list[float]]:
        """The step's one device-to-host copy (and so its one synchronisation): the real rows' picks."""
        self.steps += 1
        return out[:B].tolist()

    def _fill(self, seqs: list[Sequence], size: int) -> None:
        """Write the rows through a NumPy view of the host buffer: host work only, no torch op dispatched.
        A row's new token is its last (position len - 1): its K/V go to that position's slot."""
        b_max, bs = self.sizes[-1], self.block_size
        fields = self.host_np[: FIELDS * b_max].reshape(FIELDS, b_max)
        tables = self.host_np[FIELDS * b_max :].reshape(b_max, self.max_blocks)
        row = 0
        for seq in seqs:
            p, stream = seq.params, seq.generator
            assert isinstance(stream, SeedStream)
            lo, hi = stream.halves
            # the last token, then the draft's: row i at position len - 1 + i, drawing draw number draws + i
            for i, tok in enumerate([seq.token_ids[-1], *seq.draft]):
                pos = len(seq) - 1 + i
                slot = seq.block_table[pos // bs] * bs + pos % bs
                fields[:, row] = (tok, pos, slot, pos + 1, min(p.top_k, 2**31 - 1), _i32(lo), _i32(hi),
                                  _i32((stream.draws + i) & 0xFFFFFFFF), _f32_bits(p.temperature), _f32_bits(p.top_p))
                tables[row, : len(seq.block_table)] = seq.block_table
                row += 1
        fields[:, row:size] = np.array(self._pad_row, dtype=np.int32)[:, None]

    def _compute(self, size: int, mode: Mode) -> torch.Tensor:
        """The step's device work for `size` rows, reading only the device buffer: what a graph captures."""
        b_max = self.sizes[-1]
        f = self.dev[: FIELDS * b_max].view(FIELDS, b_max)[:, :size]
        tables_BN = self.dev[FIELDS * b_max :].view(b_max, self.max_blocks)[:size]
        slots_B = f[SLOT].long()
        forward = fixed_decode_forward if self.model.batch_invariant else decode_forward
        logits_BV = forward(self.model, f[ID].long(), f[POS].long(), slots_B, tables_BN, f[LEN], self.kv,
                            self.block_size, self.routes)
        rows = RowParams(temperature_B=f[TEMP].view(torch.float32), top_k_B=f[TOP_K].long(),
                         top_p_B=f[TOP_P].view(torch.float32), seeds_B2=f[SEED_LO:SEED_HI + 1].T.long() & 0xFFFFFFFF,
                         draws_B=f[DRAWS].long() & 0xFFFFFFFF)
        return pack_picks(*sample_rows(logits_BV, logits_BV, rows, sampled=mode.sampled, filtered=mode.filtered,
                                       top_n=mode.top_n))

    def _replay(self, size: int, mode: Mode) -> torch.Tensor:
        key = (size, mode)
        if key not in self.graphs:
            try:
                self._capture(size, mode)
            except Exception:  # noqa: BLE001 - serve on without graphs rather than fail the requests
                log.exception("capturing a decode graph failed: decode steps run without CUDA graphs from now on")
                self.capturable = False
                return self._compute(size, mode)
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, size: int, mode: Mode) -> None:
        """Warm up (Triton compiles, cuBLAS picks its kernels) on a side stream, then capture. The warm-up
        runs this step's real inputs: it writes the same K/V and draws the same tokens the replay will."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._compute(size, mode)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._compute(size, mode)
        self._pool = graph.pool()
        self.graphs[(size, mode)] = (graph, out)
        log.info("captured a decode graph for batch size %d (%s)", size, mode)


def _i32(u: int) -> int:
    """An unsigned 32-bit value as the int32 with the same bits."""
    return u - 2**32 if u >= 2**31 else u
