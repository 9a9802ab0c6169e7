"""Counting what a step dispatches, on any device: ops, kernel launches, host synchronisations, shapes.

`OpCounter` is a TorchDispatchMode: every aten op that reaches a kernel passes through it. It counts
them (views and other metadata-only ops left out: they launch nothing), counts our Triton launches once
each (kernels/launches.py; the Triton interpreter's own argument copies inside a launch are left out),
and records the ops that make a GPU wait for the host or produce a shape only the data decides
(`SYNC_OPS`); `strict=True` raises at the first one, with the op named. `signature` is the sequence of
(op, input shapes): a step whose signature is the same for every context length has static shapes, the
property a CUDA graph needs.

Run on a CPU along the GPU code path (MXFP8 experts through the Triton kernels under TRITON_INTERPRET=1,
no C++ CPU kernels), the counts are the kernels a GPU step launches (bench/gpu.py and the tests use it).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.launches import inside_launch, on_launch

aten = torch.ops.aten

# ops that copy a value to the host (the GPU stream waits) or whose output shape depends on the data
SYNC_OPS = {aten._local_scalar_dense, aten.item, aten.nonzero, aten.nonzero_static, aten.masked_select,
            aten.unique_consecutive, aten._unique, aten._unique2, aten.unique_dim, aten.bincount,
            aten.repeat_interleave, aten.is_nonzero, aten.equal, aten.allclose}
# ops that launch nothing: shape metadata, or a fresh tensor's wrapper
FREE_OPS = {aten.detach, aten.alias, aten.lift_fresh, aten._unsafe_view, aten.t, aten.transpose, aten.permute,
            aten.view, aten.reshape, aten.expand, aten.slice, aten.select, aten.unsqueeze, aten.squeeze,
            aten.as_strided, aten.split, aten.split_with_sizes, aten.unbind, aten.view_as_real, aten.empty,
            aten.empty_like, aten.empty_strided, aten.sym_size, aten.sym_stride, aten.sym_numel, aten.dim,
            aten.is_same_size, aten.resize_, aten.promote_types, aten.result_type, aten.new_empty,
            aten.new_empty_strided}


class HostSync(RuntimeError):
    """A host-synchronising or data-dependent-shape op ran where none may."""


class OpCounter(TorchDispatchMode):
    def __init__(self, strict: bool = False):
        super().__init__()
        self.strict = strict
        self.ops: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.signature: list[tuple[str, tuple]] = []
        self._hooks: list = []

    def _launch(self, name: str) -> None:
        self.launches[name] += 1
        self.signature.append((f"launch:{name}", ()))

    def __enter__(self):
        hook = on_launch(self._launch)
        hook.__enter__()
        self._hooks.append(hook)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._hooks.pop().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not inside_launch():
            packet = func.overloadpacket
            if packet in SYNC_OPS:
                self.syncs[str(packet)] += 1
                if self.strict:
                    raise HostSync(f"{func} synchronises with the host or has a data-dependent shape")
            if packet not in FREE_OPS and not func.is_view:
                self.ops[str(packet)] += 1
                shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
                self.signature.append((str(func), shapes))
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Kernels dispatched: aten ops that do work, plus Triton launches."""
        return sum(self.ops.values()) + sum(self.launches.values())
