"""A CPU step A/B in one process: one engine, a sequence with CONTEXT random tokens in its cache, then steps
of 1-9 query rows (a decode, or a draft of r - 1 tokens verified), arm A and arm B alternating step by
step (`use(arm)` switches the engine between them), thread CPU time per step, their log-probs checked to
agree to 1e-9 every step. bench/serve-results/lm_head_ab.py and f64_kernels_ab.py run it (issue 50).
`earlier_build` loads another build of the C++ kernels for a build-against-build A/B."""

from __future__ import annotations

import importlib.util
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

ROWS = (1, 2, 3, 5, 9)


def earlier_build(folder: str | Path) -> ModuleType:
    """The C++ kernels as another build left them: its folder under ~/.cache/composer/kernels (kernels/cpu_ext.py)."""
    so = next(Path(folder).glob("*.so"))
    spec = importlib.util.spec_from_file_location(so.stem, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_ab(engine, use: Callable[[str], None], steps: int, contexts: list[int], label: str = "") -> None:
    from serve.engine.base import SamplingParams
    from serve.engine.sequence import Sequence

    rng = random.Random(0)
    for context in contexts:
        s = Sequence([rng.randrange(10, 4000) for _ in range(context)], SamplingParams(max_tokens=64))
        engine.blocks.allocate(s)
        engine.runner.run([(s, context)])
        s.num_computed = context
        s.token_ids.append(5)
        engine.blocks.ensure(s, context + 20)
        res: dict[tuple[str, int], list[float]] = {(m, r): [] for m in "AB" for r in ROWS}
        for i in range(steps):
            for r in ROWS:
                draft = [rng.randrange(10, 4000) for _ in range(r - 1)]
                out = {}
                for m in "AB" if i % 2 else "BA":
                    use(m)
                    s.draft = list(draft)
                    t = time.thread_time()
                    _, lg = engine.runner.run([(s, r)])
                    out[m] = torch.log_softmax(lg, -1)
                    if i >= 3:
                        res[(m, r)].append(time.thread_time() - t)
                assert (out["A"] - out["B"]).abs().max() < 1e-9
        for r in ROWS:
            a, b = res[("A", r)], res[("B", r)]
            print(f"{label}context {context}, rows {r}: before {statistics.median(a) * 1e3:.2f} ms (min {min(a) * 1e3:.2f}), "
                  f"now {statistics.median(b) * 1e3:.2f} ms (min {min(b) * 1e3:.2f}): "
                  f"{statistics.median(b) / statistics.median(a):.3f}x", flush=True)
        engine.blocks.free(s)
