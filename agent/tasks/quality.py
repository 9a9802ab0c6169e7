"""How an episode solved its task, beside whether it did: the quality metrics of `composer-agent eval`.

A pass says the hidden tests ran green; it does not say the agent left the tests alone, kept its diff
to what the task needed, added no lint errors, kept the repository's formatting, or said only what its
tool calls showed. Each of these is measured from the workspace after the episode, before the hidden
files go in:

- the diff, against a snapshot taken before the agent starts: a private git directory beside the
  workspace (outside it, so the agent never sees it, and separate from any repository the workspace is
  itself), so created, deleted and binary files count too; caches (__pycache__, node_modules, ...) do not;
- test edits: changed files that are tests (by path) or the task's hidden verifier files; a test file
  the task's own reference fix changes (a rename across callers and tests) is not one. Such an episode
  is reported as not passing (runner.py), since the verdict came from tests the agent rewrote;
- files the task did not need and the size ratio, where the task carries `reference_patch`;
- lint: problems of ruff's default rule set (E4, E7, E9, F) beyond those the file had, counted per rule
  so moved or renamed lines are not new; JavaScript: `node --check` syntax errors;
- format: changed lines the repository's formatter would rewrite (ruff format for Python, prettier for
  JavaScript where installed); in a file that was never formatted, in the file's own quotes and only as
  many as the edit added to what the formatter would rewrite anyway (format_issues says how);
- claims in the final answer that the episode's tool log does not support or contradicts, by the
  claims checker RL's evidence reward uses too (agent/tasks/claims.py).
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.tasks.patches import patch_files, patch_lines
from agent.tasks.spec import Task
from agent.tasks.workspace import GIT_IDENT

LINT_SELECT = "E4,E7,E9,F"  # ruff's default rule set: a repository without ruff config gets these
TEST_PATH = re.compile(r"(^|/)(tests?|__tests__|spec)/|(^|/)(test_[^/]*|[^/]*_test|conftest)\.py$"
                       r"|\.(test|spec)\.[cm]?[jt]sx?$")
IGNORED = ("__pycache__/", "*.pyc", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/", "node_modules/", "target/",
           ".composer/")
_TIMEOUT = 60


def is_test_path(path: str) -> bool:
    return TEST_PATH.search(path) is not None


@dataclass
class Baseline:
    """The workspace as it was before the agent ran, committed in a git directory outside it."""

    root: Path
    git_dir: Path

    @classmethod
    def take(cls, root: Path, where: Path) -> Baseline | None:
        """None when git is missing or fails (the episode then has no quality figures, not an error)."""
        if shutil.which("git") is None:
            return None
        b = cls(root, where / ".quality.git")
        try:
            b._git("init", "-q")
            (b.git_dir / "info").mkdir(exist_ok=True)
            (b.git_dir / "info" / "exclude").write_text("\n".join(IGNORED) + "\n")
            b._git("add", "-A")
            b._git(*GIT_IDENT, "commit", "-q", "--allow-empty", "--no-verify", "-m", "before")
        except (OSError, subprocess.SubprocessError):
            return None
        return b

    def _git(self, *args: str, input: str | None = None) -> str:
        p = subprocess.run(["git", f"--git-dir={self.git_dir}", f"--work-tree={self.root}", "-c", "core.quotepath=off",
                            *args], cwd=self.root, capture_output=True, text=True, errors="replace", input=input,
                           timeout=_TIMEOUT)
        if p.returncode != 0:
            raise subprocess.SubprocessError(p.stderr.strip()[:300])
        return p.stdout

    def changes(self) -> list[tuple[str, int, int]]:
        """(path, lines added, lines removed) of every file changed since the snapshot (binary: 0, 0)."""
        self._git("add", "-A")
        out = self._git("diff", "--cached", "--no-renames", "--numstat", "-z", "HEAD")
        rows = []
        for item in out.split("\0"):
            parts = item.split("\t", 2)
            if len(parts) == 3:
                a, r, path = parts
                rows.append((path, int(a) if a.isdigit() else 0, int(r) if r.isdigit() else 0))
        return rows

    def before(self, path: str) -> str | None:
        try:
            return self._git("show", f"HEAD:{path}")
        except subprocess.SubprocessError:
            return None


def hidden_paths(task: Task) -> set[str]:
    """Files the verifier brings in after the episode: the agent has no business writing them."""
    out: set[str] = set()
    if task.generator:
        from agent.tasks.families import build

        out |= set(build(task.generator, task.seed, task.size).hidden)
    if task.hidden and Path(task.hidden).is_dir():
        out |= {str(p.relative_to(task.hidden)) for p in Path(task.hidden).rglob("*") if p.is_file()}
    if task.hidden_patch:
        out |= set(patch_files(task.hidden_patch))
    return out


def measure(task: Task, baseline: Baseline, answer: str = "", session: Any = None) -> dict[str, Any]:
    """The quality figures of the workspace as the agent left it and of its final `answer`, checked
    against the recorded `session` (agent.session.SessionData; see the module docstring)."""
    changed = baseline.changes()
    paths = [p for p, _, _ in changed]
    hidden = hidden_paths(task)
    ref_files = set(patch_files(task.reference_patch)) if task.reference_patch is not None else None
    q: dict[str, Any] = {
        "files_changed": len(paths), "changed_files": paths,
        "lines_added": sum(a for _, a, _ in changed), "lines_removed": sum(r for _, _, r in changed),
        "test_edits": [p for p in paths if p in hidden or (is_test_path(p) and p not in (ref_files or ()))],
        "unneeded_files": None if ref_files is None else [p for p in paths if p not in ref_files],
        "reference_lines": None, "size_ratio": None,
    }
    q["lines_changed"] = q["lines_added"] + q["lines_removed"]
    if task.reference_patch is not None:
        q["reference_lines"] = patch_lines(task.reference_patch)
        if q["reference_lines"]:
            q["size_ratio"] = round(q["lines_changed"] / q["reference_lines"], 3)
        elif not q["lines_changed"]:  # a question answered without touching the code: as the reference
            q["size_ratio"] = 1.0
    lint, fmt, checked = [], [], 0
    for path in paths:
        file = baseline.root / path
        if not file.is_file():
            continue  # deleted
        after = file.read_text(errors="replace")
        before = baseline.before(path)
        lint += [f"{path}:{p}" for p in new_problems(path, before, after)]
        issues = format_issues(baseline.root, path, before, after)
        if issues is not None:
            checked += 1
            fmt += [f"{path}:{n}" for n in issues]
    q.update(new_lint=lint, format_checked=checked, format_issues=fmt)
    q["claims"] = check_answer(answer, session)
    return q


# -- lint --------------------------------------------------------------------------------------------


def new_problems(path: str, before: str | None, after: str) -> list[str]:
    """Problems `after` has beyond those `before` had ('line:col: CODE message'). Python: per ruff rule,
    the surplus of `after`'s diagnostics over `before`'s (the ones on lines the episode wrote first), so
    problems that moved, or whose line a rename rewrote, are not new."""
    if path.endswith((".py", ".pyi")):
        from agent.tools.lint import _ruff_json

        try:
            old = _ruff_json(before, path, LINT_SELECT) if before is not None else []
            new = _ruff_json(after, path, LINT_SELECT)
        except Exception:  # noqa: BLE001 - ruff missing or broken: no figure rather than a failed episode
            return []
        surplus = Counter(d.get("code") for d in new)
        surplus.subtract(Counter(d.get("code") for d in old))
        old_lines = set((before or "").splitlines())
        lines = after.splitlines()

        def moved(d: dict) -> bool:  # on a line that was there before: reported after the written ones
            row = d["location"]["row"]
            return 0 < row <= len(lines) and lines[row - 1] in old_lines
        out = []
        for d in sorted(new, key=moved):
            code = d.get("code")
            if surplus[code] > 0:
                surplus[code] -= 1
                loc = d["location"]
                out.append(f"{loc['row']}:{loc['column']}: {code or 'error'} {d.get('message', '')}")
        return sorted(out, key=lambda p: int(p.split(":")[0]))
    if path.endswith((".js", ".mjs", ".cjs")) and shutil.which("node"):
        err_after = _node_check(after, Path(path).suffix)
        if err_after and (before is None or not _node_check(before, Path(path).suffix)):
            return [err_after]
    return []


def _node_check(text: str, suffix: str) -> str:
    """node's syntax error for `text` ('' when it parses)."""
    with tempfile.NamedTemporaryFile("w", suffix=suffix, delete=False) as f:
        f.write(text)
    try:
        p = subprocess.run(["node", "--check", f.name], capture_output=True, text=True, timeout=_TIMEOUT)
    finally:
        os.unlink(f.name)
    if p.returncode == 0:
        return ""
    m = re.search(r":(\d+)\n", p.stderr)
    err = next((ln for ln in p.stderr.splitlines() if "Error" in ln), "SyntaxError")
    return f"{m.group(1) if m else 0}:1: {err.strip()}"


