"""Claims in a final answer, checked against the episode's own tool log.

Shared by RL (train/rewards.py: the evidence term) and evaluation (a report counts unsupported claims).

    claims = check_claims(answer, steps)       # steps: steps_of(session_data) or the SessionData itself
    claims = check_session(session_data)       # the answer is the run's final text
    counts(claims) -> {"claims": 3, "supported": 1, "unsupported": 1, "contradicted": 1}

A claim is one statement of the answer that a tool call could have shown: `tests_pass`, `tests_fail`,
`file_changed`, `file_created`, `command_ok` (a backticked command said to have run fine) and
`location` (a symbol said to be defined in, or fixed in, a file, maybe at a line). Each is
`supported` (the log shows it), `contradicted` (the log shows otherwise) or `unsupported` (the log does
not show it either way), with the evidence in words.

Approach and its limits: claims are found by patterns over clauses of the answer (English, the phrasings
agents use: "the tests pass", "Fixed `f` in a/b.py", "`f` is defined in a/b.py, line 7"), not by a
model; an unusual phrasing is missed (no claim, so no penalty), never invented. Hedged or negated
statements ("should pass", "I did not run the tests") are not claims: saying what was not checked is
what we want. "Tests pass" is judged by the last test command run: it must come after the last edit
and exit 0. A test command is a shell command that looks like one (pytest, unittest, npm test, go test,
a test_*.py script, ...); a shell command that writes files (sed -i, a redirect, mv, cp, tee, patch,
git apply/checkout) counts as an edit of unknown files. Only what the tools printed is evidence: a file
changed by a script the model ran is not seen.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SUPPORTED, UNSUPPORTED, CONTRADICTED = "supported", "unsupported", "contradicted"
KINDS = ("tests_pass", "tests_fail", "file_changed", "file_created", "command_ok", "location")


@dataclass
class Step:
    """One tool call of the episode and what it returned, in the order they ran."""
    index: int
    turn: int
    name: str
    args: dict[str, Any]
    output: str
    ok: bool | None = None  # the executor's verdict (the session's `tools` record), when recorded


@dataclass
class Claim:
    kind: str
    """One of KINDS."""
    text: str
    """The clause of the answer that makes the claim."""
    status: str
    """supported | unsupported | contradicted."""
    evidence: str
    """Why, from the tool log (which call, what it printed), in words."""
    subject: str = ""
    """What it is about: a path, a command, `symbol@path[:line]`; empty for the tests."""
    step: int | None = field(default=None)
    """Index of the step the verdict rests on, if one."""


# -- the tool log --------------------------------------------------------------------------------------------

def steps_of(data: Any) -> list[Step]:
    """The tool calls of a session (agent.session.SessionData), each with its output. Messages copied into
    a new segment after a summary are the same calls (same ids) and are taken once."""
    calls: dict[str, tuple[int, str, dict[str, Any]]] = {}
    outputs: dict[str, str] = {}
    ok: dict[str, bool] = {}
    order: list[str] = []
    turn = 0
    for rec in data.records:
        kind = rec.get("type")
        if kind == "request" and rec.get("purpose", "turn") == "turn":
            turn = rec.get("turn", turn + 1)
        elif kind == "tools":
            ok |= {c["id"]: bool(c.get("ok")) for c in rec.get("calls") or [] if "id" in c}
        elif kind == "message":
            msg = rec.get("message") or {}
            if msg.get("role") == "assistant":
                for c in msg.get("tool_calls") or []:
                    if c.get("id") in calls:
                        continue
                    fn = c.get("function") or {}
                    calls[c.get("id")] = (turn, fn.get("name", ""), _args(fn.get("arguments")))
                    order.append(c.get("id"))
            elif msg.get("role") == "tool" and msg.get("tool_call_id") not in outputs:
                outputs[msg.get("tool_call_id")] = _text(msg.get("content"))
    return [Step(i, calls[cid][0], calls[cid][1], calls[cid][2], outputs.get(cid, ""), ok.get(cid))
            for i, cid in enumerate(order) if cid in outputs]  # a call that never returned showed nothing


def final_answer(data: Any) -> str:
    """The run's final text: the last `finished` record's, else the last assistant message without calls."""
    for rec in reversed(data.records):
        if rec.get("type") == "finished" and rec.get("final_text") is not None:
            return rec["final_text"]
    for rec in reversed(data.records):
        msg = rec.get("message") or {}
        if rec.get("type") == "message" and msg.get("role") == "assistant" and not msg.get("tool_calls"):
            return _text(msg.get("content"))
    return ""


def _args(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        v = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError:
        return {}
    return v if isinstance(v, dict) else {}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


# -- what a step did -----------------------------------------------------------------------------------------

_TEST_CMD = re.compile(r"\b(py\.?test|unittest|nose2|tox|nox|(npm|yarn|pnpm)( run)? test|go test|cargo test|node --test|"
                       r"make (test|check)|ctest|jest|vitest|mocha|rspec|phpunit|gradle\w* test|mvn test)\b|"
                       r"\btest_\w*\.py\b|\b\w+_test\.py\b")
# a redirect into a file (not 2>&1, not /dev/null), in-place edits, moves, copies, patches
_WRITES = re.compile(r"(?<![0-9&<])>>?\s*(?!&|/dev/null)[\w./~-]|\bsed\s+(-\w*\s+)*-i|\btee\b|\bmv\s|\bcp\s|"
                     r"\bpatch\b|\bgit\s+(apply|am|checkout|restore|stash)\b|\btouch\s|\brm\s")
_EXIT = re.compile(r"\[(?:exit code (-?\d+)|[^\]]*\(exit code (-?\d+)\))[^\]]*\]\s*$")


def is_test_run(s: Step) -> bool:
    return s.name == "shell" and bool(_TEST_CMD.search(str(s.args.get("command", ""))))


def exit_code(s: Step) -> int | None:
    """The shell's exit code, from the `[exit code N; T s]` line it ends its output with."""
    m = _EXIT.search(s.output.rstrip())
    if m:
        return int(m.group(1) or m.group(2))
    return None if s.ok is None else (0 if s.ok else 1)


