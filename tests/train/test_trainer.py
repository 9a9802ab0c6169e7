"""The trainer against a real composer-serve: equal log-probs at equal weights, checkpoints that serve,
resume that continues bit for bit, and an export transformers loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agent.tasks import Task
from tests.serve.conftest import start_server
from train.rollout import RolloutConfig, run_episode
from train.trainer import Trainer, TrainerConfig


def rollout_samples(ckpt, workspace, n: int = 2):
    srv = start_server(ckpt, "--served-model-name", "policy", "--dtype", "float32")
    try:
        task = Task("t", "say hello", "true", workspace=str(workspace), max_turns=2)
        cfg = RolloutConfig(srv.base_url, "policy", max_output_tokens=32)
        eps = [run_episode(task, 0, cfg) for _ in range(n)]
    finally:
        srv.stop()
    assert all(ep.infra_error is None for ep in eps), [ep.infra_error for ep in eps]
    return [s for ep in eps for s in ep.samples]


@pytest.mark.parametrize("mxfp8", [False, True], ids=["fp32-experts", "mxfp8-experts"])
def test_trainer_logprobs_equal_sampler_logprobs(tiny, tmp_path, mxfp8):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("x = 1\n")
    served = tiny
    if mxfp8:  # the checkpoint the trainer saves, experts stored in MXFP8, is what the server loads
        served = Trainer(tiny, TrainerConfig(mxfp8_experts=True)).save(tmp_path / "mx", resumable=False)
        assert (served / "composer_policy.json").exists()
    samples = rollout_samples(served, ws)
    assert sum(s.sampled_tokens for s in samples) > 20
    for s in samples:  # the server's experts for every token it read: all but the last sampled one
        assert s.routes.shape == (len(s.token_ids), 2, 2)
        assert (s.routes[:-1] >= 0).all() and (s.routes[-1] == -1).all()
    # With them replayed, a near-tied router choice that rounds the other way here (another CPU, other
    # kernels) cannot move the log-probs: one flip moves every later token's by ~1e-4.
    trainer = Trainer(served, TrainerConfig(mxfp8_experts=mxfp8))
    for s, lp in zip(samples, trainer.logprobs(samples), strict=True):
        m = torch.tensor(s.mask[1:]) > 0
        gap = (lp[m] - torch.tensor(s.sampler_logprobs[1:])[m]).abs()
        assert float(gap.max()) <= 1e-4, float(gap.max())
    m = trainer.step(samples, [1.0, -1.0] * (len(samples) // 2) + [0.5] * (len(samples) % 2))
    assert m["logprob_gap_max"] <= 1e-4 and trainer.policy_version == 1
    assert m["routes_replayed"] == sum(2 * (len(s.token_ids) - 1) for s in samples)
    assert m["routes_differ"] <= 2  # at equal weights the trainer's own choice is the server's but for ties


def test_replayed_routes_act_at_their_own_position_only(tiny):
    """Experts given for one token change the log-probs from that position on and none before it; with
    replay off they change nothing."""
    samples = fixed_samples(tiny)[:1]
    s = samples[0]
    t = len(s.token_ids) // 2
    base = Trainer(tiny, TrainerConfig(mxfp8_experts=False)).logprobs(samples)[0]
    own = routes_at(tiny, s.token_ids)
    s.routes = np.full((len(s.token_ids), 2, 2), -1, dtype=np.int16)
    s.routes[t, 0] = [e for e in range(8) if e not in own[t, 0]][:2]  # two experts the router did not pick
    replayed = Trainer(tiny, TrainerConfig(mxfp8_experts=False)).logprobs(samples)[0]
    assert torch.equal(replayed[:t], base[:t])  # lp[j] scores token j+1 from positions <= j
    assert (replayed[t:] - base[t:]).abs().min() > 0
    off = Trainer(tiny, TrainerConfig(mxfp8_experts=False, replay_routes=False)).logprobs(samples)[0]
    assert torch.equal(off, base)
    s.routes = np.concatenate([own.numpy().astype(np.int16)])  # the router's own choice: nothing changes
    same = Trainer(tiny, TrainerConfig(mxfp8_experts=False)).logprobs(samples)[0]
    assert torch.allclose(same, base, atol=1e-6)


def routes_at(model_dir, ids: list[int]) -> torch.Tensor:
    """The trainer's own top-k experts [T, M, K] for `ids`."""
    trainer = Trainer(model_dir, TrainerConfig(mxfp8_experts=False))
    picked = []
    hooks = [moe.gate.register_forward_hook(lambda mod, inp, out: picked.append(out.softmax(-1).topk(2).indices))
             for moe in trainer.model.moe_layers()]
    with torch.no_grad():
        trainer.model.forward_train(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(picked, 1)


def fixed_samples(tiny):
    from serve.chat_format import ChatFormat
    from train.samples import Sample

    chat = ChatFormat(tiny)
    out = []
    for i, text in enumerate(["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
                              "class A:\n    pass\n"]):
        s = Sample("e", i)
        s.extend(chat.encode("<|im_start|>user\nwrite code<|im_end|>\n<|im_start|>assistant\n"), sampled=False)
        ids = chat.encode(text)
        s.extend(ids, sampled=True, logprobs=[-2.0] * len(ids))
        s.versions = [0]
        out.append(s)
    return out


def test_resume_continues_bit_for_bit(tiny, tmp_path):
    samples, advs = fixed_samples(tiny), [1.0, -0.5, -0.5]
    straight = Trainer(tiny, TrainerConfig(lr=1e-3))
    for _ in range(3):
        straight.step(samples, advs)
    first = Trainer(tiny, TrainerConfig(lr=1e-3))
    first.step(samples, advs)
    ckpt = first.save(tmp_path / "step-1", state={"next_batch": 1})
    resumed = Trainer(tiny, TrainerConfig(lr=1e-3))
    assert resumed.resume(ckpt)["next_batch"] == 1 and resumed.policy_version == 1
    for _ in range(2):
        resumed.step(samples, advs)
    before = dict(Trainer(tiny, TrainerConfig()).model.named_parameters())
    changed = 0
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        changed += not torch.equal(a, before[name])
    assert changed > 0


def test_adam_eps_reaches_the_optimizer(tiny):
    samples, advs = fixed_samples(tiny), [1.0, -0.5, -0.5]
    moved = {}
    for eps in (1e-8, 1.0):  # eps far above every gradient: the step becomes ~lr * gradient, i.e. tiny
        tr = Trainer(tiny, TrainerConfig(lr=1e-3, eps=eps))
        before = [p.detach().clone() for p in tr.params]
        tr.step(samples, advs)
        moved[eps] = max(float((p.detach() - b).abs().max()) for p, b in zip(tr.params, before, strict=True))
    assert moved[1e-8] > 5e-4 and moved[1.0] < moved[1e-8] / 100, moved
    with pytest.raises(ValueError, match="eps"):
        TrainerConfig(eps=0.0)


def test_train_only_moves_the_named_parameters_alone(tiny):
    samples, advs = fixed_samples(tiny), [1.0, -0.5, -0.5]
    tr = Trainer(tiny, TrainerConfig(lr=1e-2, train_only=("norm",)))
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.step(samples, advs)
    moved = {n for n, p in tr.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    norms = {n for n in before if "norm" in n}
    assert moved == norms and len(tr.params) == len(norms), (moved, norms)
    with pytest.raises(ValueError, match="matches no parameter"):
        Trainer(tiny, TrainerConfig(train_only=("no_such_weight",)))


def test_kl_penalty_pulls_the_policy_back_to_where_it_started(tiny):
    """With kl_coef > 0 the trainer scores each batch with the frozen starting weights: the KL is 0 at the
    start, grows as advantages move the policy, and steps with no advantage bring it back."""
    from train.algo import LossConfig

    samples, advs = fixed_samples(tiny), [1.0, -0.5, -0.5]
    tr = Trainer(tiny, TrainerConfig(lr=3e-3), loss=LossConfig(kl_coef=1.0))
    assert tr.step(samples, advs)["loss_kl_mean"] < 1e-9
    for _ in range(3):
        tr.step(samples, advs)
    away = tr.step(samples, [0.0] * 3)["loss_kl_mean"]
    kls = [tr.step(samples, [0.0] * 3)["loss_kl_mean"] for _ in range(6)]
    assert away > 1e-3 and kls[-1] < away / 2, (away, kls)
    plain = Trainer(tiny, TrainerConfig(lr=3e-3))  # no KL: no reference model, no KL term
    assert plain.ref_model is None and "loss_kl_mean" not in plain.step(samples, advs)


def test_export_loads_in_transformers_and_matches(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from train.checkpoint import export_hf

    trainer = Trainer(tiny, TrainerConfig(lr=1e-3))
    samples = fixed_samples(tiny)
    trainer.step(samples, [1.0, -0.5, -0.5])
    out = export_hf(trainer.model, tiny, tmp_path / "hf", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([samples[0].token_ids])
    with torch.no_grad():
        ours = trainer.model.forward_train(ids)
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max() < 1e-3
    out16 = export_hf(trainer.model, tiny, tmp_path / "hf16")  # bf16 by default
    hf16 = AutoModelForCausalLM.from_pretrained(out16)
    assert next(hf16.parameters()).dtype == torch.bfloat16


def test_experts_are_quantized_once_per_optimizer_step(tiny):
    """Every micro-batch of a step reuses the masters' MXFP8 copy; the optimizer's update makes a new one,
    and the forward after it is that of the new weights as served."""
    from kernels import MXFP8Tensor
    from kernels.moe import moe_forward

    samples = fixed_samples(tiny)
    trainer = Trainer(tiny, TrainerConfig(lr=1e-3, micro_batch_tokens=max(len(s.token_ids) for s in samples)))
    moes = trainer.model.moe_layers()
    trainer.step(samples, [1.0, -0.5, -0.5])  # three micro-batches
    assert [m.quant_cache.quantizations for m in moes] == [1] * len(moes)
    trainer.step(samples, [1.0, -0.5, -0.5])
    assert [m.quant_cache.quantizations for m in moes] == [2] * len(moes)
    moe = moes[0]
    x = torch.randn(5, moe.w13.shape[2], dtype=moe.w13.dtype)
    ids = torch.tensor([[0, 1]] * 5)
    w = torch.full((5, 2), 0.5, dtype=x.dtype)
    trainer.optimizer.step()  # the masters move again: the next forward must not reuse the old copy
    with torch.no_grad():
        from kernels.mxfp8_linear import mxfp8_moe

        got = mxfp8_moe(x, ids, w, moe.w13, moe.w2, cache=moe.quant_cache)
        want = moe_forward(x, ids, w, MXFP8Tensor.quantize(moe.w13), MXFP8Tensor.quantize(moe.w2))
    assert torch.equal(got, want) and moe.quant_cache.quantizations == 3


def test_chunked_lm_head_trains_like_the_whole_vocabulary(tiny):
    """A vocabulary larger than vocab_chunk takes the sliced LM head: same log-probs and gradients (to
    float32 rounding) as the whole-row path, and the step's update is the same."""
    samples, advs = fixed_samples(tiny), [1.0, -0.5, -0.5]
    whole = Trainer(tiny, TrainerConfig(lr=1e-3, dtype="float32"))
    sliced = Trainer(tiny, TrainerConfig(lr=1e-3, dtype="float32", vocab_chunk=1000))
    assert sliced.model.cfg.vocab_size > 1000
    for a, b in zip(whole.logprobs(samples), sliced.logprobs(samples), strict=True):
        assert (a - b).abs().max() < 1e-5
    whole.step(samples, advs)
    sliced.step(samples, advs)
    grads = {n: p.grad for n, p in whole.model.named_parameters()}
    for n, p in sliced.model.named_parameters():
        assert (p.grad - grads[n]).abs().max() <= 1e-4 * grads[n].abs().max() + 1e-9, n


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_checkpointing_gives_the_same_step(tiny, dtype):
    """Also in bf16, where the forward runs on bf16 copies of the float32 masters that exist only during
    the forward: the backward's recomputation must cast them again (it once recomputed in float32, which
    torch refuses: a different number of saved tensors on a GPU, other dtypes on a CPU)."""
    samples, advs = fixed_samples(tiny), [1.0, -0.5, -0.5]
    plain = Trainer(tiny, TrainerConfig(lr=1e-3, dtype=dtype))
    ckpt = Trainer(tiny, TrainerConfig(lr=1e-3, dtype=dtype, activation_checkpointing=True))
    cfg, rng = plain.model.cfg, np.random.default_rng(0)
    for s in samples:  # routed experts to replay, so that the replay counters run
        s.routes = rng.integers(0, cfg.num_experts, (len(s.token_ids), len(plain.model.moe_layers()),
                                                     cfg.num_experts_per_tok), dtype=np.int16)
    a, b = plain.step(samples, advs), ckpt.step(samples, advs)
    assert a["routes_replayed"] > 0
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert a.get("routes_replayed") == b.get("routes_replayed")  # the recomputed forward counts nothing
    grads = {n: p.grad for n, p in plain.model.named_parameters()}
    for n, p in ckpt.model.named_parameters():
        assert torch.allclose(p.grad, grads[n], rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_fused_expert_backward_gives_the_default_step(tiny, dtype, tol):
    """TrainerConfig.expert_backward="fused" (kernels/moe_grouped.moe_backward_fused): the same loss and,
    to rounding, the same gradients as the default grouped backward; an unknown name is refused."""
    from kernels import moe_grouped

    samples, advs = fixed_samples(tiny), [1.0, -0.5, -0.5]
    try:
        plain = Trainer(tiny, TrainerConfig(lr=1e-3, dtype=dtype))
        a = plain.step(samples, advs)
        fused = Trainer(tiny, TrainerConfig(lr=1e-3, dtype=dtype, expert_backward="fused"))
        assert moe_grouped.BACKWARD[0] == "fused"
        b = fused.step(samples, advs)
    finally:
        moe_grouped.BACKWARD[0] = "grouped"
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)  # the forward is the same
    grads = {n: p.grad for n, p in plain.model.named_parameters()}
    for n, p in fused.model.named_parameters():
        assert (p.grad - grads[n]).abs().max() <= tol * grads[n].abs().max() + 1e-9, n
    with pytest.raises(ValueError, match="expert_backward"):
        TrainerConfig(expert_backward="fast")
