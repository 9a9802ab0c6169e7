"""What every front-end says about the agent's events, decided once: pure functions, no terminal code.

The TUI (agent/tui) and line mode (agent/plain) both describe a tool call with `call_brief` when it
starts and `result_summary` when it ends, show details with `detail_lines`, classify diff lines with
`diff_lines` (each front-end maps the kinds to its own colours; a diff is shown by `diff_detail`, in the
card and in the approval question alike), and keep the status bar's figures in a
`Status` fed with the same events. Keeping these here means the two views cannot drift apart, and the
wording is tested without starting either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from agent.protocol import (
    Event,
    Finished,
    Notice,
    Retrying,
    SessionStarted,
    Summarized,
    ToolCallFinished,
    UsageReport,
)

TODO_MARKS = {"completed": "✓", "in_progress": "▸", "pending": "○"}
TAIL_LINES = 12
MAX_HITS = 20
MAX_DETAIL_LINES = 200
APPROVAL_PREVIEW_LINES = 40


def one_line(text: Any, width: int = 100) -> str:
    """The first line of `text`, cut to `width` characters; " …" marks lines left out."""
    lines = str(text).strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > width:
        return first[: width - 1] + "…"
    return first + " …" if len(lines) > 1 else first


def typed_text(user_content: str) -> str:
    """A user message as the user typed it, without the files attached for its @mentions."""
    from agent.mentions import MENTION_APPENDIX  # lazily: mentions loads the tools package

    return user_content.split(MENTION_APPENDIX)[0]


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def call_brief(name: str, args: Any) -> str:
    """What a call is about, in a few words: the command, the path, the pattern."""
    if not isinstance(args, dict):
        return one_line(args, 80)
    if name == "shell":
        return one_line(args.get("command", ""), 100)
    if name == "grep":
        where = args.get("path") or args.get("glob")
        return f"{args.get('pattern', '')!r}" + (f" in {where}" if where else "")
    if name == "semantic_search":
        return one_line(repr(str(args.get("query", ""))), 80)
    if name == "glob":
        return str(args.get("pattern", ""))
    if name == "todo_write":
        return plural(len(args.get("todos") or []), "item")
    if name == "read_file" and args.get("offset"):
        return f"{args.get('path', '')}:{args['offset']}"
    if name in ("read_file", "edit_file", "write_file", "list_dir", "lint"):
        paths = args.get("path") or args.get("paths") or "."
        return ", ".join(paths) if isinstance(paths, list) else str(paths)
    for key in ("path", "command", "pattern", "query"):
        if key in args:
            return one_line(args[key], 80)
    return one_line(json.dumps(args, ensure_ascii=False), 80)


def result_summary(event: ToolCallFinished) -> str:
    """The one line a finished call collapses to (without the tool name and brief)."""
    d, name = event.data or {}, event.name
    if d.get("denied"):
        return "declined"
    if d.get("interrupted") and name != "shell":
        return "interrupted"
    if not event.ok and name != "shell":
        return one_line(event.content.removeprefix("Error: "), 90)
    if name in ("edit_file", "write_file") and "diff" in d:
        added, removed = diff_stats(d["diff"])
        return f"+{added} −{removed}" + (
            " (new file)" if d.get("created") or d.get("tier") == "create" else ""
        )
    if name == "shell":
        if d.get("timed_out"):
            return "timed out"
        if d.get("interrupted"):
            return "interrupted"
        if "exit_code" in d:
            return f"exit {d['exit_code']}"
        return one_line(event.content.removeprefix("Error: "), 90)
    if name == "grep":
        files = plural(d.get("files", 0), "file")
        if d.get("mode") == "content":
            return f"{plural(d.get('matches', 0), 'matching line')} in {files}"
        return files
    if name == "semantic_search":
        return plural(len(d.get("hits") or []), "result")
    if name == "read_file" and "total_lines" in d:
        if not d["total_lines"]:
            return "empty"
        return f"lines {d.get('start_line', 1)}–{d.get('end_line', d['total_lines'])} of {d['total_lines']}"
    if name in ("glob", "list_dir"):
        return plural(d.get("total", d.get("files", 0)), "file")
    if name == "lint":
        problems = d.get("problems", 0)
        return "clean" if not problems else plural(problems, "problem")
    if name == "todo_write":
        todos = d.get("todos") or []
        return f"{sum(t['status'] == 'completed' for t in todos)}/{len(todos)} done"
    return one_line(event.content, 90)


# -- details -------------------------------------------------------------------------------------------


def diff_stats(diff: str) -> tuple[int, int]:
    added = removed = 0
    for line in diff.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed


def diff_lines(diff: str) -> list[tuple[str, str]]:
    """(kind, line) for each line of a unified diff; kind: header | hunk | add | remove | context."""
    out = []
    for line in diff.splitlines():
        if line.startswith(("+++", "---")):
            kind = "header"
        elif line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+"):
            kind = "add"
        elif line.startswith("-"):
            kind = "remove"
        else:
            kind = "context"
        out.append((kind, line))
    return out


def diff_detail(diff: str, limit: int = MAX_DETAIL_LINES) -> list[tuple[str, str]]:
    """A diff as the tool card and the approval question both show it."""
    return _capped(diff_lines(diff), limit)


def _capped(lines: list[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    if len(lines) <= limit:
        return lines
    return lines[:limit] + [("context", f"… {len(lines) - limit} more lines")]


def hit_lines(hits: list[dict[str, Any]], limit: int = MAX_HITS) -> list[str]:
    """Search hits as `path:line: text` (grep, semantic_search)."""
    out = []
    for h in hits[:limit]:
        where = h.get("path", "?")
        if h.get("line") is not None:
            where += f":{h['line']}"
        elif h.get("start_line") is not None:
            where += f":{h['start_line']}" + (f"-{h['end_line']}" if h.get("end_line") else "")
        text = (h.get("text") or "").strip() or (h.get("symbol") or "").strip()
        out.append(f"{where}: {one_line(text, 100)}" if text else where)
    if len(hits) > limit:
        out.append(f"… {len(hits) - limit} more")
    return out


def output_tail(content: str, n: int = TAIL_LINES) -> list[str]:
    """The last `n` lines of a shell call's output, without the `[exit code …]` status line."""
    lines = content.rstrip("\n").splitlines()
    if lines and lines[-1].startswith("[") and lines[-1].endswith("]"):
        lines = lines[:-1]
    if lines == ["(no output)"]:
        return []
    return (["…"] if len(lines) > n else []) + lines[-n:]


