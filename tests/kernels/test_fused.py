"""The fused decode ops (kernels/fused.py): each Triton kernel (the interpreter on a CPU) against its torch
reference, each reference against the model's own modules (bit for bit), and for both paths: one launch,
no host synchronisation."""

from __future__ import annotations

import pytest
import torch

import serve.model.qwen3_moe as qwen3_moe
from kernels.backend import use_triton
from kernels.fused import add_rms_norm, qk_norm_rope_cache, router_topk
from kernels.launches import on_launch
from kernels.op_count import OpCounter
from serve.model.config import ModelConfig
from serve.model.layers import RMSNorm, Rotary, apply_rope

EPS = 1e-6
H, G, C = 4, 2, 32


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each value, in t's dtype (bfloat16 keeps 8 significant bits)."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}[t.dtype]
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64), torch.frexp(t.double()).exponent - bits)


def assert_close_to(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None,
                    f32_tol: float = 1e-6) -> None:
    """float32/64: ~1e-6 / 1e-12 relative. bfloat16: within one ulp, of the value or of `scale` (where the
    kernel's last op sums rounded terms larger than the result), and mostly bit-identical: a kernel that
    truncated instead of rounding would be off by one ulp in about half its values."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.cpu(), want.cpu()
    if want.dtype in (torch.float32, torch.float64):
        tol = f32_tol if want.dtype == torch.float32 else 1e-12
        mag = want.abs().max().item() if scale is None else scale.abs().max().item()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * mag)
        return
    allowed = _ulp(want) if scale is None else torch.maximum(_ulp(want), _ulp(scale.cpu()).expand_as(want))
    diff = (got.double() - want.double()).abs()
    assert (diff <= allowed).all(), f"max diff {diff.max().item()} beyond one ulp"
    assert (got == want).double().mean().item() >= 0.98


# ---------------------------------------------------------------- add_rms_norm


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("T", "D", "dtype"), [(3, 64, torch.float32), (5, 256, torch.bfloat16),
                                               (4, 96, torch.bfloat16), (3, 80, torch.float64)])
def test_add_rms_norm(T, D, dtype, with_residual, device):
    g = torch.Generator().manual_seed(D + with_residual)
    x_TD = torch.randn(T, D, generator=g).to(dtype).to(device)
    residual_TD = (torch.randn(T, D, generator=g) * 3).to(dtype).to(device) if with_residual else None
    norm = RMSNorm(D, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    norm = norm.to(dtype).to(device)

    want_out, want_sum = add_rms_norm(x_TD, residual_TD, norm.weight, EPS, backend="torch")
    with torch.inference_mode():  # the model: `x + residual`, then the module
        model_sum = x_TD if residual_TD is None else residual_TD + x_TD
        assert torch.equal(want_sum, model_sum)
        assert torch.equal(want_out, norm(model_sum))

    out_TD, sum_TD = add_rms_norm(x_TD, residual_TD, norm.weight, EPS, backend="triton")
    assert torch.equal(sum_TD, want_sum)  # one rounding of one add: exact
    if residual_TD is None:
        assert sum_TD is x_TD
    assert_close_to(out_TD, want_out)


def test_add_rms_norm_float32_weight_on_bf16(device):
    """weight float32, x bfloat16: out is float32 (torch promotes `weight * x`), the norm still rounds."""
    g = torch.Generator().manual_seed(1)
    x_TD = torch.randn(3, 128, generator=g).bfloat16().to(device)
    residual_TD = torch.randn(3, 128, generator=g).bfloat16().to(device)
    w_D = (torch.rand(128, generator=g) + 0.5).to(device)
    want_out, want_sum = add_rms_norm(x_TD, residual_TD, w_D, EPS, backend="torch")
    out_TD, sum_TD = add_rms_norm(x_TD, residual_TD, w_D, EPS, backend="triton")
    assert out_TD.dtype == torch.float32 and torch.equal(sum_TD, want_sum)
    assert_close_to(out_TD, want_out)


@pytest.mark.parametrize(("T", "K", "D", "dtype"), [(3, 4, 64, torch.float32), (5, 8, 96, torch.bfloat16),
                                                    (2, 2, 80, torch.float64)])
def test_add_rms_norm_sums_a_moe_layers_per_pair_rows(T, K, D, dtype, device):
    """x = a MoE layer's float32 per-pair rows [T, K, D]: the kernel sums them over K (the MoE path's
    `.sum(dim=1).to(dtype)`) and adds the residual in the same launch; the reference is that sum, then
    the usual add + RMSNorm."""
    g = torch.Generator().manual_seed(K * D)
    parts_TKD = torch.randn(T, K, D, generator=g).to(device)
    residual_TD = (torch.randn(T, D, generator=g) * 3).to(dtype).to(device)
    w_D = (torch.rand(D, generator=g) + 0.5).to(dtype).to(device)
    want_out, want_sum = add_rms_norm(parts_TKD, residual_TD, w_D, EPS, backend="torch")
    plain_out, plain_sum = add_rms_norm(parts_TKD.sum(1).to(dtype), residual_TD, w_D, EPS, backend="torch")
    assert torch.equal(want_sum, plain_sum) and torch.equal(want_out, plain_out)
    out_TD, sum_TD = add_rms_norm(parts_TKD, residual_TD, w_D, EPS, backend="triton")
    assert out_TD.dtype == sum_TD.dtype == dtype
    # the K-sum's order may differ from torch's in the last float32 bit, which a bf16 rounding can carry
    assert_close_to(sum_TD, want_sum, scale=want_sum)
    assert_close_to(out_TD, want_out, scale=want_out)


# ---------------------------------------------------------------- qk_norm_rope_cache


def _attention_inputs(T: int, dtype: torch.dtype, device: torch.device, seed: int, num_slots: int = 16):
    g = torch.Generator().manual_seed(seed)
    N = (H + 2 * G) * C
    qkv_full = (torch.randn(T, N + 8, generator=g) * 2).to(dtype).to(device)
    qkv_TN = qkv_full[:, :N]  # rows with a stride, as a view of a wider buffer
    norms = []
    for _ in range(2):
        n = RMSNorm(C, EPS)
        with torch.no_grad():
            n.weight.copy_(torch.rand(C, generator=g) + 0.5)
        norms.append(n.to(dtype).to(device))
    cfg = ModelConfig(vocab_size=8, hidden_size=64, num_hidden_layers=1, num_attention_heads=H,
                      num_key_value_heads=G, head_dim=C, intermediate_size=0, moe_intermediate_size=16,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    positions_T = torch.randint(0, 4096, (T,), generator=g).to(device)
    cos_TC, sin_TC = Rotary(cfg, device).cos_sin(positions_T, dtype)
    # Non-contiguous, unordered slots; every other row of the cache must stay as it was.
    slots_T = (torch.randperm(num_slots // 2, generator=g)[:T] * 2 + 1).to(device)
    k_cache = torch.randn(num_slots, G, C, generator=g).to(dtype).to(device)
    v_cache = torch.randn(num_slots, G, C, generator=g).to(dtype).to(device)
    return qkv_TN, norms, cos_TC, sin_TC, slots_T, k_cache, v_cache


def _model_prologue(qkv_TN, q_norm, k_norm, cos_TC, sin_TC, k_cache, v_cache, slots_T):
    """Attention.forward's torch path between the fused projection and attention, line for line."""
    T = qkv_TN.shape[0]
    with torch.inference_mode():
        q_TN, k_TN, v_TN = qkv_TN.split([H * C, G * C, G * C], dim=-1)
        q_THC = q_norm(q_TN.reshape(T, H, C))
        k_TGC = k_norm(k_TN.reshape(T, G, C))
        v_TGC = v_TN.reshape(T, G, C)
        q_THC, k_TGC = apply_rope(q_THC, cos_TC, sin_TC), apply_rope(k_TGC, cos_TC, sin_TC)
        k_cache.index_copy_(0, slots_T, k_TGC.to(k_cache.dtype))
        v_cache.index_copy_(0, slots_T, v_TGC.to(v_cache.dtype))
    return q_THC