# -- format ------------------------------------------------------------------------------------------


def _formatter(root: Path, path: str) -> list[str] | None:
    if path.endswith((".py", ".pyi")):
        from agent.tools.lint import ruff_bin

        try:
            return [ruff_bin(), "format", "--stdin-filename", path, "-"]
        except Exception:  # noqa: BLE001
            return None
    if path.endswith((".js", ".mjs", ".cjs", ".ts", ".jsx", ".tsx")):
        local = root / "node_modules" / ".bin" / "prettier"
        exe = str(local) if local.is_file() else shutil.which("prettier")
        return [exe, "--stdin-filepath", path] if exe else None
    return None


def _configured(root: Path, path: str) -> bool:
    """The repository says it uses the formatter (then even an unformatted file must not get worse)."""
    if path.endswith((".py", ".pyi")):
        cfg = root / "pyproject.toml"
        text = cfg.read_text(errors="replace") if cfg.is_file() else ""
        return "[tool.ruff.format]" in text or "[tool.black]" in text or (root / "ruff.toml").is_file()
    return any((root / n).exists() for n in (".prettierrc", ".prettierrc.json", "prettier.config.js"))


def _format(cmd: list[str], text: str, root: Path) -> str | None:
    try:
        p = subprocess.run(cmd, input=text, capture_output=True, text=True, cwd=root, timeout=_TIMEOUT)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def format_issues(root: Path, path: str, before: str | None, after: str) -> list[int] | None:
    """Line numbers (in `after`) of lines the episode wrote that the formatter would rewrite; None when no
    formatter applies (none installed, or the file does not parse). Where the repository configures the
    formatter or the file was formatted before, every such line counts. Elsewhere the file has a style of
    its own (the synthetic repositories are `ast.unparse` output: single quotes, one blank line between
    functions), so the formatter keeps the file's quotes and only as many lines count as the edit added
    to what it rewrites anyway: an edit in the file's own style is clean, a sloppy one is not."""
    cmd = _formatter(root, path)
    if cmd is None:
        return None
    strict = _configured(root, path) or (before is not None and _rewritten(cmd, before, root) == set())
    if not strict and path.endswith((".py", ".pyi")):
        cmd = [*cmd, "--config", "format.quote-style = 'preserve'"]
    rewritten = _rewritten(cmd, after, root)
    if rewritten is None:
        return None
    a_lines = after.splitlines()
    written: set[int] = set()
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, (before or "").splitlines(), a_lines,
                                                       autojunk=False).get_opcodes():
        if tag in ("replace", "insert"):
            written.update(range(j1, j2))
    bad = sorted(n + 1 for n in written & rewritten)
    old = _rewritten(cmd, before, root) if before is not None else None
    if strict or old is None:
        return bad
    return bad[: max(0, len(rewritten) - len(old))]


