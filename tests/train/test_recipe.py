"""`composer-train recipe tiny --smoke`: every stage of the recipe on a toy size, through the real
harness (scripted expert over loopback, a real composer-serve, real workspaces and verifiers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from train.recipe import (
    TinyRecipe,
    distinct_prompt_parts,
    heldout_tasks,
    reward_config,
    rl_tasks,
    train_tasks,
)

ROOT = Path(__file__).resolve().parents[2]


def test_parts_never_share_a_prompt_and_keep_every_task():
    r = TinyRecipe(train_seeds=12)
    tasks = train_tasks(r)
    parts = distinct_prompt_parts(tasks)
    assert len(parts) > 1  # the synthetic families do repeat prompts across seeds
    assert sorted(t.id for p in parts for t in p) == sorted(t.id for t in tasks)
    for p in parts:
        assert len({t.prompt for t in p}) == len(p)


def test_splits_are_disjoint_and_the_control_zeroes_every_reward():
    r = TinyRecipe(train_seeds=3, eval_seeds=3)
    assert {t.split for t in train_tasks(r)} == {"train"} and {t.split for t in heldout_tasks(r)} == {
        "heldout"
    }
    assert not {t.seed for t in train_tasks(r)} & {t.seed for t in heldout_tasks(r)}
    # held-out tasks ask about functions no training task mentions, with fixed or made-up names
    for base in (0, 100_000):
        train = train_tasks(TinyRecipe(train_seeds=3, train_seed_base=base))
        assert [t.seed for t in train[:: len(train) // 3]] == [base, base + 1, base + 2]
        assert not {t.meta["function"] for t in train} & {t.meta["function"] for t in heldout_tasks(r)}
    zero = reward_config(TinyRecipe(control="zero"))
    assert (zero.pass_weight, zero.length_coef, zero.malformed_per_call, zero.parallel_coef) == (0, 0, 0, 0)
    assert (zero.evidence_unsupported, zero.evidence_contradicted, zero.turn_cost, zero.call_cost) == (0, 0, 0, 0)
    assert reward_config(TinyRecipe()).pass_weight == 1.0
    assert reward_config(TinyRecipe(control="shuffle")).pass_weight == 1.0  # real rewards, shuffled by rl.run
    with pytest.raises(ValueError, match="control"):
        reward_config(TinyRecipe(control="random"))


def test_rl_trains_on_training_seeds_sft_never_saw():
    r = TinyRecipe(train_seeds=5, rl_seeds=7, families=("bugfix", "find-def"), model_families=("bugfix",),
                   sizes=("small", "medium"), rl_sizes=("small",))
    sft, rl = train_tasks(r), rl_tasks(r)
    assert {t.split for t in rl} == {"train"} and {t.family for t in rl} == {"bugfix"}
    assert sorted(t.seed for t in rl) == list(range(5, 12))  # right after SFT's seeds 0..4
    assert not {t.id for t in rl} & {t.id for t in sft} and not {t.seed for t in rl} & {t.seed for t in heldout_tasks(r)}
    same = rl_tasks(TinyRecipe(train_seeds=5, rl_seeds=None, model_families=("bugfix",)))
    assert sorted(t.seed for t in same) == list(range(5))


def test_recipe_flags_set_the_model_shape():
    from train.cli import build_parser
    from train.recipe import recipe_from_args

    args = build_parser().parse_args(
        "recipe tiny --out x --hidden-size 128 --layers 4 --heads 8 --kv-heads 4 --moe-intermediate 128"
        " --families bugfix,find-def --sizes small".split()
    )
    r = recipe_from_args(args)
    spec = r.model_spec()
    assert (spec["hidden_size"], spec["num_hidden_layers"]) == (128, 4)
    assert (spec["num_attention_heads"], spec["num_key_value_heads"], spec["moe_intermediate_size"]) == (8, 4, 128)
    assert r.families == ("bugfix", "find-def") and r.sizes == ("small",)


def test_recipe_rl_flags_reach_the_rl_stage():
    from train.cli import build_parser
    from train.recipe import recipe_from_args

    args = build_parser().parse_args(
        ("recipe tiny --out x --rl-steps 50 --rl-lr 5e-4 --rl-adam-eps 1e-5 --negative-weight 0.5 --control shuffle "
         "--rl-kl-coef 0.1 --rl-train-only norm,gate --rl-seeds 300").split()
    )
    r = recipe_from_args(args)
    assert (r.rl_steps, r.rl_lr, r.rl_adam_eps, r.rl_negative_weight, r.control) == (50, 5e-4, 1e-5, 0.5, "shuffle")
    assert (r.rl_kl_coef, r.rl_train_only, r.rl_seeds) == (0.1, ("norm", "gate"), 300)
    default = recipe_from_args(build_parser().parse_args("recipe tiny --out x".split()))
    assert (default.rl_adam_eps, default.rl_negative_weight, default.control) == (1e-8, 1.0, "none")
    assert (default.rl_kl_coef, default.rl_train_only, default.rl_lr) == (0.0, (), 1e-4)
    assert (default.rl_group_size, default.rl_groups_per_step) == (16, 4)
    every = recipe_from_args(build_parser().parse_args(["recipe", "tiny", "--out", "x", "--rl-train-only", ""]))
    assert every.rl_train_only == ()
    assert default.rl_seeds == 2000
    assert recipe_from_args(build_parser().parse_args("recipe tiny --out x --rl-seeds 0".split())).rl_seeds is None
    assert default.vary_timings and default.vary_environment
    # --reward KEY=VALUE: RL's reward terms (a run without the evidence term, issue 56)
    from train.recipe import reward_config

    off = recipe_from_args(build_parser().parse_args(
        "recipe tiny --out x --reward evidence_unsupported=0 --reward evidence_contradicted=0".split()))
    assert off.reward == {"evidence_unsupported": 0.0, "evidence_contradicted": 0.0}
    assert reward_config(off).evidence_unsupported == 0.0 and reward_config(default).evidence_unsupported == 0.1
    with pytest.raises(ValueError, match="KEY=VALUE"):
        recipe_from_args(build_parser().parse_args("recipe tiny --out x --reward evidence".split()))


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~1 min on an idle 2-core machine; several times that when the cores are shared
def test_smoke_recipe_runs_every_stage(tmp_path):
    import torch

    from serve.model.loader import load_model
    from train.cli import main

    out = tmp_path / "run"
    assert (
        main(["recipe", "tiny", "--smoke", "--out", str(out), "--seed", "0", "--families", "find-def"]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())

    # SFT: the loss on the expert data falls (the smoke batch holds every sample, so steps are comparable)
    sft = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(sft) >= 3 and sft[-1]["loss"] < sft[0]["loss"] - 0.05
    assert (out / "sft_metrics.png").exists()

    # RL: a few async steps through the harness, staleness within the bound, weights moved on
    rl = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rl] == [0, 1]
    assert all(m["staleness_mean"] <= 1 and m["infra_masked"] == 0 for m in rl)
    assert json.loads((out / "export" / "composer_policy.json").read_text())["policy_version"] == 2

    # held-out eval ran with the eval runner after SFT and after RL, every episode scored
    n = len(heldout_tasks(TinyRecipe.smoke(families=("find-def",))))
    for stage in ("eval-sft", "eval-rl"):
        report = json.loads((out / stage / "report.json").read_text())
        assert report["overall"]["episodes"] == n and report["overall"]["infra_errors"] == 0
        assert len(list((out / stage / "sessions").glob("*.jsonl"))) == n
    assert summary["sft"]["pass@1"] is not None and summary["rl"]["pass@1"] is not None

    # the export is a serving checkpoint: composer-serve's loader reads it, MXFP8 experts and all
    files = {p.name for p in (out / "export").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
    assert "training" not in files
    model = load_model(out / "export", dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    logits = model.forward_train(ids)
    assert logits.shape[-1] == json.loads((out / "export" / "config.json").read_text())["vocab_size"]
    assert torch.isfinite(logits).all()

    # killed after RL's first checkpoint: the rerun resumes RL from it (step 1 is not redone) and finishes
    rl_dir = out / "rl"
    first = (rl_dir / "checkpoints" / "step-1").stat().st_ino
    for gone in (rl_dir / "final", rl_dir / "checkpoints" / "step-2", out / "eval-rl", out / "export"):
        shutil.rmtree(gone)
    assert main(["recipe", "tiny", "--smoke", "--out", str(out), "--seed", "0", "--families", "find-def"]) == 0
    assert (rl_dir / "checkpoints" / "step-1").stat().st_ino == first
    assert (rl_dir / "checkpoints" / "step-2").is_dir() and (out / "export" / "model.safetensors").exists()
    rl = [json.loads(line) for line in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rl] == [0, 1]
    assert json.loads((out / "export" / "composer_policy.json").read_text())["policy_version"] == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_init_records_the_expert_data_with_the_init_checkpoints_tokenizer(tmp_path):
    """`--init` continues from a checkpoint: its SFT samples must be token-exact for that checkpoint's
    tokenizer, so the recipe records with it instead of training a new one (which made SFT refuse
    every sample: "the recorded prompt differs from ... chat template + tokenizer")."""
    from train.recipe import build_base, provisional_tokenizer, run

    init = build_base(tmp_path / "init", provisional_tokenizer(tmp_path / "tok"), TinyRecipe.smoke())
    r = TinyRecipe.smoke(families=("find-def",), init=str(init), skip_rl=True, sft_epochs=1, eval_t1=True)
    summary = run(r, tmp_path / "run")
    # --eval-t1: the held-out split sampled at T=1 too, in its own folder
    t1 = json.loads((tmp_path / "run" / "eval-sft-t1" / "report.json").read_text())
    assert t1["overall"]["episodes"] == len(heldout_tasks(r)) and summary["sft_t1"]["pass@1"] is not None
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "run" / "data" / "tokenizer" / name).read_bytes() == (init / name).read_bytes()
    assert summary["sft"]["pass@1"] is not None
    assert json.loads((tmp_path / "run" / "data" / "data.json").read_text())["init"] == str(init.resolve())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rl_from_starts_rl_at_a_trained_checkpoint_and_leaves_it_untouched(tmp_path, capsys):
    """`--rl-from` (RL the built-in model further): no data, tokenizer or SFT stage; the checkpoint is
    copied into the run folder, RL starts from its very weights, and the source is never written."""
    from train.cli import main
    from train.recipe import n_params, run

    src = tmp_path / "start"
    shutil.copytree(ROOT / "serve" / "builtin" / "composer-tiny", src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = tmp_path / "run"
    r = TinyRecipe.smoke(families=("bugfix",), rl_from=str(src), max_output_tokens=48)
    summary = run(r, out)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert not (out / "data").exists() and not (out / "base").exists()
    assert (out / "sft" / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert summary["params"] == n_params(src) > 2_000_000  # the checkpoint's size, not the smoke shape's
    # versions count on from the checkpoint's own (the built-in model was made by RL), and staleness is
    # measured against them: 0..1, not "-25" (which let every batch start at once, with no bound at all)
    start = json.loads(before["composer_policy.json"])["policy_version"]
    rl = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rl] == [0, 1] and all(m["infra_masked"] == 0 for m in rl)
    assert [m["policy_version"] for m in rl] == [start, start + 1]
    assert all(0 <= m["staleness_mean"] <= 1 and m["dropped_stale"] == 0 for m in rl)
    assert json.loads((out / "export" / "composer_policy.json").read_text())["policy_version"] == start + 2
    assert (out / "export" / "model.safetensors").read_bytes() != before["model.safetensors"]
    for extra, says in ((["--rl-from", str(src), "--skip-rl"], "neither --skip-rl"),
                        (["--rl-from", str(tmp_path)], "not a checkpoint folder")):
        assert main(["recipe", "tiny", "--smoke", "--out", str(tmp_path / "bad")] + extra) == 2
        assert says in capsys.readouterr().err and not (tmp_path / "bad").exists()