@pytest.mark.parametrize("float32_weights", [False, True])
@pytest.mark.parametrize(("T", "dtype"), [(3, torch.float32), (5, torch.bfloat16)])
def test_qk_norm_rope_cache(T, dtype, float32_weights, device):
    qkv_TN, (q_norm, k_norm), cos_TC, sin_TC, slots_T, k_cache, v_cache = _attention_inputs(T, dtype, device, T)
    model_k, model_v = k_cache.clone(), v_cache.clone()
    want_q = _model_prologue(qkv_TN, q_norm, k_norm, cos_TC, sin_TC, model_k, model_v, slots_T)
    # The CPU prologue's convention: the norm weights as float32; the result must not change.
    q_w, k_w = (q_norm.weight.detach(), k_norm.weight.detach())
    if float32_weights:
        q_w, k_w = q_w.float(), k_w.float()

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = qk_norm_rope_cache(qkv_TN, q_w, k_w, EPS, cos_TC, sin_TC, ref_k, ref_v, slots_T, H, backend="torch")
    assert torch.equal(ref_q, want_q) and torch.equal(ref_k, model_k) and torch.equal(ref_v, model_v)

    got_k, got_v = k_cache.clone(), v_cache.clone()
    got_q = qk_norm_rope_cache(qkv_TN, q_w, k_w, EPS, cos_TC, sin_TC, got_k, got_v, slots_T, H, backend="triton")
    assert got_q.shape == (T, H, C) and got_q.dtype == dtype
    # The last op sums two rounded products: one ulp at the scale of the head's values.
    assert_close_to(got_q, want_q, scale=want_q.abs().amax(-1, keepdim=True))
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=device)
    untouched[slots_T] = False
    assert torch.equal(got_k[untouched], k_cache[untouched]) and torch.equal(got_v[untouched], v_cache[untouched])
    assert torch.equal(got_v, model_v)  # values are copied as they are
    assert_close_to(got_k[slots_T], model_k[slots_T], scale=model_k[slots_T].abs().amax(-1, keepdim=True))


