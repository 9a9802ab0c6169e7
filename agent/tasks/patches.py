"""Unified diffs as a task builder writes them and as the quality metrics read them.

A builder that knows a task's fix writes it as `reference_patch` (git's a/ b/ form, so `git apply`
takes it); the quality metrics compare an episode's diff with it by files and by changed lines.
"""

from __future__ import annotations

import difflib
import re

_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$")


def make_patch(before: dict[str, str], after: dict[str, str]) -> str:
    """A unified diff turning `before` into `after` (paths relative to the repository root; a path
    missing from one side is a created or deleted file). Files are in sorted order."""
    out = []
    for path in sorted(set(before) | set(after)):
        a, b = before.get(path), after.get(path)
        if a == b:
            continue
        lines = list(difflib.unified_diff((a or "").splitlines(keepends=True), (b or "").splitlines(keepends=True),
                                          "/dev/null" if a is None else f"a/{path}",
                                          "/dev/null" if b is None else f"b/{path}"))
        out.append(f"diff --git a/{path} b/{path}\n")
        out.extend(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
    return "".join(out)


def patch_files(patch: str) -> list[str]:
    """The files a unified diff touches, in order (from `diff --git` headers, else `+++`/`---` lines)."""
    files: list[str] = []
    for line in patch.splitlines():
        m = _HEADER.match(line)
        if m:
            files.append(m.group(2))
    if not files:
        for line in patch.splitlines():
            if line.startswith(("+++ ", "--- ")):
                name = line[4:].split("\t")[0].strip()
                if name != "/dev/null":
                    files.append(name[2:] if name[:2] in ("a/", "b/") else name)
    return list(dict.fromkeys(files))


def patch_lines(patch: str) -> int:
    """Added plus removed lines of a unified diff (the headers are not counted)."""
    n = 0
    in_hunk = False
    for line in patch.splitlines():
        if line.startswith("@@"):
            in_hunk = True
        elif line.startswith("diff --git"):
            in_hunk = False
        elif in_hunk and line[:1] in "+-" and not line.startswith(("+++ ", "--- ")):
            n += 1
    return n