def edited_path(s: Step) -> str | None:
    """The file a successful edit_file / write_file changed ("" for a shell command that writes somewhere)."""
    if s.name in ("edit_file", "write_file"):
        good = s.output.startswith(("Edited ", "Created ", "Overwrote ")) if s.ok is None else s.ok
        return _norm(str(s.args.get("path", ""))) if good else None
    if s.name == "shell" and _WRITES.search(str(s.args.get("command", ""))):
        return ""
    return None


def _norm(path: str) -> str:
    return path.strip().strip("`'\"").removeprefix("./").rstrip(".,:;")


def same_path(a: str, b: str) -> bool:
    """Equal, or one is the other seen from a folder above (an absolute path in the tool, relative in prose)."""
    a, b = _norm(a), _norm(b)
    return bool(a and b) and (a == b or a.endswith("/" + b) or b.endswith("/" + a))


def _first_line(text: str, limit: int = 120) -> str:
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    return line[:limit]


def _failure_line(text: str) -> str:
    """The line of a test run's output that says how it ended (pytest's summary, an error, else the last)."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("[exit code")]
    for pat in (r"\b\d+ (failed|passed|error)", r"^(FAILED|ERROR)\b", r"Error\b"):
        hit = next((ln for ln in reversed(lines) if re.search(pat, ln)), None)
        if hit:
            return hit.strip()[:120]
    return (lines[-1].strip() if lines else "")[:120]


# -- finding claims ------------------------------------------------------------------------------------------

_PATH = re.compile(r"`?((?:[\w.~-]+/)*[\w-]+\.(?:py|pyi|js|jsx|ts|tsx|go|rs|java|kt|c|h|cc|cpp|hpp|rb|php|cs|"
                   r"swift|md|rst|txt|json|toml|yaml|yml|cfg|ini|sh|html|css|sql))\b`?")
_SYMBOL = r"`(\w+)(?:\(\))?`"
_TESTS = re.compile(r"\btests?\b|\btest_\w+|\btest suite\b|\bpytest\b|\bspecs?\b")
_PASS = re.compile(r"\bpass(?:es|ed|ing)?\b|\bsucceed(?:s|ed)?\b|\bgreen\b")
_FAIL = re.compile(r"\bfail(?:s|ed)?\b|\bstill failing\b|\bare failing\b|\bbroken\b")
_HEDGE = re.compile(r"\b(should|would|could|might|may|probably|likely|expect(?:ed)?|hopefully|once|if|"
                    r"not|n't|never|unable|without|unverified|untested)\b", re.I)
_CHANGED = re.compile(r"\b(fixed|changed|edited|updated|modified|patched|corrected|replaced|renamed|added|removed|"
                      r"rewrote|rewritten|adjusted|refactored)\b", re.I)
_CREATED = re.compile(r"\b(created|wrote|added (?:a )?new file)\b", re.I)
_DEFINED = re.compile(_SYMBOL + r"\s+is\s+defined\s+in\s+`?([\w./~-]+\.\w+)`?(?:,?\s+(?:at\s+|on\s+)?line\s+(\d+))?",
                      re.I)
_FIXED_IN = re.compile(r"\b(?:fixed|corrected|changed|patched)\s+" + _SYMBOL + r"\s+in\s+`?([\w./~-]+\.\w+)`?", re.I)
_BUG_IN = re.compile(r"\b(?:bug|problem|issue|fault|cause)\b[^.]*?\b(?:is|was|lies|lay)\s+in\s+" + _SYMBOL
                     + r"(?:\s+(?:in|of)\s+`?([\w./~-]+\.\w+)`?)?", re.I)
_RAN = re.compile(r"\b(ran|run|running|executed)\b", re.I)
_RAN_OK = re.compile(r"\b(succeed(?:s|ed)?|successfully|exit(?:s|ed)? (?:with )?(?:code |status )?0|works|worked|"
                     r"without errors?|cleanly|ok)\b", re.I)


def clauses(answer: str) -> list[str]:
    """The answer cut into clauses: sentences, and their parts after ';' or ': ' (a path's "a.py:3" stays)."""
    parts = re.split(r"(?<=[.!?])\s+|;\s+|:\s+|\n+", answer)
    return [p.strip() for p in parts if p and p.strip()]


def find_claims(answer: str) -> list[tuple[str, str, str]]:
    """(kind, clause, subject) for each claim in the answer, before checking."""
    found: list[tuple[str, str, str]] = []
    for c in clauses(answer):
        hedged = bool(_HEDGE.search(c))
        t = _TESTS.search(c)
        if t and not hedged:
            after = c[t.start():]
            verbs = [(m.start(), "tests_pass") for m in _PASS.finditer(after)]
            verbs += [(m.start(), "tests_fail") for m in _FAIL.finditer(after)]
            if verbs:  # the last verb is the state it ends in: "the failing test now passes"
                found.append((max(verbs)[1], c, ""))
        located: set[str] = set()
        for rx in (_DEFINED, _FIXED_IN, _BUG_IN):
            for m in rx.finditer(c):
                sym, path = m.group(1), _norm(m.group(2) or "")
                line = m.group(3) if rx is _DEFINED else None
                subject = f"{sym}@{path}" + (f":{line}" if line else "")
                if subject not in located:
                    located.add(subject)
                    found.append(("location", c, subject))
        if hedged:
            continue
        paths = list(dict.fromkeys(_norm(m.group(1)) for m in _PATH.finditer(c)))
        kind = "file_created" if _CREATED.search(c) else "file_changed" if _CHANGED.search(c) else None
        if kind and not (t and not _CHANGED.search(c[:t.start()]) and not _CREATED.search(c[:t.start()])):
            found += [(kind, c, p) for p in paths]  # (a path in "tests in t/x.py pass" is not a change)
        if _RAN.search(c) and _RAN_OK.search(c):
            found += [("command_ok", c, m.group(1)) for m in re.finditer(r"`([^`]{2,200})`", c)
                      if " " in m.group(1) or "/" in m.group(1)]
    return found


# -- checking them -------------------------------------------------------------------------------------------

def check_claims(answer: str, steps: Sequence[Step] | Any) -> list[Claim]:
    """Every claim of `answer`, checked against `steps` (a list of Step, or a SessionData)."""
    if not isinstance(steps, Sequence):
        steps = steps_of(steps)
    out = []
    for kind, text, subject in find_claims(answer):
        status, evidence, step = _CHECKS[kind](subject, list(steps))
        out.append(Claim(kind, text, status, evidence, subject, step))
    return out


def check_session(data: Any) -> list[Claim]:
    """The claims of a recorded session's final answer, checked against its own tool log."""
    return check_claims(final_answer(data), steps_of(data))


def counts(claims: Sequence[Claim]) -> dict[str, int]:
    c = {"claims": len(claims), SUPPORTED: 0, UNSUPPORTED: 0, CONTRADICTED: 0}
    for cl in claims:
        c[cl.status] += 1
    return c


Verdict = tuple[str, str, int | None]


def _tests_pass(_: str, steps: list[Step]) -> Verdict:
    runs = [s for s in steps if is_test_run(s)]
    if not runs:
        return UNSUPPORTED, "no test command was run", None
    last = runs[-1]
    later = [s for s in steps if s.index > last.index and edited_path(s) is not None]
    if later:
        what = edited_path(later[-1]) or f"a shell command ({_first_line(str(later[-1].args.get('command')), 60)})"
        return UNSUPPORTED, f"the last test run (call {last.index}) came before the last edit, of {what}", last.index
    cmd = str(last.args.get("command"))[:80]
    if exit_code(last) == 0:
        return SUPPORTED, f"`{cmd}` after the last edit exited 0: {_failure_line(last.output)}", last.index
    return CONTRADICTED, f"the last test run `{cmd}` failed: {_failure_line(last.output)}", last.index


def _tests_fail(_: str, steps: list[Step]) -> Verdict:
    runs = [s for s in steps if is_test_run(s)]
    if not runs:
        return UNSUPPORTED, "no test command was run", None
    failed = [s for s in runs if exit_code(s) != 0]
    if failed:  # "test_x failed" is usually the state before the fix: any failing run shows it
        return SUPPORTED, f"`{str(failed[-1].args.get('command'))[:80]}` failed: {_failure_line(failed[-1].output)}", \
            failed[-1].index
    return CONTRADICTED, f"every test run ({len(runs)}) exited 0", runs[-1].index


def _attempts(path: str, steps: list[Step]) -> list[Step]:
    return [s for s in steps if s.name in ("edit_file", "write_file") and same_path(str(s.args.get("path", "")), path)]


def _shell_writes(path: str, steps: list[Step]) -> list[Step]:
    base = path.rsplit("/", 1)[-1]
    return [s for s in steps if edited_path(s) == "" and base in str(s.args.get("command", ""))]


def _file_changed(path: str, steps: list[Step], created: bool = False) -> Verdict:
    tries = _attempts(path, steps)
    good = [s for s in tries if edited_path(s) is not None]
    if good:
        s = good[-1]
        if created and not any(x.output.startswith("Created ") for x in good):
            return CONTRADICTED, f"{path} existed: {s.name} said {_first_line(s.output, 80)!r}", s.index
        return SUPPORTED, f"{s.name} call {s.index}: {_first_line(s.output)}", s.index
    shell = _shell_writes(path, steps)
    if shell:
        return SUPPORTED, f"shell call {shell[-1].index} wrote to it: {str(shell[-1].args.get('command'))[:80]}", \
            shell[-1].index
    if tries:
        s = tries[-1]
        return CONTRADICTED, f"every edit of {path} failed; the last said {_first_line(s.output)!r}", s.index
    return UNSUPPORTED, f"no tool call changed {path}", None


def _file_created(path: str, steps: list[Step]) -> Verdict:
    return _file_changed(path, steps, created=True)


def _command_ok(cmd: str, steps: list[Step]) -> Verdict:
    runs = [s for s in steps if s.name == "shell" and (cmd in str(s.args.get("command", ""))
                                                       or str(s.args.get("command", "")).strip() in cmd)]
    if not runs:
        return UNSUPPORTED, f"`{cmd[:80]}` was never run", None
    s = runs[-1]
    if exit_code(s) == 0:
        return SUPPORTED, f"shell call {s.index} exited 0", s.index
    return CONTRADICTED, f"shell call {s.index} exited {exit_code(s)}: {_failure_line(s.output)}", s.index


def _location(subject: str, steps: list[Step]) -> Verdict:
    sym, _, rest = subject.partition("@")
    path, _, line = rest.partition(":")
    word = re.compile(rf"\b{re.escape(sym)}\b")
    if path:
        missing = [s for s in steps if (same_path(str(s.args.get("path", "")), path) or path in s.output)
                   and re.search(rf"{re.escape(path.rsplit('/', 1)[-1])} does not exist|No such file", s.output)]
        if missing and not _attempts_ok(path, steps):
            return CONTRADICTED, f"call {missing[-1].index} said {_first_line(missing[-1].output)!r}", missing[-1].index
    shown = _shown_lines(path, steps) if path else {}
    if line:
        text = shown.get(int(line))
        if text is not None:
            ok = bool(word.search(text))
            return (SUPPORTED if ok else CONTRADICTED), f"line {line} of {path} reads {text.strip()[:80]!r}", None
    for s in steps:  # the symbol seen in this file: its lines, an edit of it, a search for it that found the file
        in_file = path and (same_path(str(s.args.get("path", "")), path) or (s.name == "grep" and path in s.output)
                            or (s.name == "semantic_search" and any(same_path(p, path) for p, _ in _search_hits(s.output))))
        if not path or in_file:
            if s.name == "semantic_search" and path:  # only the hits in that file, not the others' snippets
                body = "\n".join(b for p, b in _search_hits(s.output) if same_path(p, path))
            else:
                body = s.output + " " + json.dumps(s.args) if s.name != "grep" else json.dumps(s.args)
            if word.search(body) and (s.name != "edit_file" or edited_path(s) is not None):
                why = f"{s.name} call {s.index} showed `{sym}`" + (f" in {path}" if path else "")
                if line:
                    return UNSUPPORTED, why + f", but line {line} was never shown", s.index
                return SUPPORTED, why, s.index
    full = [s for s in steps if s.name == "read_file" and same_path(str(s.args.get("path", "")), path)
            and not {"offset", "limit"} & set(s.args) and edited_path(s) is None and s.ok is not False]
    if full and not any(word.search(s.output) for s in full):
        return CONTRADICTED, f"read_file call {full[-1].index} showed all of {path} without `{sym}`", full[-1].index
    return UNSUPPORTED, f"no tool call showed `{sym}`" + (f" in {path}" if path else ""), None


def _attempts_ok(path: str, steps: list[Step]) -> bool:
    return any(edited_path(s) is not None for s in _attempts(path, steps))


def _shown_lines(path: str, steps: list[Step]) -> dict[int, str]:
    """Line number -> text of `path` as the tools printed it (read_file's numbered lines, grep -n hits)."""
    lines: dict[int, str] = {}
    for s in steps:
        if s.name == "read_file" and same_path(str(s.args.get("path", "")), path):
            for m in re.finditer(r"^\s*(\d+)\t(.*)$", s.output, re.M):
                lines[int(m.group(1))] = m.group(2)
        elif s.name == "semantic_search":  # "K. path:a-b  symbol (score)" headers, each hit's numbered lines under it
            for hit_path, body in _search_hits(s.output):
                if same_path(hit_path, path):
                    for m in re.finditer(r"^\s*(\d+)\t(.*)$", body, re.M):
                        lines[int(m.group(1))] = m.group(2)
        else:
            for m in re.finditer(r"^(\S+?):(\d+):(.*)$", s.output, re.M):
                if same_path(m.group(1), path):
                    lines[int(m.group(2))] = m.group(3)
    return lines


def _search_hits(output: str) -> list[tuple[str, str]]:
    """(path, the hit's header and snippet) for each hit semantic_search printed."""
    heads = list(re.finditer(r"^\d+\. (\S+?):\d+-\d+ ", output, re.M))
    return [(m.group(1), output[m.start():heads[i + 1].start() if i + 1 < len(heads) else len(output)])
            for i, m in enumerate(heads)]


_CHECKS = {"tests_pass": _tests_pass, "tests_fail": _tests_fail, "file_changed": _file_changed,
           "file_created": _file_created, "command_ok": _command_ok, "location": _location}
