"""Does a composer-tiny checkpoint give the same answer whatever folder and day it runs in? Each task
(new seeds of the training code) runs in several environments, a workspace folder and the date the
system prompt names, as `composer-agent demo` runs it with the built-in model (float64, greedy, its
token cap), and the checker says green or not.

    python bench/tiny_environments.py NAME=MODEL_DIR... [--family bugfix] [--seeds 30] [--base 50000]
        [--envs FILE (lines: FOLDER DATE)] [--out bench/tiny/varied-env/environments.json]

Prints, per model, how many tasks went green in each environment, in all, in some and in none.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENVIRONMENTS = [  # folders of the shapes users and test runners make, on dates after training's
    ("/tmp/composer-bench-env/x/repo", "2026-11-23"),
    ("/tmp/composer-bench-env/pytest-of-root/pytest-1242/test_the_builtin_model_solves_0/d", "2026-11-24"),
    ("/tmp/composer-bench-env/pytest-of-ci/pytest-7/test_composer_agent_task_with_0/repo", "2026-12-01"),
    ("/tmp/composer-bench-env/home/newcomer/projects/composer-demo", "2027-01-15"),
    ("/tmp/composer-bench-env/composer-demo-k2j4h1x9/repo", "2026-11-30"),
    ("/tmp/composer-bench-env/var/demo", "2027-06-30"),
]


def run(model_dir: str, family: str, seeds: list[int], envs: list[tuple[str, str]]) -> dict[int, list[bool]]:
    from agent import demo
    from agent.approval import Approvals
    from agent.builtin_model import launch, wait_ready
    from agent.runtime import build

    server = launch(Path(model_dir), extra_args=("--dtype", "float64"))  # as the built-in model asks
    results: dict[int, list[bool]] = {}
    try:
        wait_ready(server)
        for seed in seeds:
            task = demo.demo_task(family, seed)
            oks = []
            for folder, date in envs:
                root = Path(folder)
                shutil.rmtree(root, ignore_errors=True)
                demo.write_repo(root, task)
                rt = build(demo.demo_config(task, server), root, emit=lambda e: None, approve=Approvals("auto"),
                           date=date)
                finished = rt.agent.run(task.prompt, rt.system)
                rt.session.close()
                oks.append(demo.green(root, task, finished.final_text)[0])
                shutil.rmtree(root, ignore_errors=True)
            results[seed] = oks
            print(f"{family} {seed}: {''.join('G' if ok else '.' for ok in oks)}", flush=True)
    finally:
        server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="NAME=MODEL_DIR")
    ap.add_argument("--family", default="bugfix")
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--base", type=int, default=50_000, help="first seed (50,000+: new tasks of the training code)")
    ap.add_argument("--envs", help="a file of lines FOLDER DATE (default: the 6 built in)")
    ap.add_argument("--out", default="bench/tiny/varied-env/environments.json")
    args = ap.parse_args(argv)
    envs = [tuple(line.split()) for line in Path(args.envs).read_text().splitlines() if line.strip()] \
        if args.envs else ENVIRONMENTS
    seeds = list(range(args.base, args.base + args.seeds))
    summary = {"family": args.family, "seeds": seeds, "environments": envs, "results": {}}
    for spec in args.models:
        name, _, model = spec.partition("=")
        summary["results"][name] = run(model, args.family, seeds, envs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print("\n| model | green per environment | in all | in some | in none |\n| --- | --- | --- | --- | --- |")
    for name, res in summary["results"].items():
        per_env = [sum(v[i] for v in res.values()) for i in range(len(envs))]
        every, some = sum(all(v) for v in res.values()), sum(any(v) for v in res.values())
        print(f"| {name} | {', '.join(map(str, per_env))} | {every} | {some - every} | {len(res) - some} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