def test_qk_norm_rope_cache_into_a_float32_cache(device):
    """A cache in another dtype gets the model-dtype k and v converted, as `.to(k_cache.dtype)` does."""
    qkv_TN, (q_norm, k_norm), cos_TC, sin_TC, slots_T, _, _ = _attention_inputs(4, torch.bfloat16, device, 9)
    caches = [torch.zeros(16, G, C, device=device) for _ in range(4)]
    args = (qkv_TN, q_norm.weight.detach(), k_norm.weight.detach(), EPS, cos_TC, sin_TC)
    want_q = qk_norm_rope_cache(*args, caches[0], caches[1], slots_T, H, backend="torch")
    got_q = qk_norm_rope_cache(*args, caches[2], caches[3], slots_T, H, backend="triton")
    assert_close_to(got_q, want_q, scale=want_q.abs().amax(-1, keepdim=True))
    assert torch.equal(caches[3], caches[1])
    # k was rounded to bfloat16 before the float32 cache got it: compare it as bfloat16.
    assert torch.equal(caches[2].bfloat16().float(), caches[2])
    assert_close_to(caches[2][slots_T].bfloat16(), caches[0][slots_T].bfloat16(),
                    scale=caches[0][slots_T].abs().amax(-1, keepdim=True).bfloat16())