def todo_lines(todos: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(status, "mark text") per todo item."""
    return [
        (t.get("status", "pending"), f"{TODO_MARKS.get(t.get('status', ''), '○')} {t.get('content', '')}")
        for t in todos
    ]


def detail_lines(event: ToolCallFinished) -> list[tuple[str, str]]:
    """The expanded body of a finished call as (kind, line): diff kinds, or output | error | hit | todo."""
    d, name = event.data or {}, event.name
    if name in ("edit_file", "write_file") and d.get("diff"):
        return diff_detail(d["diff"])
    if name == "shell" and "command" in d:
        lines = [("command", f"$ {d['command']}")]
        lines += [("output", ln) for ln in output_tail(event.content)]
        return lines + [("status", _shell_status(d))]
    if name in ("grep", "semantic_search") and d.get("hits"):
        return [("hit", ln) for ln in hit_lines(d["hits"])]
    if name == "todo_write" and "todos" in d:
        return todo_lines(d["todos"])
    kind = "output" if event.ok else "error"
    lines = event.content.splitlines()
    return [(kind, ln) for ln in lines[:TAIL_LINES]] + ([(kind, "…")] if len(lines) > TAIL_LINES else [])


def _shell_status(d: dict[str, Any]) -> str:
    if d.get("timed_out"):
        return f"timed out (exit {d.get('exit_code')})"
    if d.get("interrupted"):
        return "interrupted"
    return f"exit code {d.get('exit_code')}"


# -- the run ------------------------------------------------------------------------------------------

STOPPED = {"max_turns": "the turn limit", "max_time": "the time limit", "max_tokens": "the token budget"}
BUILTIN_BANNER = ("Model: the small built-in model (composer-tiny), served on this machine because no model server "
                  "is configured. It is a toy that knows only small synthetic tasks (fixing an injected bug, finding "
                  "a definition): check what it claims. Point composer-agent at a real model with --base-url URL.")
UNVERIFIED = ("answered by the small built-in model (composer-tiny, a toy that knows only small synthetic tasks): "
              "its claims are unverified; check the changes (git diff) and run your tests")


def run_notice(event: Event) -> tuple[str, str] | None:
    """(kind, text) of what to say about a retry, a summary or the end of a run; None: say nothing.
    kind: info | warning | error."""
    if isinstance(event, Notice):
        return event.level, event.text
    if isinstance(event, Retrying):
        return "info", f"Retrying in {event.delay_s:.1f}s ({event.reason})."
    if isinstance(event, Summarized):
        return "info", f"Context summarised ({event.tokens_before} → {event.tokens_after} tokens)."
    if isinstance(event, SessionStarted) and event.model_builtin and not event.resumed:
        return "warning", BUILTIN_BANNER
    if isinstance(event, Finished):
        if event.status == "completed" and event.model_builtin:
            return "warning", UNVERIFIED[0].upper() + UNVERIFIED[1:] + "."
        if event.status == "interrupted":
            return "warning", "Interrupted."
        if event.status == "error":
            return "error", f"Error: {event.error}"
        if event.status == "no_answer":
            return "warning", "The model ended with an empty answer."
        if event.status in STOPPED:
            return "warning", f"Stopped at {STOPPED[event.status]} ({plural(event.turns, 'request')})."
    return None


# -- approvals -----------------------------------------------------------------------------------------


class Preview(NamedTuple):
    """What an approval question shows: the question and the lines under it (kinds as in detail_lines)."""

    question: str
    lines: list[tuple[str, str]]


def approval_preview(
    name: str,
    args: dict[str, Any],
    diff: str | None = None,
    *,
    created: bool | None = None,
    error: str | None = None,
) -> Preview:
    """The question to ask before a mutating call, and what to show with it.

    `diff` is the change an edit_file / write_file call will make to the file as it is now (computed by
    agent.approval with the tool's own code); it is shown by `diff_detail`, as the card shows it once the
    call has run. `error`: why the call will fail. `created`: whether write_file creates the file."""
    if name == "shell":
        return Preview(
            "Run this command?",
            [
                ("command", f"$ {line}") if i == 0 else ("command", f"  {line}")
                for i, line in enumerate(str(args.get("command", "")).splitlines())
            ],
        )
    path = str(args.get("path", "?"))
    if name == "edit_file":
        old, new = str(args.get("old_string", "")), str(args.get("new_string", ""))
        question = f"{'Create' if not old else 'Edit'} {path}?"
        # Without the file to number them against, no hunk header: a made-up "@@ -1 +1 @@" misleads.
        sketch = [("remove", f"-{ln}") for ln in old.splitlines()] + [
            ("add", f"+{ln}") for ln in new.splitlines()
        ]
    elif name == "write_file":
        n = len(str(args.get("content", "")).splitlines())
        verb = {True: "Create", False: "Overwrite"}.get(created, "Write")  # type: ignore[arg-type]
        question = f"{verb} {path} ({n} lines)?"
        sketch = [("add", f"+{ln}") for ln in str(args.get("content", "")).splitlines()]
    else:  # e.g. an MCP server's tool: the user sees every argument it will be sent
        shown = json.dumps(args, indent=2, ensure_ascii=False).splitlines() if args else []
        return Preview(
            f"Allow {name} {call_brief(name, args)}?",
            _capped([("context", ln) for ln in shown], APPROVAL_PREVIEW_LINES),
        )
    if error is not None:
        return Preview(
            question,
            [("error", f"This call will fail: {one_line(error, 200)}")]
            + _capped(sketch, APPROVAL_PREVIEW_LINES),
        )
    if diff is not None:
        return Preview(question, diff_detail(diff, APPROVAL_PREVIEW_LINES))
    return Preview(question, _capped(sketch, APPROVAL_PREVIEW_LINES))


# -- the status bar ------------------------------------------------------------------------------------


def human_tokens(n: int) -> str:
    if n < 1000:
        return str(n)
    if n < 100_000:
        return f"{n / 1000:.1f}k".replace(".0k", "k")
    return f"{round(n / 1000)}k"


def human_seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{s:.0f}s"
    m, sec = divmod(int(s), 60)
    return f"{m}m{sec:02d}s"


@dataclass
class Status:
    """The figures a status bar shows, kept up to date from events (and the front-end's clock)."""

    model: str = ""
    approval: str = ""
    context_used: int = 0
    context_window: int = 0
    tokens_per_s: float | None = None
    running_since: float | None = None  # set by the front-end when it starts a turn
    last_elapsed: float | None = None

    def apply(self, event: Event) -> bool:
        """Update from one event; True when something shown changed."""
        if isinstance(event, SessionStarted):
            self.model, self.context_window = event.model, event.context_window
            if event.model_builtin:
                self.model += " (built-in toy model: claims unverified)"
            self.context_used, self.tokens_per_s = 0, None
        elif isinstance(event, UsageReport):
            # What the next request will carry: the last prompt plus the answer it produced.
            self.context_used = event.prompt_tokens + event.completion_tokens
            self.context_window = event.context_window
            if event.completion_tokens and event.tokens_per_s > 0:
                self.tokens_per_s = event.tokens_per_s
        elif isinstance(event, Finished):
            self.running_since, self.last_elapsed = None, event.duration_s
        else:
            return False
        return True

    def parts(self, now: float) -> list[str]:
        out = [self.model or "connecting…"]
        if self.context_window:
            pct = 100 * self.context_used / self.context_window
            out.append(
                f"ctx {human_tokens(self.context_used)}/{human_tokens(self.context_window)} ({pct:.0f}%)"
            )
        if self.tokens_per_s is not None:
            out.append(f"{self.tokens_per_s:.0f} tok/s")
        if self.running_since is not None:
            out.append(human_seconds(max(0.0, now - self.running_since)))
        elif self.last_elapsed is not None:
            out.append(human_seconds(self.last_elapsed))
        if self.approval:
            out.append(f"approval: {self.approval}")
        return out

    def line(self, now: float) -> str:
        return " · ".join(self.parts(now))
