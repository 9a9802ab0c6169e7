"""Import SWE-bench-style JSONL into tasks: for users who have such data and the repositories locally.

    python -m agent.tasks.swebench INPUT.jsonl --out TASKS.jsonl [--repos DIR] [--split heldout]

Each row has SWE-bench's fields: instance_id, repo ("owner/name"), base_commit, problem_statement,
test_patch, FAIL_TO_PASS and PASS_TO_PASS (JSON-encoded lists of pytest test ids, or lists); others
(version, environment_setup_commit, hints_text, created_at) are ignored, but `patch` (the gold fix) becomes
the task's `reference_patch`, which the eval's quality metrics compare an episode's diff with. INPUT may also be a
JSON array of such rows. `repo` is resolved to a local git repository: DIR/owner__name, then DIR/name
(DIR defaults to INPUT's folder), or the value itself when it is a path to one. Rows whose repository
or base commit is not there, or whose tests are not pytest ids, are skipped with a message on stderr.

A task checks out the repository at base_commit (a private clone per episode), asks the problem
statement, and verifies by applying test_patch (hidden from the agent) and running the FAIL_TO_PASS and
PASS_TO_PASS tests with pytest. The environment (dependencies) is the user's: the verify command runs
`python -m pytest` with whatever `python` is on PATH. JavaScript rows (`language` "javascript", or ids
that name .js files: "test/a.test.js" or "test/a.test.js::test name") are verified with node's own test
runner instead (`node --test`, names as a --test-name-pattern); TypeScript rows are skipped.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from agent.tasks.spec import Task, TaskError, read_jsonl, write_tasks

FAMILY = "swe"
REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
PYTEST = "python -m pytest -q -p no:cacheprovider -rfE"
# JavaScript rows (SWE-bench Multilingual style, `language` "javascript" or ids naming .js files) run with
# node's own test runner: an id is a test file, or "file::test name" (a name pattern, matched whole).
JS_LANGUAGES = ("javascript", "js")
JS_FILE = (".js", ".mjs", ".cjs")
# Django-style ids ("test_name (module.Class)") need the project's own runner, not pytest.
_NOT_PYTEST = re.compile(r"^\S+ \([\w.]+\)$")


class Skipped(Exception):
    """A row that cannot become a task here (the message says why)."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (or of a JSON array)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        rows = json.loads(text)
        if not all(isinstance(r, dict) for r in rows):
            raise TaskError(f"{path}: a JSON array of objects was expected")
        return rows
    return [row for _, row in read_jsonl(path)]


