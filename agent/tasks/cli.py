"""`composer-agent eval SUITE [--base-url URL] [--model M] [--concurrency N] [--repeat K] [--out DIR] [--resume]`

SUITE is a tasks JSONL or a built-in suite (synthetic, synthetic-heldout, synthetic-small, js-small). Real-code
suites are built into a tasks JSONL first: `python -m agent.tasks.stdlib_bugs --out DIR` (bugs injected
into the standard library, DIR/tasks.jsonl) and `python -m agent.tasks.swebench INPUT.jsonl --out
TASKS.jsonl --repos DIR` (SWE-bench-style rows over local repositories).
`--expert` serves the scripted expert on loopback and evaluates it (a check of the verifiers; generated suites);
`--expert --model expert-search` (or expert-grep) answers find-def questions by looking, through
semantic_search first (or grep alone), not from the known plan (agent/tasks/expert_find.py).
`composer-agent eval compare RUN_A RUN_B` compares two runs of the same tasks (agent/tasks/compare.py).
Exit codes: 0 done, 2 bad usage or configuration (the message says which).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path


def main(argv: list[str]) -> int:
    if argv[:1] == ["compare"]:
        from agent.tasks.compare import main as compare_main

        return compare_main(argv[1:])
    p = argparse.ArgumentParser(
        prog="composer-agent eval", description="Evaluate a model on a task suite.",
        epilog="real-code suites: python -m agent.tasks.stdlib_bugs --out DIR (then DIR/tasks.jsonl); "
               "python -m agent.tasks.swebench INPUT.jsonl --out TASKS.jsonl --repos DIR. "
               "Two runs, paired per task: composer-agent eval compare RUN_A RUN_B")
    p.add_argument("suite", help="tasks JSONL, or synthetic | synthetic-heldout | synthetic-small | js-small")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint (default: the configured one)")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", type=int, default=4, help="episodes at once (default 4)")
    p.add_argument("--repeat", type=int, default=1, help="episodes per task; reports pass@k with k = repeat")
    p.add_argument("--out", default=".composer/eval", help="results folder (default .composer/eval)")
    p.add_argument("--resume", action="store_true", help="skip episodes already in OUT/results.jsonl")
    p.add_argument("--limit", type=int, help="only the first N tasks")
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int, help="sampling seed sent with every request (two seeds: two samples)")
    p.add_argument("--max-output-tokens", type=int, help="max_tokens per model turn (the built-in model's: 96)")
    p.add_argument("--no-sandbox", action="store_true", help="run shell commands without bubblewrap")
    p.add_argument("--expert", action="store_true",
                   help="evaluate the scripted expert (synthetic suites); --model expert-search or expert-grep: "
                        "find definitions by semantic search first or by grep alone")
    args = p.parse_args(argv)

    from agent.config import ConfigError, load_config
    from agent.tasks.eval import EvalConfig, run_eval, table
    from agent.tasks.spec import TaskError
    from agent.tasks.suites import load_tasks

    try:
        tasks = load_tasks(args.suite)
        config = load_config(Path.cwd(), {k: v for k, v in {"base_url": args.base_url, "model": args.model,
                                                            "api_key": args.api_key,
                                                            "temperature": args.temperature,
                                                            "seed": args.seed,
                                                            "max_output_tokens": args.max_output_tokens,
                                                            }.items() if v is not None})
        ecfg = EvalConfig(args.concurrency, args.repeat, False if args.no_sandbox else None)
    except (TaskError, ConfigError, ValueError) as e:
        print(f"composer-agent eval: error: {e}", file=sys.stderr)
        return 2
    tasks = tasks[: args.limit] if args.limit else tasks
    expert = None
    if args.expert:
        from agent.tasks.expert_find import EXPERTS, expert_server

        if args.model is not None and args.model not in EXPERTS:
            print(f"composer-agent eval: error: with --expert, --model names the expert: {', '.join(EXPERTS)}",
                  file=sys.stderr)
            return 2
        expert = expert_server(tasks, args.model).__enter__()
        config = replace(config, base_url=expert.base_url, model=expert.model)
    try:
        from agent.client import ModelError, OpenAIClient

        try:
            name, _ = OpenAIClient(config).check()
        except ModelError as e:
            print(f"composer-agent eval: error: {e}", file=sys.stderr)
            return 2
        config = replace(config, model=name)
        report = run_eval(tasks, config, ecfg, args.out, resume=args.resume)
    finally:
        if expert is not None:
            expert.__exit__(None, None, None)
    print(table(report, args.repeat))
    print(f"\n{report['overall'].get('episodes')} episodes in {report['wall_s']} s; report: "
          f"{Path(args.out) / 'report.json'}")
    return 0