def test_qk_norm_rope_cache_skips_slots_outside_the_cache(device):
    """A padded row of a CUDA-graph batch may carry slot -1: the kernel writes nothing for it."""
    qkv_TN, (q_norm, k_norm), cos_TC, sin_TC, slots_T, k_cache, v_cache = _attention_inputs(3, torch.float32,
                                                                                             device, 5)
    slots_T = slots_T.clone()
    slots_T[1] = -1
    slots_T[2] = k_cache.shape[0]
    got_k, got_v = k_cache.clone(), v_cache.clone()
    qk_norm_rope_cache(qkv_TN, q_norm.weight.detach(), k_norm.weight.detach(), EPS, cos_TC, sin_TC, got_k, got_v,
                       slots_T, H, backend="triton")
    row = slots_T[0].item()
    changed = [i for i in range(k_cache.shape[0]) if not torch.equal(got_k[i], k_cache[i])]
    assert changed == [row] and not torch.equal(got_v[row], v_cache[row])
    got_v[row] = v_cache[row]
    assert torch.equal(got_v, v_cache)


# ---------------------------------------------------------------- router_topk


def _distinct_logits(T: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of distinct values (a shuffled grid, spaced wider than a bfloat16 ulp), so top-k has no ties."""
    g = torch.Generator().manual_seed(seed)
    rows = [(torch.randperm(E, generator=g).double() - E / 2) * (6.0 / E) for _ in range(T)]
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("T", "E", "K", "dtype"), [(4, 16, 2, torch.float32), (5, 64, 8, torch.bfloat16),
                                                    (3, 48, 4, torch.float32), (3, 32, 4, torch.float64)])
def test_router_topk(T, E, K, dtype, renormalize, device, monkeypatch):
    cfg = ModelConfig(vocab_size=8, hidden_size=E, num_hidden_layers=1, num_attention_heads=H,
                      num_key_value_heads=G, head_dim=C, intermediate_size=0, moe_intermediate_size=16,
                      num_experts=E, num_experts_per_tok=K, norm_topk_prob=renormalize)
    moe = qwen3_moe.SparseMoE(cfg).to(dtype).to(device)
    with torch.no_grad():  # a permutation: the logits are x's distinct values, exactly
        moe.gate.weight.copy_(torch.eye(E)[torch.randperm(E, generator=torch.Generator().manual_seed(E))])
    x_TD = _distinct_logits(T, E, dtype, E).to(device)
    seen = {}

    def capture(x, ids_TK, weights_TK, *args, **kwargs):
        seen["ids"], seen["weights"] = ids_TK, weights_TK
        return x

    monkeypatch.setattr(qwen3_moe, "moe_forward", capture)  # SparseMoE.forward's routing, then stop
    with torch.inference_mode():
        moe(x_TD)
        logits_TE = moe.gate(x_TD)

    want_w, want_ids = router_topk(logits_TE, K, renormalize, backend="torch")
    assert torch.equal(want_ids, seen["ids"]) and torch.equal(want_w, seen["weights"])
    got_w, got_ids = router_topk(logits_TE, K, renormalize, backend="triton")
    assert got_ids.dtype == torch.int64 and got_w.dtype == dtype
    assert torch.equal(got_ids, want_ids)
    # A GPU's tl.exp is ex2.approx after a rounded multiply by log2(e): a few 1e-7 off torch's expf.
    assert_close_to(got_w, want_w, f32_tol=1e-6 if device.type == "cpu" else 4e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_router_topk_records_the_routes_at_each_tokens_slot(backend, device):
    """record=(routes, slots, m): the ids land at routes[slot, m] in the routes' dtype, nothing else moves;
    the kernel skips a slot outside the table (a padding row's), as it skips its K/V."""
    T, E, K, M, S = 4, 16, 4, 3, 10
    logits_TE = _distinct_logits(T, E, torch.float32, 5).to(device)
    routes_SMK = torch.full((S, M, K), -1, dtype=torch.int16, device=device)
    slots_T = torch.tensor([7, 2, 9, 0], device=device)
    w, ids = router_topk(logits_TE, K, True, record=(routes_SMK, slots_T, 1), backend=backend)
    want = torch.full((S, M, K), -1, dtype=torch.int16)
    want[slots_T.cpu(), 1] = ids.cpu().to(torch.int16)
    assert torch.equal(routes_SMK.cpu(), want)
    assert torch.equal((w, ids)[1], router_topk(logits_TE, K, True, backend=backend)[1])
    if backend == "triton":
        routes_SMK.fill_(-1)
        router_topk(logits_TE, K, True, record=(routes_SMK, torch.tensor([7, S, -1, 0], device=device), 2),
                    backend=backend)
        assert (routes_SMK[[7, 0], 2] >= 0).all() and (routes_SMK.cpu() >= 0).sum() == 2 * K


def test_router_topk_takes_the_lowest_index_among_ties(device):
    logits_TE = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]], device=device)
    _, ids_TK = router_topk(logits_TE, 4, True, backend="triton")
    assert ids_TK.tolist() == [[1, 3, 4, 2]]