def parse_test_ids(value: Any, field_name: str) -> list[str]:
    """A FAIL_TO_PASS / PASS_TO_PASS value: a JSON-encoded list (SWE-bench's form) or a list."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise Skipped(f"{field_name} is not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise Skipped(f"{field_name} must be a list of test ids")
    return list(value)


def resolve_repo(repo: str, repos_dir: Path) -> Path:
    """The local git repository for "owner/name": repos_dir/owner__name, then repos_dir/name, or `repo`
    itself when it is a path to a repository."""
    candidates = []
    if "/" in repo and not Path(repo).is_absolute():
        owner, _, name = repo.partition("/")
        candidates += [repos_dir / f"{owner}__{name}", repos_dir / name]
    candidates.append(Path(repo).expanduser() if Path(repo).is_absolute() else repos_dir / repo)
    for c in candidates:
        if c.is_dir() and _git_ok(c, "rev-parse", "--git-dir"):
            return c.resolve()
    raise Skipped(f"repository {repo} not found locally (looked for {', '.join(str(c) for c in candidates)})")


def _git_ok(cwd: Path, *args: str) -> bool:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True).returncode == 0


def is_js(row: dict[str, Any], ids: list[str]) -> bool:
    lang = str(row.get("language", "")).lower()
    if lang in ("typescript", "ts"):
        raise Skipped("TypeScript tests need a loader node does not have; this importer runs plain node --test")
    return lang in JS_LANGUAGES or all(i.split("::", 1)[0].endswith(JS_FILE) for i in ids)


def node_verify_command(fail_to_pass: list[str], pass_to_pass: list[str]) -> str:
    """node --test on the listed files; with test names (file::name, every id), only those tests run."""
    ids = list(dict.fromkeys(fail_to_pass + pass_to_pass))
    files = list(dict.fromkeys(i.split("::", 1)[0] for i in ids))
    cmd = "node --test"
    if all("::" in i for i in ids):
        names = sorted({re.escape(i.split("::", 1)[1]) for i in ids})
        cmd += " --test-name-pattern=" + shlex.quote(f"^({'|'.join(names)})$")
    return f"{cmd} {' '.join(shlex.quote(f) for f in files)}"


def verify_command(fail_to_pass: list[str], pass_to_pass: list[str]) -> str:
    """pytest on the listed ids, each quoted for the shell; `--` so an id never reads as an option."""
    ids = list(dict.fromkeys(fail_to_pass + pass_to_pass))
    return f"{PYTEST} -- {' '.join(shlex.quote(i) for i in ids)}"


def to_task(row: dict[str, Any], repos_dir: Path, split: str = "", max_turns: int = 40,
            max_time_s: float = 1800.0, verify_timeout_s: float = 600.0) -> Task:
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise Skipped(f"missing fields {missing}")
    iid = str(row["instance_id"]).strip()
    if not iid:
        raise Skipped("empty instance_id")
    f2p, p2p = parse_test_ids(row["FAIL_TO_PASS"], "FAIL_TO_PASS"), parse_test_ids(row["PASS_TO_PASS"], "PASS_TO_PASS")
    if not f2p:
        raise Skipped("FAIL_TO_PASS is empty: nothing to verify")
    js = is_js(row, f2p + p2p)
    odd = [i for i in f2p + p2p if _NOT_PYTEST.match(i)]
    if odd and not js:
        raise Skipped(f"test ids are not pytest ids (e.g. {odd[0]!r}); this importer runs pytest or node --test")
    if not str(row["problem_statement"]).strip():
        raise Skipped("empty problem_statement")
    repo = resolve_repo(str(row["repo"]), repos_dir)
    commit = str(row["base_commit"]).strip()
    if not re.fullmatch(r"[0-9a-fA-F]{4,40}", commit) or not _git_ok(repo, "cat-file", "-e", f"{commit}^{{commit}}"):
        raise Skipped(f"base_commit {commit!r} is not in {repo}")
    patch = str(row["test_patch"])
    if patch and not patch.endswith("\n"):
        patch += "\n"
    verify = node_verify_command(f2p, p2p) if js else verify_command(f2p, p2p)
    return Task(id=iid, prompt=str(row["problem_statement"]).strip(), verify=verify,
                repo=str(repo), commit=commit, hidden_patch=patch, max_turns=max_turns, max_time_s=max_time_s,
                verify_timeout_s=verify_timeout_s, family=FAMILY, tag=str(row.get("repo", "")), split=split,
                reference_patch=str(row["patch"]) if row.get("patch") else None,
                meta={"instance_id": iid, "repo": row["repo"], "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
                      "language": "javascript" if js else "python",
                      **({"version": row["version"]} if row.get("version") else {})})


def import_rows(rows: list[dict[str, Any]], repos_dir: str | Path, split: str = "", log=None,
                **limits: Any) -> list[Task]:
    """Tasks for the rows that can be used here; the others are reported through `log` and skipped."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    tasks, seen = [], set()
    for n, row in enumerate(rows, 1):
        label = row.get("instance_id") or f"row {n}"
        try:
            task = to_task(row, Path(repos_dir), split, **limits)
        except (Skipped, TaskError) as e:
            log(f"skipped {label}: {e}")
            continue
        if task.id in seen:
            log(f"skipped {label}: duplicate instance_id")
            continue
        seen.add(task.id)
        tasks.append(task)
    return tasks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.tasks.swebench",
                                description="Turn SWE-bench-style JSONL into a task file (local repositories).")
    p.add_argument("input", help="SWE-bench-style JSONL (or JSON array)")
    p.add_argument("--out", required=True, help="the tasks JSONL to write")
    p.add_argument("--repos", help="folder holding the repositories as owner__name or name (default: INPUT's folder)")
    p.add_argument("--split", default="", choices=["", "train", "heldout"])
    p.add_argument("--max-turns", type=int, default=40)
    p.add_argument("--max-time", type=float, default=1800.0, help="seconds per episode (default 1800)")
    p.add_argument("--verify-timeout", type=float, default=600.0, help="seconds for the tests (default 600)")
    args = p.parse_args(argv)
    try:
        rows = read_rows(args.input)
    except (OSError, TaskError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    repos = Path(args.repos) if args.repos else Path(args.input).resolve().parent
    tasks = import_rows(rows, repos, args.split, max_turns=args.max_turns, max_time_s=args.max_time,
                        verify_timeout_s=args.verify_timeout)
    if not tasks:
        print(f"no usable rows out of {len(rows)}", file=sys.stderr)
        return 1
    write_tasks(tasks, args.out)
    print(f"{len(tasks)} tasks out of {len(rows)} rows: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
