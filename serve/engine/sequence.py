"""A request inside the native engine: its tokens, where its KV lives, and how far it has got."""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from serve.engine.base import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop | None = None
    out: asyncio.Queue | None = None
    id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # of those, how many came from the prefix cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    cancelled: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator | None = None
    policy_version: int = 0  # stamped when the engine accepts it; weights never change under it
    matcher: Any = None  # its grammar's state (serve/structured.py), advanced by each sampled token
    draft: list[int] = field(default_factory=list)  # tokens to verify after its last one this step
    spec: Any = None  # its drafting state (serve/engine/drafter.py SeqDrafter), while speculation is on

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.params.grammar is not None and self.matcher is None:
            self.matcher = self.params.grammar.matcher()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
