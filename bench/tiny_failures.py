"""Why composer-tiny fails the bugfix tasks it fails, and whether their fix was in its training data.

    python bench/tiny_failures.py EPISODES_DIR [--train-seeds 500] [--size small] [--out FILE.json]

EPISODES_DIR is the folder `bench/tiny_heldout.py` prints at the end ("episodes: ..."): one `NAME-KIND`
folder per model with the eval runner's results.jsonl and sessions. Each failed episode gets the first
of these that fits:
  wrong file read first   its first read_file named a file that does not exist (a misrecalled module);
  no edit                 it never called edit_file;
  first edit failed ...   its first edit's old_string was not in the file; then whether it edited again
                          and whether a later edit applied;
  edit applied            an edit applied but the tests still fail.
Passed episodes whose first edit failed are counted as recoveries.
A task is "covered" when the expert's edit (same file, old_string and new_string) is the edit of some
training seed 0..N-1: the model may have memorised it. Bugfix tasks of seen code are few distinct edits.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/train.py must not shadow train/


@functools.cache
def expert_edit(seed: int, size: str) -> tuple[str, str, str]:
    """The expert's fix of bugfix task `seed`: (path, old_string, new_string)."""
    from agent.tasks.families import build

    args = next(c["arguments"] for turn in build("bugfix", seed, size).plan for c in turn.get("tool_calls") or []
                if c["name"] == "edit_file")
    return args["path"], args["old_string"], args["new_string"]


def first_fault(session: Path) -> str:
    from agent.session import load

    messages = [m for segment in load(session).segments for m in segment]
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}
    results = [(names.get(m.get("tool_call_id"), "?"), str(m.get("content")))
               for m in messages if m.get("role") == "tool"]
    reads = [text for name, text in results if name == "read_file"]
    edits = [text for name, text in results if name == "edit_file"]
    if reads and reads[0].startswith("Error"):
        return "wrong file read first"
    if not edits:
        return "no edit"
    if not edits[0].startswith("Error"):
        return "edit applied, tests still fail"
    if len(edits) == 1:
        return "first edit failed, no retry"
    later_ok = any(not e.startswith("Error") for e in edits[1:])
    return "first edit failed, retried" + (", a later edit applied" if later_ok else ", every retry failed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("episodes", type=Path)
    ap.add_argument("--train-seeds", type=int, default=500, help="SFT's training seeds 0..N-1 (the recipe's --train-seeds)")
    ap.add_argument("--size", default="small")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    trained = {expert_edit(s, args.size) for s in range(args.train_seeds)}
    report = {"train_seeds": args.train_seeds, "distinct_training_edits": len(trained), "models": {}}
    folders = sorted(p for p in args.episodes.iterdir() if (p / "results.jsonl").is_file())
    if not folders:
        raise SystemExit(f"no NAME-KIND/results.jsonl under {args.episodes}")
    for folder in folders:
        kinds: Counter[str] = Counter()
        cover = Counter()
        recovered = 0
        rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
        for row in rows:
            if not row["task_id"].startswith("bugfix-"):
                continue
            seed = int(row["task_id"].rsplit("-", 1)[1])
            covered = expert_edit(seed, args.size) in trained
            cover[f"{'covered' if covered else 'not covered'}, {'passed' if row['passed'] else 'failed'}"] += 1
            kind = first_fault(Path(row["session_path"]))
            if not row["passed"]:
                kinds[kind] += 1
            elif kind.startswith("first edit failed"):
                recovered += 1
        report["models"][folder.name] = {"tasks": sum(cover.values()), "coverage": dict(sorted(cover.items())),
                                         "failures": dict(kinds.most_common()), "passed_after_a_failed_first_edit": recovered}
        print(f"{folder.name}: {dict(sorted(cover.items()))}\n  failures: {dict(kinds.most_common())}\n"
              f"  passed after a failed first edit: {recovered}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