# ---------------------------------------------------------------- graph-capture properties


def _calls(device: torch.device):
    """Each entry point with small inputs: (name, call(backend))."""
    qkv_TN, (q_norm, k_norm), cos_TC, sin_TC, slots_T, k_cache, v_cache = _attention_inputs(3, torch.bfloat16,
                                                                                             device, 2)
    x_TD = torch.randn(3, 64).bfloat16().to(device)
    w_D = torch.ones(64, dtype=torch.bfloat16, device=device)
    logits_TE = _distinct_logits(3, 16, torch.float32, 0).to(device)
    routes_SMK = torch.zeros(4, 2, 4, dtype=torch.int16, device=device)
    return [
        ("add_rms_norm", lambda b: add_rms_norm(x_TD, x_TD, w_D, EPS, backend=b)),
        ("add_rms_norm", lambda b: add_rms_norm(x_TD, None, w_D, EPS, backend=b)),
        ("qk_norm_rope_cache", lambda b: qk_norm_rope_cache(qkv_TN, q_norm.weight.detach(), k_norm.weight.detach(),
                                                            EPS, cos_TC, sin_TC, k_cache, v_cache, slots_T, H,
                                                            backend=b)),
        ("router_topk", lambda b: router_topk(logits_TE, 4, True, backend=b)),
        ("router_topk", lambda b: router_topk(logits_TE, 4, True, backend=b,
                                              record=(routes_SMK, torch.tensor([1, 0, 2], device=device), 1))),
        ("add_rms_norm", lambda b: add_rms_norm(torch.randn(3, 4, 64, device=device), x_TD, w_D, EPS, backend=b)),
    ]


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_one_launch_and_no_host_sync(backend, device):
    kernel = use_triton(device, backend)  # "auto": the kernel here (a GPU, or the interpreter the tests set)
    for name, call in _calls(device):
        launches: list[str] = []
        mode = OpCounter(strict=True)
        with torch.inference_mode(), on_launch(launches.append), mode:
            call(backend)
        assert launches == ([name] if kernel else []), name
        assert mode.total, "the mode saw no op: it was not watching"


def test_arguments_are_checked():
    x_TD = torch.randn(2, 8)
    with pytest.raises(ValueError, match="residual_TD"):
        add_rms_norm(x_TD, torch.randn(2, 4), torch.ones(8), EPS)
    with pytest.raises(TypeError, match="weight_D"):
        add_rms_norm(x_TD, None, torch.ones(8, dtype=torch.float64), EPS)
    with pytest.raises(ValueError, match="top_k"):
        router_topk(x_TD, 9, True)
    with pytest.raises(ValueError, match="per-pair rows"):
        add_rms_norm(torch.randn(2, 4, 8), None, torch.ones(8), EPS)
    with pytest.raises(ValueError, match="per-pair rows"):
        add_rms_norm(torch.randn(2, 4, 8).double(), x_TD, torch.ones(8), EPS)
    with pytest.raises(ValueError, match="routes"):
        router_topk(x_TD, 2, True, record=(torch.zeros(4, 2, 3, dtype=torch.int16), torch.tensor([0, 1]), 0))
    with pytest.raises(ValueError, match="routes"):
        router_topk(x_TD, 2, True, record=(torch.zeros(4, 2, 2, dtype=torch.int16), torch.tensor([0, 1]), 2))
    with pytest.raises(ValueError, match="slots"):
        router_topk(x_TD, 2, True, record=(torch.zeros(4, 2, 2, dtype=torch.int16), torch.tensor([0.0, 1.0]), 0))
    with pytest.raises(ValueError, match="width"):
        qk_norm_rope_cache(torch.randn(2, 5 * 8), torch.ones(8), torch.ones(8), EPS, torch.ones(2, 8),
                           torch.ones(2, 8), torch.zeros(4, 1, 8), torch.zeros(4, 1, 8), torch.tensor([0, 1]), 2)


