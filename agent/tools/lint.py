"""lint: ruff for Python, plus linters found in the project or configured by the user.

Also home of `new_python_problems`, which edit_file and write_file use to report only the problems an
edit introduced: the file is checked before and after (from memory, through ruff's stdin mode) and
diagnostics are matched on (code, message, text of the line), so line shifts do not count as new.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agent.tools.base import ToolError, ToolResult, tool
from agent.tools.context import ToolContext

MAX_LINES = 200
LINT_TIMEOUT_S = 120
# The flake8 "stop the build" set: syntax errors and undefined names, the problems an edit should never add.
INTRODUCED_SELECT = "E9,F63,F7,F82"


def ruff_bin() -> str:
    local = Path(sys.executable).parent / "ruff"
    if local.is_file():
        return str(local)
    found = shutil.which("ruff")
    if found:
        return found
    try:
        from ruff.__main__ import find_ruff_bin

        return find_ruff_bin()
    except Exception:  # noqa: BLE001 - ruff missing is reported as a tool error
        raise ToolError("ruff is not installed in this environment") from None


def _ruff_json(text: str, filename: str, select: str = INTRODUCED_SELECT) -> list[dict]:
    """ruff's diagnostics of `text` (`select`: rule codes; eval's quality metrics ask for ruff's defaults)."""
    proc = subprocess.run(
        [ruff_bin(), "check", "--isolated", "--select", select, "--output-format", "json",
         "--stdin-filename", filename, "-"],
        input=text.encode(), capture_output=True, timeout=60,
    )
    if proc.returncode not in (0, 1):
        return []
    try:
        return json.loads(proc.stdout or b"[]")
    except json.JSONDecodeError:
        return []


def new_python_problems(before: str | None, after: str, filename: str) -> list[str]:
    """Diagnostics present in `after` and not in `before`, as 'line:col: CODE message' strings."""

    def keyed(text: str, diags: list[dict]) -> list[tuple[tuple, dict]]:
        lines = text.splitlines()
        out = []
        for d in diags:
            row = d["location"]["row"]
            line = lines[row - 1].strip() if 0 < row <= len(lines) else ""
            out.append(((d.get("code"), d.get("message"), line), d))
        return out

    with ThreadPoolExecutor(2) as pool:
        fut_before = pool.submit(_ruff_json, before, filename) if before is not None else None
        diags_after = _ruff_json(after, filename)
        diags_before = fut_before.result() if fut_before else []
    seen = Counter(k for k, _ in keyed(before or "", diags_before))
    # A file that did not parse before has no trustworthy baseline: only syntax errors count then.
    broken_before = any(d.get("code") in (None, "invalid-syntax", "E999") for d in diags_before)
    new = []
    for key, d in keyed(after, diags_after):
        if broken_before and d.get("code") not in (None, "invalid-syntax", "E999"):
            continue
        if seen[key] > 0:
            seen[key] -= 1
            continue
        loc = d["location"]
        code = d.get("code") or "error"
        new.append(f"{loc['row']}:{loc['column']}: {code} {d.get('message', '')}")
    return new


def introduced_problems_note(before: str | None, after: str, filename: str) -> tuple[str, list[str]]:
    """A note for the model about problems an edit of a Python file introduced ('' when none)."""
    if not filename.endswith((".py", ".pyi")):
        return "", []
    try:
        problems = new_python_problems(before, after, filename)
    except (ToolError, OSError, subprocess.TimeoutExpired):
        return "", []
    if not problems:
        return "", []
    shown = "\n".join(f"  {filename}:{p}" for p in problems[:20])
    more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
    return f"\nThis change introduced {len(problems)} lint error(s):\n{shown}{more}", problems


@tool(parallel_safe=True)
def lint(ctx: ToolContext, paths: list[str] | None = None) -> ToolResult:
    """Lint files and report problems as path:line:col with a rule code and message. Python is checked
    with ruff using the project's own ruff configuration; other languages with the project's linters
    when present (eslint in node_modules, shellcheck) or the ones configured for Composer.

    Args:
        paths: Files or folders to lint, relative to the workspace root. Default: the whole workspace.
    """
    targets = [ctx.workspace.resolve(p) for p in (paths or ["."])]
    for t in targets:
        if not t.exists():
            raise ToolError(f"{ctx.workspace.display(t)} does not exist")
    rel = [os.path.relpath(t, ctx.root) for t in targets]
    sections: list[str] = []
    total = 0
    for name, argv in _linters(ctx, targets, rel):
        problems, err = _run(argv, ctx.root)
        if err:
            sections.append(f"{name}: failed to run: {err}")
            continue
        total += len(problems)
        if problems:
            shown = problems[:MAX_LINES]
            more = f"\n… {len(problems) - MAX_LINES} more lines not shown" if len(problems) > MAX_LINES else ""
            sections.append(f"{name}: {len(problems)} problem line(s)\n" + "\n".join(shown) + more)
        else:
            sections.append(f"{name}: no problems")
    if not sections:
        return ToolResult("No linter applies to these paths.", data={"problems": 0})
    return ToolResult("\n\n".join(sections), data={"problems": total})


def _linters(ctx: ToolContext, targets: list[Path], rel: list[str]) -> list[tuple[str, list[str]]]:
    out = [("ruff", [ruff_bin(), "check", "--no-fix", "--output-format", "concise", "--quiet",
                     "--force-exclude", *rel])]
    files = _files_under(ctx, targets)
    js = [f for f in files if f.endswith((".js", ".jsx", ".ts", ".tsx", ".mjs", ".cjs"))]
    eslint = ctx.root / "node_modules" / ".bin" / "eslint"
    if js and eslint.exists():
        out.append(("eslint", [str(eslint), "--format", "unix", *js]))
    sh = [f for f in files if f.endswith((".sh", ".bash"))]
    if sh and shutil.which("shellcheck"):
        out.append(("shellcheck", ["shellcheck", "--format", "gcc", *sh]))
    for pattern, command in ctx.linters.items():
        matched = [f for f in files if fnmatch.fnmatch(f, pattern) or fnmatch.fnmatch(Path(f).name, pattern)]
        if matched:
            cmd = command.replace("{paths}", " ".join(shlex.quote(m) for m in matched))
            out.append((command.split()[0], ["bash", "-c", cmd]))
    return out


def _files_under(ctx: ToolContext, targets: list[Path]) -> list[str]:
    from agent.tools.files import list_files

    files: list[str] = []
    for t in targets:
        if t.is_file():
            files.append(os.path.relpath(t, ctx.root))
        else:
            files.extend(os.path.relpath(ctx.root / f, ctx.root) for f in list_files(ctx, t, limit=20_000)[0])
    return files


def _run(argv: list[str], cwd: Path) -> tuple[list[str], str]:
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=LINT_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        return [], str(e)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {LINT_TIMEOUT_S} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Found ", "[*]", "No fixes available"))]
    if proc.returncode not in (0, 1) and not lines:
        return [], (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return lines, ""
