"""Recording the sessions bench/spec.py replays (run by it when its --sessions folder lacks a set).

    python bench/spec_record.py --sessions bench/spec-results/sessions [--limit 12]

- agent/: the built-in model's own episodes on `synthetic-small`, through the real harness against the
  built-in model's server (`start_builtin`: what `composer-agent` runs with no endpoint configured,
  configured the same way: greedy, 96 tokens a turn);
- stdlib/: the built-in model's episodes on bugs injected into real standard-library modules
  (`python -m agent.tasks.stdlib_bugs`): its prompts hold read_file output of real source files;
- expert/: the scripted expert's episodes on the synthetic edit families (bugfix, rename, add-param;
  medium and large): a replay takes their prompts as contexts (files read, then edited) and lets the
  served model write its own completion for each, so the text after them is edit-shaped context.
Each folder gets the episodes' session JSONL files (agent.session), nothing else.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EDIT_FAMILIES = ("bugfix", "rename", "add-param")


def _eval(tasks, config, dest: Path) -> None:
    from agent.tasks.eval import EvalConfig, run_eval

    out = Path(tempfile.mkdtemp(prefix="bench-spec-eval-"))
    quiet = open("/dev/null", "w")  # noqa: SIM115
    run_eval(tasks, config, EvalConfig(concurrency=2, sandbox=False), out, log=quiet)
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted((out / "sessions").glob("*.jsonl")):
        shutil.copy(f, dest / f.name)
    shutil.rmtree(out, ignore_errors=True)


def _builtin_config(server):
    from agent.client import OpenAIClient
    from agent.config import Config

    config = Config()
    server.configure(config)  # as composer-agent does with no endpoint: greedy, 96 tokens a turn
    config.model, _ = OpenAIClient(config).check()
    return config


def record(folder: Path, sets: list[str], limit: int, log=print) -> None:
    from agent.builtin_model import start_builtin
    from agent.config import Config
    from agent.tasks.expert import ExpertServer
    from agent.tasks.suites import load_tasks, synthetic

    model_sets = [s for s in sets if s in ("agent", "stdlib")]
    if model_sets:
        server = start_builtin(notice=False)
        try:
            config = _builtin_config(server)
            if "agent" in model_sets:
                log(f"recording agent/: the built-in model on synthetic-small, {limit} tasks")
                _eval(load_tasks("synthetic-small")[:limit], config, folder / "agent")
            if "stdlib" in model_sets:
                tmp = Path(tempfile.mkdtemp(prefix="bench-spec-stdlib-"))
                log(f"recording stdlib/: injecting {limit} bugs into standard-library modules (real tests run)")
                subprocess.run([sys.executable, "-m", "agent.tasks.stdlib_bugs", "--out", str(tmp), "--max", str(limit),
                                "--per-module", "1"], check=True, timeout=600, cwd=ROOT, stderr=subprocess.DEVNULL)
                _eval(load_tasks(tmp / "tasks.jsonl")[:limit], config, folder / "stdlib")
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            server.stop()
    if "expert" in sets:
        tasks = [t for t in synthetic(range(limit)) if t.generator in EDIT_FAMILIES and t.size != "small"][:limit]
        log(f"recording expert/: the scripted expert on {len(tasks)} synthetic edit tasks")
        with ExpertServer(tasks) as srv:
            _eval(tasks, Config(base_url=srv.base_url, model="expert"), folder / "expert")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=Path, default=ROOT / "bench" / "spec-results" / "sessions")
    p.add_argument("--sets", nargs="+", default=["agent", "stdlib", "expert"])
    p.add_argument("--limit", type=int, default=12, help="episodes per set")
    args = p.parse_args()
    record(args.sessions, args.sets, args.limit)


if __name__ == "__main__":
    main()
