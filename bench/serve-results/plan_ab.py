"""The speculative planner's time per step, this code against an earlier revision's (serve/engine/drafter.py
and speculation.py loaded from git), alternating: bench/spec_sim.py's greedy replay of the edit and agent
sets at batch 1 (adaptive drafts, prefill drafts, the cache warmed on 100 requests of the next set), the
wall time of every `Speculator.plan` call summed per arm, and the replay's figures checked equal (the same
drafts). Usage: python bench/serve-results/plan_ab.py REV [ROUNDS]. Issue 50."""

# ruff: noqa: E402 (the repository root goes on sys.path first)
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import bench.spec_sim as sim
import serve.engine.drafter
import serve.engine.speculation
from bench.spec import SETS, load_set
from serve.chat_format import ChatFormat
from serve.cli import BUILTIN_DIR
from serve.model.config import ModelConfig

COSTS = [4.35, 4.75, 5.32, 5.53, 5.74, 6.07, 6.40, 6.74, 7.07]  # ms at 0-8 drafts: this VM's step A/B


def revision(rev: str) -> tuple:
    """drafter and speculation as they were at `rev`, as modules (the old speculation imports the old drafter);
    sys.modules is left as it was."""
    saved = {name: sys.modules[f"serve.engine.{name}"] for name in ("drafter", "speculation")}
    mods = []
    for name in ("drafter", "speculation"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:serve/engine/{name}.py"], check=True,
                              capture_output=True, text=True).stdout
        spec = importlib.util.spec_from_loader(f"serve.engine.{name}", loader=None)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"serve.engine.{name}"] = mod
        exec(compile(text, f"{rev}:serve/engine/{name}.py", "exec"), mod.__dict__)
        mods.append(mod)
    for name, mod in saved.items():
        sys.modules[f"serve.engine.{name}"] = mod
    return tuple(mods)


COUNT = {"s": 0.0, "calls": 0}  # the replay being timed: seconds in plan, calls


def timed(spec_mod) -> None:
    """Time every `Speculator.plan` call of this revision into COUNT (wrapped once)."""
    plan = spec_mod.Speculator.plan
    if getattr(plan, "timed", False):
        return

    def wrapped(self, *a, **k):
        t = time.perf_counter()
        try:
            return plan(self, *a, **k)
        finally:
            COUNT["s"] += time.perf_counter() - t
            COUNT["calls"] += 1
    wrapped.timed = True
    spec_mod.Speculator.plan = wrapped


def main() -> int:
    rev, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
    arms = {"before": revision(rev), "now": (serve.engine.drafter, serve.engine.speculation)}
    chat = ChatFormat(str(BUILTIN_DIR))
    max_len = ModelConfig.from_dir(str(BUILTIN_DIR)).max_position_embeddings
    sessions = ROOT / "bench" / "spec-results" / "sessions"
    outputs = json.loads((ROOT / "bench" / "spec-results" / "greedy-outputs.json").read_text())
    names = [s for s in SETS if (sessions / s).is_dir()]
    for set_name in ("edit", "agent"):
        reqs = load_set(set_name, sessions, chat, max_len, None)
        warm = load_set(names[(names.index(set_name) + 1) % len(names)], sessions, chat, max_len, 100)
        per_call: dict[str, list[float]] = {a: [] for a in arms}
        figures = {}
        for i in range(rounds):
            for arm in arms if i % 2 == 0 else list(arms)[::-1]:
                drafter, speculation = arms[arm]
                sys.modules["serve.engine.drafter"], sys.modules["serve.engine.speculation"] = drafter, speculation
                COUNT.update(s=0.0, calls=0)
                timed(speculation)
                res = sim.simulate(reqs, outputs, warm, 8, "suffix", warm_tokens=256, adaptive=True, costs=COSTS,
                                   prefill_row_ms=0.06)
                per_call[arm].append(COUNT["s"] / COUNT["calls"])
                figures.setdefault(arm, {k: v for k, v in res.items() if k != "kinds"})
        sys.modules["serve.engine.drafter"], sys.modules["serve.engine.speculation"] = arms["now"]
        same = figures["before"] == figures["now"]
        b, n = statistics.median(per_call["before"]), statistics.median(per_call["now"])
        print(f"{set_name}: plan per step {b * 1e6:.1f} us before ({rev}), {n * 1e6:.1f} us now: {n / b:.2f}x "
              f"(medians of {rounds} alternating replays); the same drafts: {same}", flush=True)
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
