"""Headless runs: `composer-agent --task TEXT`, for CI, scripts and batch evaluation.

Read-only unless asked (`--approval auto`, or `approval` in a config file): nobody is there to see an
edit before it lands, and a model pointed at a repository it does not know (the small built-in one
above all) would otherwise write to it unasked. The first line on stderr says what the run may change.

Without --json the final answer goes to stdout and a one-line-per-tool progress log to stderr. With
--json, stdout carries exactly one JSON event per line (agent.protocol) and nothing else; logs go to
stderr. Exit codes: 0 finished, 1 the agent failed, hit a limit or gave an empty answer (status
no_answer), or the model kept writing tool calls nothing could parse (error_kind malformed_tool_call),
2 usage or configuration error
(server unreachable, bad key, unknown model), 130 interrupted (Ctrl-C: tools killed, session saved).

With --json every run ends with a `finished` event, failures included, so a script needs only stdout:
one that fails before the loop starts prints just that event, with status "error", `error` (the
message, also on stderr) and `error_kind`: unreachable, auth, not_found (model or URL), config (the
configuration or the server's answer to it), usage (flags), session (--resume), builtin_model, internal.
A failure inside the loop carries the client's kind (request, server, cut_off, ...).

The agent runs in a worker thread so that Ctrl-C in the main thread can interrupt it cleanly (a
KeyboardInterrupt raised inside the loop could tear a session record); a second Ctrl-C exits at once.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import TextIO

from agent.approval import Approvals
from agent.client import ModelError
from agent.config import Config
from agent.protocol import Event, Finished, Notice, Retrying, Summarized, ToolCallFinished, ToolCallStarted
from agent.render import UNVERIFIED
from agent.runtime import build
from agent.session import SessionNotFound

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class JsonEvents:
    def __init__(self, out: TextIO):
        self.out = out
        self.lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self.lock:
            self.out.write(event.to_json() + "\n")
            self.out.flush()


class Progress:
    """A terse human log on stderr: one line per tool call, retries and summaries."""

    def __init__(self, err: TextIO):
        self.err = err
        self.lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        line = None
        if isinstance(event, ToolCallStarted):
            line = f"→ {event.name} {_brief(event.arguments)}"
        elif isinstance(event, ToolCallFinished) and not event.ok:
            line = f"  ✗ {event.name}: {event.content.removeprefix('Error: ').splitlines()[0][:160]}"
        elif isinstance(event, Retrying):
            line = f"… retrying in {event.delay_s:.1f} s ({event.reason})"
        elif isinstance(event, Summarized):
            line = f"… context summarised ({event.tokens_before} → {event.tokens_after} tokens)"
        elif isinstance(event, Notice):
            line = f"{event.level}: {event.text}"
        if line:
            with self.lock:
                print(line, file=self.err, flush=True)


def _brief(args: object) -> str:
    if isinstance(args, dict):
        for key in ("path", "command", "pattern", "query"):
            if key in args:
                return str(args[key]).splitlines()[0][:120] if str(args[key]) else ""
        return json.dumps(args)[:120]
    return str(args)[:120]


def report_failure(
    kind: str, message: str, *, as_json: bool, status: str = "error", prefix: str = "error"
) -> None:
    """A run that ends outside the loop: one line on stderr and, with --json, its final event on stdout."""
    print(f"composer-agent: {prefix}: {message}", file=sys.stderr, flush=True)
    if as_json:
        json_failure(kind, message, status)


def json_failure(kind: str, message: str, status: str = "error") -> None:
    """The final `finished` event of a --json run that ended outside the loop (entry points call it too)."""
    event = Finished(status, "", 0, 0.0, 0, 0, "", message if status == "error" else None, kind)
    sys.stdout.write(event.to_json() + "\n")
    sys.stdout.flush()


def failure_kind(e: ModelError) -> str:
    """A start-up ModelError's kind for scripts: what to fix (the client calls all of these "config")."""
    if e.kind != "config":
        return e.kind
    if e.status in (401, 403):
        return "auth"
    if e.status == 404:
        return "not_found"
    if str(e).startswith("cannot reach"):
        return "unreachable"
    return "config"


