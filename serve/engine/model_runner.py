"""Turning a scheduled batch into one forward pass: flattened tokens, positions, cache slots, metadata.

Owns the KV cache: per layer one key and one value tensor of [num_blocks * block_size, G, C], indexed
by slot = block * block_size + offset. Sequences computing one token with context before it form the
padded decode group (a sequence verifying a draft adds a row per draft token, each attending up to
itself); everything else (prompt chunks) is a prefill slice. One block past the block
manager's (`pad_slot` onwards) takes the K/V of the padding rows of static decode steps.

Two step paths: `run` (any batch: prefill chunks and decodes; shapes follow the batch; the caller samples)
and `decode` (every sequence decodes its next token: serve/engine/static_decode.py, static shapes, CUDA
graphs on a GPU, sampling on the device), taken where `static` is set up and the batch is eligible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from serve.engine.sequence import Sequence
from serve.engine.static_decode import StaticDecoder
from serve.model.layers import AttnMeta, SeqSlice
from serve.model.qwen3_moe import Qwen3MoeModel


@dataclass(frozen=True)
class StaticConfig:
    """Decode steps through StaticDecoder: batches up to max_num_seqs, contexts up to max_model_len,
    CUDA graphs (on a GPU) or not."""

    max_num_seqs: int
    max_model_len: int
    graphs: bool
    max_draft: int = 0  # draft tokens a sequence may verify in one step (speculative decoding)


class ModelRunner:
    def __init__(self, model: Qwen3MoeModel, num_blocks: int, block_size: int, device: torch.device,
                 kv_dtype: torch.dtype, cpu_kernels: ModuleType | None = None, static: StaticConfig | None = None,
                 few_query_kernel: Callable | None = None):
        cfg = model.cfg
        self.model, self.block_size, self.device = model, block_size, device
        self.pad_slot = num_blocks * block_size
        slots = (num_blocks + 1) * block_size
        self.kv = [(torch.zeros(slots, cfg.num_key_value_heads, cfg.head_dim, dtype=kv_dtype, device=device),
                    torch.zeros(slots, cfg.num_key_value_heads, cfg.head_dim, dtype=kv_dtype, device=device))
                   for _ in range(cfg.num_hidden_layers)]
        self._offsets = torch.arange(block_size)
        # kernels/cpu_ext.py's module (CPU, where built): decode attention then reads the pages in place
        self.cpu_kernels = cpu_kernels
        # a float64 model's few-query attention in C++ (kernels/cpu_ext.py few_query_attention), where built
        self.few_query_kernel = few_query_kernel
        self._slot_cache: dict[int, tuple[list[int], torch.Tensor]] = {}
        # routing replay: per cache slot, the experts each MoE layer chose for the token there (a prefix-cache
        # hit keeps the routes of the pass that computed its K/V, as it keeps the K/V)
        moe = model.moe_layers()
        self.routes = (torch.full((slots, len(moe), cfg.num_experts_per_tok), -1, dtype=torch.int16, device=device)
                       if moe else None)
        self.static = None
        if static is not None:
            self.static = StaticDecoder(model, self.kv, self.routes, block_size, static.max_num_seqs,
                                        -(-static.max_model_len // block_size), self.pad_slot, device, static.graphs,
                                        static.max_draft)

    def set_model(self, model: Qwen3MoeModel) -> None:
        self.model = model
        if self.static is not None:
            self.static.set_model(model)

    def can_decode(self, batch: list[tuple[Sequence, int]]) -> bool:
        return self.static is not None and self.static.eligible(batch)

    def decode(self, batch: list[tuple[Sequence, int]]) -> list[list[float]]:
        """A step where every sequence decodes its next token (`can_decode`), verifying its draft if it has
        one, sampled on the device: per row (one per sequence, 1 + len(draft) for a verifying one) its
        picks row (sampling.pack_picks)."""
        return self.static.step([seq for seq, _ in batch])

    @staticmethod
    def kv_bytes_per_token(model: Qwen3MoeModel, kv_dtype: torch.dtype) -> int:
        c = model.cfg
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * torch.empty(0, dtype=kv_dtype).element_size()

    def _slots(self, seq: Sequence, upto: int) -> torch.Tensor:
        """Cache slots of the sequence's first `upto` tokens. Kept per sequence and extended as its
        block table grows (a decode step adds one block every block_size tokens, not a rebuild)."""
        blocks, slots = self._slot_cache.get(seq.id, ([], None))
        table = seq.block_table
        if slots is None or table[: len(blocks)] != blocks:  # new, or preempted and re-allocated
            blocks, slots = [], torch.empty(0, dtype=torch.long)
        if len(blocks) < len(table):
            new = torch.tensor(table[len(blocks):], dtype=torch.long)
            slots = torch.cat([slots, (new[:, None] * self.block_size + self._offsets).reshape(-1)])
            blocks = list(table)
            self._slot_cache[seq.id] = (blocks, slots)
        return slots[:upto]

    def routes_of(self, seq: Sequence) -> torch.Tensor | None:
        """The experts of the sequence's computed tokens: [T, M, K] on the CPU."""
        if self.routes is None:
            return None
        slots = self._slots(seq, seq.num_computed)
        return self.routes.index_select(0, slots.to(self.device)).cpu()

    def forget(self, seq: Sequence) -> None:
        self._slot_cache.pop(seq.id, None)

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Forward the batch; returns the sequences that get a new token and their logits [R, V]: one row
        each, or 1 + len(draft) rows for a sequence verifying a draft (serve/engine/speculation.py)."""
        ids, positions, slot_map = [], [], []
        prefill: list[SeqSlice] = []
        decode_rows, decode_slots, decode_lens, decode_tables = [], [], [], []
        sampled, logits_rows = [], []
        for seq, n in batch:
            start, row = seq.num_computed, len(ids)
            ids += seq.token_ids[start : start + n - len(seq.draft)] + seq.draft
            positions += range(start, start + n)
            slots_L = self._slots(seq, start + n)
            slot_map.append(slots_L[start:])
            if start > 0 and n == 1 + len(seq.draft) and start + 1 == len(seq) \
                    and (n == 1 or self.cpu_kernels is not None):
                # decode, or verify where the C++ kernel reads pages in place: a row per token, each attending
                # to the cache up to itself (the draft tokens before it included: every row's K/V are written
                # before attention reads). The torch path verifies as a prefill slice instead (causal over
                # the draft, offset by the cache): one gather of the context, not one per row.
                for i in range(n):
                    decode_rows.append(row + i)
                    decode_lens.append(start + 1 + i)
                    if self.cpu_kernels is not None:
                        decode_tables.append(seq.block_table)
                    else:
                        decode_slots.append(slots_L[: start + 1 + i])
            else:
                prefill.append(SeqSlice(row, n, start + n, slots_L.to(self.device)))
            if start + n == len(seq) + len(seq.draft):
                sampled.append(seq)
                logits_rows += range(row + n - 1 - len(seq.draft), row + n)
        dev = self.device
        meta = AttnMeta(slot_mapping_T=torch.cat(slot_map).to(dev), prefill=prefill,
                        decode_rows_B=torch.tensor(decode_rows, dtype=torch.long, device=dev), routes_SMK=self.routes,
                        few_query_kernel=self.few_query_kernel)
        if self.cpu_kernels is not None:
            width = max((len(t) for t in decode_tables), default=0)
            meta.cpu_kernels, meta.block_size = self.cpu_kernels, self.block_size
            meta.decode_tables_BN = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long)
            meta.decode_lens_B = torch.tensor(decode_lens, dtype=torch.long)
        else:
            longest = max(decode_lens, default=0)
            padded = torch.zeros(len(decode_slots), longest, dtype=torch.long)
            for i, s in enumerate(decode_slots):
                padded[i, : len(s)] = s
            mask = torch.arange(longest)[None, :] < torch.tensor(decode_lens, dtype=torch.long)[:, None]
            meta.decode_slots_BL, meta.decode_mask_B1L = padded.to(dev), mask[:, None, :].to(dev)
        if not sampled:  # only partial prefill chunks this step: run them, sample nothing
            logits_rows = [0]
        logits = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), meta, self.kv,
                            torch.tensor(logits_rows, dtype=torch.long, device=dev))
        return sampled, logits[: len(logits_rows) if sampled else 0]
