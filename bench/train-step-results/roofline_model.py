"""Roofline model (issue 58 analysis; `LAYERS=1|2 python bench/train-step-results/roofline_model.py`) of one trainer micro-batch at the Qwen3-30B-A3B layer shape, from the ops the CPU dispatches.

Runs the trainer's forward+backward on a CPU at the real layer widths (D 2048, 32x128 q heads, 4 kv heads,
I 768) with 8 experts top-8 (every expert active: per-pair work as at 128 experts top-8) and a 16,384 vocabulary,
at two token counts; fits each op's bytes and FLOPs linearly in tokens, extrapolates to 4,096 tokens (one
micro-batch), scales ops over expert weights x16 (128 experts) and ops over the vocabulary x 151936/16384, and
prices each op at max(bytes / BW, flops / PEAK) + a launch floor. Triton launches (MoE forward) are priced at
the H200 kernel figure (1.65 ms per layer at 4,096 tokens, bench/gpu-results). Host overhead is not modelled.
"""
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.mxfp8_linear  # noqa: F401  (patched below through sys.modules: kernels exports a function of that name)
from bench.train_step import make_samples
from kernels.launches import inside_launch, launch, on_launch
from kernels.op_count import FREE_OPS
from serve.model.config import QWEN3_30B_A3B
from train.trainer import Trainer, TrainerConfig

E, V, CHUNK = 8, 16384, 1639  # experts, vocabulary and slice here (10 slices, as 151,936 / 16,384)
BW, PEAK, FLOOR = 3.3e12, 600e12, 4e-6
OPTION = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}



def nb(t):
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors(y)


class Rec(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
        self.phase = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if inside_launch() or func.overloadpacket in FREE_OPS or func.is_view:
            return out
        ins = list(tensors(args)) + list(tensors(list((kwargs or {}).values())))
        outs = list(tensors(out))
        name = str(func.overloadpacket)
        flops = 0
        if name in ("aten.mm", "aten.addmm"):
            a, b = [t for t in ins if t.dim() == 2][-2:]
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif name == "aten._grouped_mm":
            a, b, o = ins[0], ins[1], outs[0]
            flops = 2 * o.numel() * b.shape[-2] if b.dim() == 3 else 2 * a.shape[0] * a.shape[1] * b.shape[1]
        def isE(t):
            return t.dim() == 3 and t.shape[0] == E and t.shape[1] in (1536, 2048, 768)
        def isV(t):
            return any(d in (V, CHUNK, V - 9 * CHUNK) for d in t.shape) and t.dim() == 2
        bE = sum(nb(t) for t in ins + outs if isE(t))
        bV = sum(nb(t) for t in ins + outs if not isE(t) and isV(t))
        byts = sum(nb(t) for t in ins + outs) - bE - bV
        fV = flops if any(isV(t) for t in ins + outs) else 0
        cls = (byts, bE, bV, flops - fV, fV)
        self.ops.append((self.phase, name, cls))
        return out


_ml = sys.modules["kernels.mxfp8_linear"]
_orig = _ml.moe_forward
def _moe_forward(*a, **k):  # the served MoE forward (Triton on the GPU): one priced "launch", its CPU ops left out
    with launch("moe_forward"):
        return _orig(*a, **k)
_ml.moe_forward = _moe_forward

def run(T):
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=int(os.environ.get("LAYERS", "1")), num_experts=E, vocab_size=V)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    rec = Rec()
    launches = []
    class Tr(Trainer):
        @contextlib.contextmanager
        def _phase(self, name):
            rec.phase = name
            yield
    t = Tr(folder, TrainerConfig(load_format="dummy", dtype="bfloat16", device="cpu", vocab_chunk=CHUNK,
                                 micro_batch_tokens=T, **OPTION))
    s = make_samples(V, 1, T)
    t.step(s, [1.0])
    with rec, on_launch(lambda n: launches.append((rec.phase, n))):
        t.step(s, [1.0])
    return [o for o in rec.ops if o[0] in ("forward", "backward")], launches

T1, T2, TT = 128, 256, 4096
a, la = run(T1)
b, lb = run(T2)
assert [x[1] for x in a] == [x[1] for x in b], "op sequences differ"



def price(TT):
    rows = []
    SV = 151936 / V
    for x, y in zip(a, b, strict=False):
        ext = [p + (q - p) / (T2 - T1) * (TT - T1) for p, q in zip(x[2], y[2], strict=False)]
        byts = ext[0] + 16 * ext[1] + SV * ext[2]
        fl = ext[3] + SV * ext[4]
        if x[1].startswith("aten._scaled_dot_product"):  # TT/2048 sequences of 2,048, causal
            fl = TT / 2048 * 2 * 2048 * 2048 / 2 * 32 * 128 * 2 * (2.5 if "backward" in x[1] else 1)
            byts = 4 * TT * (32 + 8) * 128 * 2
        rows.append((x[0], x[1], byts, fl, max(byts / BW, fl / PEAK) + FLOOR))
    fwd = sum(r[4] for r in rows if r[0] == "forward") + sum(1.65e-3 * TT / 4096 for ph, n in la if n == "moe_forward")
    bwd = sum(r[4] for r in rows if r[0] == "backward")
    return fwd, bwd, rows
for TT in (4096, 16384):
    f, bw, rows = price(TT)
    gb = sum(r[2] for r in rows) / 1e9
    print(f"LAYERS={os.environ.get('LAYERS', '1')} micro-batch {TT} tokens: forward {f*1e3:.1f} ms backward {bw*1e3:.1f} ms, {gb:.1f} GB, ops {len(rows)}")
