"""bench/train_step.py's side-by-side options and profiled step at a tiny shape (the GPU run's code, on a CPU)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_an_option_is_measured_named_and_profiled():
    from bench.train_step import OPTIONS, measure

    r = measure("reduced", layers=1, seqs=1, length=16, steps=1, option="fused-expert-backward", profile=True,
                log=lambda *_: None)
    assert r["option"] == "fused-expert-backward" and r["trainer_options"] == OPTIONS["fused-expert-backward"]
    assert r["step_s"] > 0 and 0 < r["mfu"] < 1
    head, *rows = r["profile_top_ops"]
    assert head["op"] == "(step)" and head["wall_ms"] > 0
    assert rows and all(x["kind"] == "op" and x["self_ms"] >= 0 for x in rows)
    # real work is listed: matrix products (the expert backward's are grouped GEMMs where torch._grouped_mm
    # passed its check in this process, else a loop of mm: which one is kernels/moe_grouped.py's business)
    assert any(x["op"] in ("aten::_grouped_mm", "aten::mm", "aten::addmm", "aten::bmm") for x in rows)
    with pytest.raises(ValueError, match="unknown option"):
        measure("reduced", layers=1, seqs=1, length=8, steps=1, option="fast")
