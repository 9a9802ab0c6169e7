"""`composer-agent demo`: the whole product on this machine, offline, on CPU, in one command.

It writes a small Python repository with a failing test (a task of the synthetic `bugfix` family, the
kind the built-in model was trained on) into a fresh folder, shows the test failing, then runs the
agent on it with the built-in model (served by a child composer-serve, as `composer-agent` does with no
endpoint configured), greedy, printing every tool call as it starts and ends: calls of one turn that
run at once show up together. Afterwards the repository's tests and the task's hidden checker (which
re-runs every function's cases, so editing the test does not count) decide whether it went green;
the exit code says so (0 green, 1 not, 2 usage or set-up error, 130 interrupted).

What the tiny model can do: fix a one-function bug (a wrong operator, constant, off-by-one, swapped
arguments) in a small repository like the one written here, calling tools the way it was trained to.
What it cannot: anything else. It has a few million parameters and knows only these synthetic tasks;
on your own code or open-ended requests it will flounder. Point the agent at a real model for that.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from agent.protocol import AssistantMessage, Event, Finished, ToolCallFinished, ToolCallStarted

if TYPE_CHECKING:
    from agent.builtin_model import LocalServer

# The fixed demo task: a family, size and seed the built-in model solves greedily (see BENCHMARKS.md).
FAMILY, SIZE, SEED = "bugfix", "small", 0
TESTS = "python -m pytest -q -p no:cacheprovider tests"


class DemoPrinter:
    """Tool calls as they start and end. The loop starts each call as soon as the model has written
    it, so calls of one turn run while the model still writes the next; overlapping ones are marked."""

    def __init__(self, out: TextIO):
        self.out = out
        self.lock = threading.Lock()
        self.running: dict[str, str] = {}
        self.calls = 0
        self.multi_call_turns: set[int] = set()

    def __call__(self, event: Event) -> None:
        from agent.headless import _brief

        with self.lock:
            if isinstance(event, ToolCallStarted):
                self.calls += 1
                overlap = f"   (runs alongside {', '.join(self.running.values())})" if self.running else ""
                self.running[event.call_id] = event.name
                self._print(f"  turn {event.turn} → {event.name} {_brief(event.arguments)}{overlap}")
            elif isinstance(event, ToolCallFinished):
                self.running.pop(event.call_id, None)
                last = event.content.strip().splitlines()[-1:] or [""]
                sign = "✓" if event.ok else "✗"
                self._print(
                    f"  turn {event.turn} {sign} {event.name} ({event.duration_s:.1f} s): {last[0][:100]}"
                )
            elif isinstance(event, AssistantMessage) and len(event.tool_calls) > 1:
                self.multi_call_turns.add(event.turn)
                self._print(
                    f"  turn {event.turn}: {len(event.tool_calls)} tool calls in one turn, run in parallel"
                )
            elif isinstance(event, Finished):
                self._print(
                    f"  finished: {event.status} after {event.turns} turns, {self.calls} tool calls "
                    f"({len(self.multi_call_turns)} turn(s) with parallel calls), {event.duration_s:.1f} s"
                )

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)


def write_repo(root: Path, seed: int = SEED) -> tuple[str, str]:
    """Write the demo task's repository into `root` (a git repository with one commit when git is
    installed, so `git diff` shows what the agent changed); return (task id, prompt)."""
    from agent.tasks.families import generate, materialize

    task = generate(FAMILY, seed, SIZE)
    root.mkdir(parents=True, exist_ok=True)
    materialize(task, root, hidden=False)
    if shutil.which("git"):
        ident = ["-c", "user.name=composer demo", "-c", "user.email=demo@localhost"]
        for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "the demo repository, with a bug"]):
            subprocess.run(["git", *ident, *cmd], cwd=root, capture_output=True)
    return task.id, task.prompt


def run_tests(root: Path) -> tuple[bool, str]:
    env = {
        **os.environ,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1"),
    }
    p = subprocess.run(TESTS.split(), cwd=root, capture_output=True, text=True, timeout=120, env=env)
    lines = (p.stdout + p.stderr).strip().splitlines()
    return p.returncode == 0, (lines[-1] if lines else "")


def hidden_check(root: Path, seed: int = SEED, answer: str = "") -> tuple[bool, str]:
    """The task's verifier, run on a copy (the hidden files never land in the user's folder)."""
    from agent.tasks.families import generate
    from agent.tasks.workspace import Workspace

    task = generate(FAMILY, seed, SIZE)
    tmp = Path(tempfile.mkdtemp(prefix="composer-demo-check-"))
    try:
        shutil.copytree(root, tmp / "repo", ignore=shutil.ignore_patterns(".git", ".composer"))
        return Workspace(tmp / "repo", task).verify(answer)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-agent demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dir",
        type=Path,
        help="folder to write the repository into (new or empty; default: a "
        "fresh temporary folder, kept afterwards)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=SEED,
        help=f"which bugfix task (default {SEED}, one the built-in model solves)",
    )
    p.add_argument(
        "--base-url", help="run it with this OpenAI-compatible endpoint instead of the built-in model"
    )
    p.add_argument("--model", help="model name at --base-url (default: the first one listed)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The demo repository needs no pytest plugins; loading every installed one (the dev extra has
    # heavy ones) makes each test run ~10x slower. The agent's shell commands inherit this too.
    os.environ.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    out = sys.stderr
    root = args.dir.resolve() if args.dir else Path(tempfile.mkdtemp(prefix="composer-demo-")) / "repo"
    if root.exists() and any(root.iterdir()):
        print(f"composer-agent demo: error: {root} is not empty", file=sys.stderr)
        return 2
    task_id, prompt = write_repo(root, args.seed)
    ok, line = run_tests(root)
    print(
        f"composer-agent demo: wrote a small repository with a failing test to {root} (task {task_id})\n"
        f"  before: `{TESTS}` -> {line or ('passes' if ok else 'fails')}\n"
        f"  asking the agent: {prompt!r}",
        file=out,
        flush=True,
    )
    server = None
    try:
        if args.base_url is None:
            from agent.builtin_model import BuiltinModelError, start_builtin

            try:
                server = start_builtin(out=out)
            except BuiltinModelError as e:
                print(f"composer-agent demo: error: {e}", file=sys.stderr)
                return 2
        return _run(root, prompt, args, server, out)
    except KeyboardInterrupt:
        print("\ncomposer-agent demo: interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()


def _run(root: Path, prompt: str, args: argparse.Namespace, server: LocalServer | None, out: TextIO) -> int:
    from agent.approval import Approvals
    from agent.client import ModelError
    from agent.config import Config
    from agent.runtime import build

    # Greedy, so the run is the same every time; the task's own limits. With the built-in model, its
    # own settings (greedy, 160 tokens a turn); elsewhere a cap that stops a confused model early.
    config = Config(
        base_url=server.base_url if server else args.base_url,
        model=args.model,
        temperature=0.0,
        max_turns=12,
        max_time_s=600.0,
        max_output_tokens=None if server else 1024,
        approval="auto",
    )
    if server is not None:
        server.configure(config)
    printer = DemoPrinter(out)
    try:
        rt = build(config, root, emit=printer, approve=Approvals("auto"))
    except ModelError as e:
        print(f"composer-agent demo: error: {e}", file=sys.stderr)
        return 2
    finished = rt.agent.run(prompt, rt.system)
    rt.session.close()
    if finished.final_text.strip():
        print(f"  the agent says: {finished.final_text.strip()[:400]}", file=out)
    ok, line = run_tests(root)
    checked, detail = hidden_check(root, args.seed, finished.final_text)
    green = ok and checked
    print(f"  after: `{TESTS}` -> {line}", file=out)
    if green:
        print(f"composer-agent demo: green. `git -C {root} diff` shows the fix.", file=out)
    else:
        why = "" if checked else f" (the task's checker says: {detail.strip().splitlines()[0][:160]})"
        print(
            f"composer-agent demo: not green{why}. The built-in model is tiny; see `composer-agent demo "
            f"--help`. The repository is left at {root}.",
            file=out,
        )
    return 0 if green else 1
