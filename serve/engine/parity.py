"""The native engine's logits along a given token sequence, for parity checks against another model.

`forced_logits(engine, ids, split)` prefills ids[:split] in one step, then feeds each later token as a
decode step (the engine's own eager path: ModelRunner.run), and returns the logits after each: what the
engine would sample from at every position of a sequence it is made to follow. Call it with no request in
flight (it steps the runner from the calling thread, beside an idle engine thread).
"""

from __future__ import annotations

import torch

from serve.engine.base import SamplingParams
from serve.engine.sequence import Sequence


def forced_logits(engine, ids: list[int], split: int) -> torch.Tensor:
    """Logits [len(ids) - split + 1, V]: after ids[:split] (one prefill), then after each later token."""
    seq = Sequence(ids[:split], SamplingParams(max_tokens=1, temperature=0.0))
    if not engine.blocks.allocate(seq):
        raise RuntimeError("no KV-cache room for the sequence")
    try:
        _, logits = engine.runner.run([(seq, split)])
        rows = [logits[0]]
        seq.num_computed = split
        for t in ids[split:]:
            seq.token_ids.append(t)
            if not engine.blocks.ensure(seq, len(seq)):
                raise RuntimeError("no KV-cache room for the sequence")
            _, logits = engine.runner.run([(seq, 1)])
            seq.num_computed += 1
            rows.append(logits[0])
    finally:
        engine.blocks.free(seq)
        engine.runner.forget(seq)
    return torch.stack(rows)
