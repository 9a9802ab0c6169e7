"""Recording the sessions bench/spec.py replays (run by it when its --sessions folder lacks a set).

    python bench/spec_record.py --sessions bench/spec-results/sessions [--limit 12]

- agent/: the built-in model's own episodes on `synthetic-small`, through the real harness against the
  built-in model's server (`start_builtin`: what `composer-agent` runs with no endpoint configured,
  configured the same way: greedy, 96 tokens a turn);
- stdlib/: the built-in model's episodes on bugs injected into real standard-library modules
  (`python -m agent.tasks.stdlib_bugs`): its prompts hold read_file output of real source files;
- edit/: the edit-heavy set: bugs injected into real standard-library modules (agent.tasks.stdlib_bugs);
  each session opens with a scripted read_file of the module's lines around the bug (real source, as
  the harness's tool returns it), and every later turn is the built-in model's own (greedy, 96 tokens
  a turn, through the real harness: its edit_file calls, their results, its test runs), at most
  EDIT_TURNS requests. `ReadThenModel` is that server: it forwards every request to the built-in
  model's composer-serve (so the usage it reports is the server's prompt count) and answers the first
  turn with the scripted read instead;
- expert/: the scripted expert's episodes on the synthetic edit families (bugfix, rename, add-param;
  medium and large): a replay takes their prompts as contexts (files read, then edited) and lets the
  served model write its own completion for each, so the text after them is edit-shaped context.
Each folder gets the episodes' session JSONL files (agent.session), nothing else.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EDIT_FAMILIES = ("bugfix", "rename", "add-param")
EDIT_TURNS = 6  # requests per edit/ session at most (the tiny model may go on re-trying an edit)
READ_BEFORE, READ_LINES = 30, 60  # the scripted read: from 30 lines above the bug, 60 lines


def read_turn(task) -> dict:
    """The scripted first turn of an edit/ session: read the lines around the injected bug."""
    meta = task.meta
    offset = max(1, int(meta["line"]) - READ_BEFORE)
    return {"tool_calls": [{"name": "read_file", "arguments": {"path": meta["file"], "offset": offset,
                                                               "limit": READ_LINES}}]}


def _ask_builtin(base_url: str, model: str, body: dict) -> dict:
    """One non-streamed completion from the built-in server, as a scripted turn (with its prompt count)."""
    import httpx

    req = {k: v for k, v in body.items() if k not in ("stream", "stream_options")} | {"model": model, "stream": False}
    r = httpx.post(f"{base_url}/chat/completions", json=req, timeout=600.0)
    r.raise_for_status()
    data = r.json()
    msg = data["choices"][0]["message"]
    turn = {"content": msg.get("content") or "", "prompt_tokens": data["usage"]["prompt_tokens"]}
    if msg.get("reasoning_content"):
        turn["reasoning"] = msg["reasoning_content"]
    calls = []
    for c in msg.get("tool_calls") or []:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except ValueError:
            args = {"raw": c["function"]["arguments"]}
        calls.append({"name": c["function"]["name"], "arguments": args})
    if calls:
        turn["tool_calls"] = calls
    return turn


def read_then_model(tasks, builtin_url: str, model: str):
    """A loopback server whose first turn per task is `read_turn` and every other turn the built-in
    model's answer to the same request (module docstring, edit/)."""
    from agent.scripted import ScriptedServer

    reads = {t.prompt: read_turn(t) for t in tasks}

    class ReadThenModel(ScriptedServer):
        def next_turn(self, body: dict) -> dict:
            turn = _ask_builtin(builtin_url, model, body)
            messages = body.get("messages") or []
            first = next((m.get("content") for m in messages if m.get("role") == "user"), None)
            if body.get("tools") and first in reads and not any(m.get("role") == "assistant" for m in messages):
                return {**reads[first], "prompt_tokens": turn["prompt_tokens"]}
            return turn

    return ReadThenModel([], model=model, context_window=None)


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

    model_sets = [s for s in sets if s in ("agent", "stdlib", "edit")]
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
            if "edit" in model_sets:
                _record_edit(server, config, folder / "edit", limit, log)
        finally:
            server.stop()
    if "expert" in sets:
        tasks = [t for t in synthetic(range(limit)) if t.generator in EDIT_FAMILIES and t.size != "small"][:limit]
        log(f"recording expert/: the scripted expert on {len(tasks)} synthetic edit tasks")
        with ExpertServer(tasks) as srv:
            _eval(tasks, Config(base_url=srv.base_url, model="expert"), folder / "expert")


def _record_edit(server, config, dest: Path, limit: int, log) -> None:
    from dataclasses import replace

    from agent.config import Config
    from agent.tasks.suites import load_tasks

    tmp = Path(tempfile.mkdtemp(prefix="bench-spec-edit-"))
    log(f"recording edit/: {limit} bugs injected into standard-library modules, read, then the model's own turns")
    subprocess.run([sys.executable, "-m", "agent.tasks.stdlib_bugs", "--out", str(tmp), "--max", str(limit),
                    "--per-module", "1", "--seed", "1"], check=True, timeout=600, cwd=ROOT, stderr=subprocess.DEVNULL)
    tasks = [replace(t, max_turns=EDIT_TURNS) for t in load_tasks(tmp / "tasks.jsonl")[:limit]]
    with read_then_model(tasks, server.base_url, config.model) as srv:
        cfg = Config(base_url=srv.base_url, model=config.model, temperature=config.temperature,
                     max_output_tokens=config.max_output_tokens)
        _eval(tasks, cfg, dest)
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=Path, default=ROOT / "bench" / "spec-results" / "sessions")
    p.add_argument("--sets", nargs="+", default=["agent", "stdlib", "edit", "expert"])
    p.add_argument("--limit", type=int, default=12, help="episodes per set")
    args = p.parse_args()
    record(args.sessions, args.sets, args.limit)


if __name__ == "__main__":
    main()
