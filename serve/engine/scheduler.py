"""Continuous batching with chunked prefill.

Each step has a token budget. Running sequences go first (a decode costs one token; an unfinished
prefill takes what the budget leaves), then waiting ones are admitted while blocks, the budget and
the sequence limit allow — so new requests join a running batch at the next step instead of waiting
for it to drain, and a long prompt is prefilled in chunks between other sequences' decodes. When
decode runs out of KV blocks, the most recently admitted sequence is preempted: its blocks are freed
and it is recomputed later (its tokens, generated ones included, are kept). A sequence whose admission
raises is set aside in `failed` for the engine to fail, so one bad request does not stop the step.
A sequence with a draft (serve/engine/speculation.py) computes its draft tokens too, after its last
token: a decoding one, and one whose prefill ends this step (its first token and the draft verified in
the prefill's forward). Drafts are trimmed to the budget (a prefill the budget cuts short drafts
nothing) and dropped before anyone is preempted for their blocks.
"""

from __future__ import annotations

from collections import deque

from serve.engine.block_manager import BlockManager
from serve.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.failed: list[tuple[Sequence, Exception]] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq)

    def take_failed(self) -> list[tuple[Sequence, Exception]]:
        failed, self.failed = self.failed, []
        return failed

    def drop_cancelled(self) -> list[Sequence]:
        return self._drop([s for s in list(self.waiting) + self.running if s.cancelled.is_set()])

    def drop_all(self) -> list[Sequence]:
        """Every sequence, waiting or running, finished now (an aborting weight load)."""
        return self._drop(list(self.waiting) + self.running)

    def _drop(self, gone: list[Sequence]) -> list[Sequence]:
        for s in gone:
            if s in self.waiting:
                self.waiting.remove(s)
                s.status = Status.FINISHED
            else:
                self.finish(s)
        return gone

    def schedule(self) -> list[tuple[Sequence, int]]:
        """[(sequence, tokens to compute this step)]."""
        budget = self.max_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted below
                continue
            _trim_draft(seq, budget)
            n = min(len(seq) - seq.num_computed + len(seq.draft), budget)
            if seq.draft and not self.blocks.ensure(seq, seq.num_computed + n):
                seq.draft = []  # memory is short: decode without the draft before preempting anyone
                n = min(len(seq) - seq.num_computed, budget)
            while not self.blocks.ensure(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            try:
                if not self.blocks.allocate(seq):
                    break
            except Exception as e:  # noqa: BLE001 - this sequence's fault (an empty prompt, say): set it aside
                self.waiting.popleft()
                seq.status = Status.FINISHED
                self.failed.append((seq, e))
                continue
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            _trim_draft(seq, budget)  # after the prefix cache said how much of the prompt is computed
            if seq.draft and not self.blocks.ensure(seq, len(seq) + len(seq.draft)):
                seq.draft = []
            n = min(len(seq) - seq.num_computed + len(seq.draft), budget)
            batch.append((seq, n))
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = seq.num_cached = 0
        seq.draft = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)


def _trim_draft(seq: Sequence, budget: int) -> None:
    """Keep the draft tokens that fit the step's budget after the sequence's own uncomputed tokens."""
    if seq.draft:
        del seq.draft[max(budget - (len(seq) - seq.num_computed), 0):]