def scope(config: Config, root: Path, mode: str = "code") -> str:
    """What a headless run may change, in one line (its first, on stderr)."""
    where = ", ".join(str(p) for p in (root, *config.extra_roots(root)))
    if mode != "code":
        return f"composer-agent: {mode} mode: it may read {where} but not edit files or run commands"
    if config.approval == "read-only":
        return (f"composer-agent: read-only: it may read {where} but not edit files or run commands "
                "(--approval auto allows both)")
    shell = ("shell commands under bubblewrap (no network, writes only in the workspace)" if config.sandbox
             else "shell commands, not sandboxed (--sandbox confines them)")
    return f"composer-agent: approval auto: it may edit files in {where} and run {shell}"


def announce(config: Config, root: Path, *, as_json: bool, mode: str = "code") -> int | None:
    """Before a headless run: refuse `ask` (nobody to answer), else say what it may change; an exit code
    when it cannot run."""
    if config.approval == "ask":
        report_failure(
            "usage",
            "--approval ask needs an interactive terminal; headless runs use auto or read-only",
            as_json=as_json,
        )
        return EXIT_USAGE
    print(scope(config, root, mode), file=sys.stderr, flush=True)
    return None


def run(config: Config, root: Path, task: str | None, *, as_json: bool, resume: str | None,
        mode: str | None = None) -> int:
    """The run itself; the entry point has called `announce` first."""
    emit = JsonEvents(sys.stdout) if as_json else Progress(sys.stderr)
    try:
        rt = build(config, root, emit=emit, approve=Approvals(config.approval), resume=resume)
    except ModelError as e:
        report_failure(failure_kind(e), str(e), as_json=as_json)
        return EXIT_USAGE if e.kind == "config" else EXIT_FAILED
    except SessionNotFound as e:
        report_failure("session", str(e), as_json=as_json)
        return EXIT_USAGE
    rt.agent.set_mode(mode or rt.agent.mode)  # no --mode: a resumed session's recorded one, else code
    result: list[Finished] = []
    crash: list[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            result.append(rt.agent.run(task or "Continue.", rt.system))
        except BaseException as e:  # a bug: reported below as an internal failure, not a silent exit 1
            crash.append(e)
            raise
        finally:
            done.set()

    # Not Thread.join(): a KeyboardInterrupt inside join() can leave is_alive() wrongly False (3.11).
    threading.Thread(target=work, name="agent", daemon=True).start()
    interrupted = False
    while not done.is_set():
        try:
            done.wait(0.1)
        except KeyboardInterrupt:
            if interrupted:
                rt.session.close()
                if as_json:
                    with emit.lock:  # type: ignore[union-attr]
                        report_failure(
                            "interrupted",
                            "interrupted at once",
                            as_json=True,
                            status="interrupted",
                            prefix="stopped",
                        )
                os._exit(EXIT_INTERRUPTED)
            interrupted = True
            print("\ncomposer-agent: interrupting (Ctrl-C again to quit at once)", file=sys.stderr)
            rt.agent.interrupt()
    rt.session.close()
    if not result:
        why = f"{type(crash[0]).__name__}: {crash[0]}" if crash else "the agent stopped without a result"
        report_failure("internal", f"internal error: {why}", as_json=as_json)
        return EXIT_FAILED
    finished = result[0]
    if finished.status == "completed":
        if not as_json:
            print(finished.final_text)
            if finished.model_builtin:
                print(f"composer-agent: {UNVERIFIED}", file=sys.stderr)
        return EXIT_OK
    if finished.status == "interrupted":
        return EXIT_INTERRUPTED
    if finished.status == "no_answer":
        print(f"composer-agent: the model ended with an empty answer ({finished.turns} turns)", file=sys.stderr)
    elif finished.error:
        print(f"composer-agent: error: {finished.error}", file=sys.stderr)
    else:
        print(f"composer-agent: stopped: {finished.status} ({finished.turns} turns)", file=sys.stderr)
    return EXIT_USAGE if rt.agent.error_kind == "config" else EXIT_FAILED