def _rewritten(cmd: list[str], text: str, root: Path) -> set[int] | None:
    """0-based lines of `text` the formatter changes (None: it could not format the text)."""
    formatted = _format(cmd, text, root)
    if formatted is None:
        return None
    out: set[int] = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, text.splitlines(), formatted.splitlines(),
                                                       autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            out.update(range(i1, i2))
        elif tag == "insert":  # the formatter adds lines here: blame the lines on either side
            out.update({max(0, i1 - 1), i1})
    return out


# -- claims ------------------------------------------------------------------------------------------


def check_answer(answer: str, session: Any) -> dict[str, Any] | None:
    """The final answer's claims (agent/tasks/claims.py, shared with RL's evidence reward) checked against
    the episode's own tool log (a SessionData): those not supported (unsupported or contradicted), with
    the checker's evidence. None when there is no session or the checker is not installed."""
    try:
        from agent.tasks.claims import check_claims
    except ImportError:
        return None
    if session is None:
        return None
    claims = check_claims(answer, session)
    bad = [{"kind": c.kind, "status": c.status, "text": c.text, "evidence": c.evidence}
           for c in claims if c.status != "supported"]
    return {"checked": len(claims), "unsupported": bad}


# -- summaries ---------------------------------------------------------------------------------------

METRICS = ("test_edit", "lines_changed", "files_changed", "unneeded_files", "size_ratio", "new_lint",
           "format_issues", "unsupported_claims")


def figures(q: dict[str, Any] | None) -> dict[str, float | None]:
    """One episode's quality as numbers (None where not measured), what reports average and compare pairs."""
    if not q:
        return dict.fromkeys(METRICS)
    claims = q.get("claims")
    return {"test_edit": float(bool(q["test_edits"])), "lines_changed": q["lines_changed"],
            "files_changed": q["files_changed"],
            "unneeded_files": None if q["unneeded_files"] is None else len(q["unneeded_files"]),
            "size_ratio": q["size_ratio"], "new_lint": len(q["new_lint"]),
            # nothing written, nothing misformatted; files written with no formatter to ask: not measured
            "format_issues": len(q["format_issues"]) if q.get("format_checked") or not q["files_changed"] else None,
            "unsupported_claims": None if claims is None else len(claims["unsupported"])}
