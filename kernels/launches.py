"""Counting kernel launches along the GPU code path, on any device.

Every Triton launch of ours runs inside `launch(name)`. On a GPU that costs one context manager per
launch (and nothing at all inside a CUDA graph replay, which runs no Python). Its use is the op counter
(kernels/op_count.py): a TorchDispatchMode sees every aten op a decode step dispatches, but under
the Triton interpreter a kernel launch also dispatches the interpreter's own copies of its arguments;
`inside_launch()` tells the counter to leave those out, and the hooks count the launch itself once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.hooks: list[Callable[[str], None]] = []


_state = _State()


@contextmanager
def launch(name: str) -> Iterator[None]:
    """Wrap one kernel launch: hooks hear `name` once, and ops dispatched inside are the launch's own."""
    for hook in _state.hooks:
        hook(name)
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1


def inside_launch() -> bool:
    return _state.depth > 0


@contextmanager
def on_launch(hook: Callable[[str], None]) -> Iterator[None]:
    """Call `hook(name)` for every launch on this thread while the block runs."""
    _state.hooks.append(hook)
    try:
        yield
    finally:
        _state.hooks.remove(hook)