# ---------------------------------------------------------------- the decode step built from them


def test_the_gpu_decode_step_gives_the_eager_forwards_logits_and_routes(device):
    """serve/model/decode.py along the GPU code path (here the Triton interpreter): ten kernels per layer,
    the routes recorded by the router kernel and the MoE's top-k sum done by the next add + RMSNorm. Its
    logits and recorded routes are the eager forward's (ModelRunner.run) for the same decode step."""
    from bench.decode_ops import BLOCK, SMALL, build, prefill
    from serve.model.decode import decode_forward

    if device.type != "cpu":
        pytest.skip("the CPU run is the interpreter's; a GPU runs this path in tests/serve")
    config = dict(SMALL, num_hidden_layers=2)
    model, blocks, runner = build(config, "mxfp8", 3, "cpu")
    seqs = prefill(blocks, runner, 3, config["vocab_size"])
    for s in seqs:
        assert blocks.ensure(s, len(s))
    kv_before = [(k.clone(), v.clone()) for k, v in runner.kv]
    _, want_BV = runner.run([(s, 1) for s in seqs])
    want_routes = runner.routes.clone()
    for (k, v), (k0, v0) in zip(runner.kv, kv_before, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    runner.routes.fill_(-1)
    pos = torch.tensor([len(s) - 1 for s in seqs])
    slots = torch.tensor([s.block_table[p // BLOCK] * BLOCK + p % BLOCK for s, p in zip(seqs, pos.tolist(), strict=True)])
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])
    launches: list[str] = []
    with on_launch(launches.append), OpCounter(strict=True):
        got_BV = decode_forward(model, torch.tensor([s.token_ids[-1] for s in seqs]), pos, slots, tables,
                                (pos + 1).int(), runner.kv, BLOCK, runner.routes)
    assert launches.count("router_topk") == config["num_hidden_layers"]
    torch.testing.assert_close(got_BV, want_BV, rtol=1e-4, atol=1e-4 * want_BV.abs().max().item())
    assert torch.equal(runner.routes[slots], want_routes[slots])


def test_the_eager_step_on_the_fused_kernels_gives_the_torch_paths_logits(monkeypatch, device):
    """A prefill (and then a decode) through ModelRunner.run with the fused q/k-norm-rope-cache and add +
    RMSNorm kernels, as a GPU runs them (forced here, under the interpreter), gives the logits of the same
    steps on their torch references, which a CPU runs."""
    from bench.decode_ops import SMALL, build, prefill

    if device.type != "cpu":
        pytest.skip("on a GPU the kernels are the default path, checked by tests/serve")
    config = dict(SMALL, num_hidden_layers=2)
    launches: list[str] = []
    got = []
    for backend in ("torch", "triton"):
        monkeypatch.setattr(qwen3_moe, "_fused_backend", lambda x, b=backend: b)
        _, blocks, runner = build(config, "none", 2, "cpu")
        with on_launch(launches.append):
            seqs = prefill(blocks, runner, 2, config["vocab_size"])
            for s in seqs:
                assert blocks.ensure(s, len(s))
            got.append(runner.run([(s, 1) for s in seqs])[1])
    assert launches.count("qk_norm_rope_cache") == launches.count("add_rms_norm") == 3 * 2
    torch.testing.assert_close(got[1], got[0], rtol=1e-4, atol=1e-4 * got[0].abs().max().item())
