"""`composer-agent`: the entry point. Flags live here and nowhere else.

    composer-agent [options]                 interactive (full-screen), in the current repository
    composer-agent --plain [options]         interactive, line by line
    composer-agent --task "TEXT" [--json]    headless
    composer-agent acp [options]             an Agent Client Protocol server on stdio, for editors (Zed, ...)
    composer-agent demo                      a small failing repository fixed by the built-in model
    composer-agent index [--rebuild]         build or refresh the semantic search index
    composer-agent search "QUERY" [-k N] [--json]

Heavy modules are imported only inside the code paths that need them, so `--help` and `--version`
stay fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agent import __version__

SUBCOMMANDS = {"index": "main_index", "search": "main_search"}


class Parser(argparse.ArgumentParser):
    json_errors = False  # with --json a usage error also ends stdout with a failure event, for scripts

    def error(self, message: str):  # type: ignore[override]
        if self.json_errors:
            from agent.headless import json_failure

            json_failure("usage", message)
        super().error(message)


def build_parser() -> Parser:
    p = Parser(
        prog="composer-agent",
        description="Composer: a fast, local-first coding agent. Without --task it opens the interactive "
                    "interface in the current repository.",
        epilog="Subcommands: `composer-agent acp` (for editors), `composer-agent demo`, `composer-agent eval SUITE`, `composer-agent index [--rebuild]`, `composer-agent search QUERY [-k N] [--json]`.",
    )
    p.add_argument("--version", action="version", version=f"composer-agent {__version__}")
    p.add_argument("--task", metavar="TEXT",
                   help="run this task headless and print the final answer (- reads it from stdin)")
    p.add_argument("--cwd", metavar="DIR", type=Path, help="workspace root (default: the current directory)")
    p.add_argument("--json", action="store_true", help="headless: print one JSON event per line on stdout")
    p.add_argument("--plain", action="store_true",
                   help="line-by-line interface instead of the full-screen one (automatic when stdout is "
                        "not a terminal or TERM=dumb)")
    p.add_argument("--resume", metavar="ID|last", help="continue a saved session")
    p.add_argument("--add-dir", metavar="DIR", action="append",
                   help="let the tools also read and write this folder outside the workspace (repeatable)")
    p.add_argument("--approval", choices=["auto", "ask", "read-only"],
                   help="which tool calls need a yes: shell and writes (interactive default ask; "
                        "headless: read-only by default, auto lets the run edit files and run commands)")
    p.add_argument("--mode", choices=["code", "ask", "plan"],
                   help="code: tools as --approval allows (default); ask: answers from read-only tools; plan: "
                        "read-only, ends with a plan as a todo list. In ask and plan no file is written and no "
                        "shell command runs, whatever --approval says. --resume without --mode: the session's "
                        "own mode")
    p.add_argument("--sandbox", action="store_true", default=None,
                   help="run shell commands under bubblewrap: no network, writes only in the workspace")
    m = p.add_argument_group("model server")
    m.add_argument("--base-url", help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (default: "
                   "COMPOSER_BASE_URL or the config; with none, the small built-in model is served locally)")
    m.add_argument("--model", help="model name (default: the first one the server lists)")
    m.add_argument("--api-key", help="API key (or COMPOSER_API_KEY)")
    m.add_argument("--context-window", type=int, metavar="TOKENS",
                   help="context size (default: the server's, else 128k); summarised at 80%%")
    m.add_argument("--record-tokens", action="store_true", default=None,
                   help="record the sampled token ids and logprobs in the session, for RL training "
                        "(needs composer-serve or vLLM >= 0.10.2)")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-turns", type=int, metavar="N", help="model requests per task (default 100)")
    lim.add_argument("--max-time", type=float, metavar="SECONDS", help="wall-clock limit per task")
    lim.add_argument("--token-budget", type=int, metavar="N", help="prompt + completion tokens per task")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        return _subcommand(argv[0], argv[1:])
    if argv and argv[0] == "eval":
        from agent.tasks.cli import main as eval_main

        return eval_main(argv[1:])
    if argv and argv[0] == "demo":
        from agent.demo import main as demo_main

        return demo_main(argv[1:])
    acp = bool(argv) and argv[0] == "acp"  # the same flags; stdout then carries only JSON-RPC
    if acp:
        argv = argv[1:]
    parser = build_parser()
    parser.json_errors = "--json" in argv
    args = parser.parse_args(argv)
    if acp and (args.task is not None or args.json or args.plain):
        parser.error("acp takes no --task, --json or --plain: the editor sends the prompts")
    if args.task == "-":  # the task from a pipe or a file: `composer-agent --task - < task.md`
        if sys.stdin.isatty():
            parser.error("--task - reads the task from stdin, but stdin is a terminal; pipe or redirect it in")
        args.task = sys.stdin.read().rstrip()
        if not args.task.strip():
            parser.error("--task -: stdin is empty")

    from agent.config import ConfigError, endpoint_source, load_config

    root = (args.cwd or Path.cwd()).resolve()
    if not root.is_dir():
        parser.error(f"--cwd {args.cwd} is not a directory")
    flags = {"base_url": args.base_url, "model": args.model, "api_key": args.api_key,
             "context_window": args.context_window, "max_turns": args.max_turns, "max_time_s": args.max_time,
             "token_budget": args.token_budget, "approval": args.approval, "sandbox": args.sandbox,
             "add_dirs": args.add_dir, "record_tokens": args.record_tokens}
    headless = args.task is not None or args.json
    if acp:
        from agent.acp import main as acp_main

        return acp_main(root, flags, args.mode)
    if args.json and args.task is None and not args.resume:
        parser.error("--json needs --task (or --resume to continue a saved session)")
    try:
        # Interactively a person is there to answer, so shell and writes ask unless configured otherwise.
        # Headless nobody is: a run changes nothing unless asked to (--approval auto), as `codex exec`
        # runs read-only without --full-auto; a model pointed at a repository it does not know (the
        # built-in one above all) must not edit it unasked.
        defaults = {"approval": "read-only" if headless else "ask"}
        config = load_config(root, flags, defaults=defaults)
        config.extra_roots(root)  # a missing added folder is a usage error now, not mid-run
    except ConfigError as e:
        print(f"composer-agent: error: {e}", file=sys.stderr)
        return _json_failure(args, "config", str(e), 2)
    if headless and args.task is not None and not args.task.strip():
        parser.error("--task is empty")
    if headless:  # its first line says what it may change, before the model (perhaps the built-in) starts
        from agent.headless import announce

        code = announce(config, root, as_json=args.json, mode=args.mode or "code")
        if code is not None:
            return code
    server = None
    if endpoint_source(root, flags) is None:  # nothing configured: serve the built-in model ourselves
        from agent.builtin_model import BuiltinModelError, start_builtin

        try:
            server = start_builtin(notice=headless)  # interactive sessions open with it themselves
        except BuiltinModelError as e:
            print(f"composer-agent: error: {e}", file=sys.stderr)
            return _json_failure(args, "builtin_model", str(e), 2)
        except KeyboardInterrupt:  # Ctrl-C while it loads: start_builtin has stopped the child
            print("\ncomposer-agent: interrupted", file=sys.stderr)
            return 130
        server.configure(config)  # its URL; greedy, short turns unless configured otherwise
    try:
        return _run(args, config, root, headless)
    finally:
        if server is not None:
            server.stop()


def _run(args: argparse.Namespace, config, root: Path, headless: bool) -> int:
    if headless:
        from agent import headless as headless_mode

        return headless_mode.run(config, root, args.task, as_json=args.json, resume=args.resume, mode=args.mode)
    if args.plain or not full_terminal():
        from agent.plain import run as run_plain

        return run_plain(config, root, resume=args.resume, mode=args.mode)
    from agent.tui import run as run_tui

    return run_tui(config, root, resume=args.resume, mode=args.mode)


def _json_failure(args: argparse.Namespace, kind: str, message: str, code: int) -> int:
    """With --json, a failure before the run also ends stdout with its `finished` event."""
    if args.json:
        from agent.headless import json_failure

        json_failure(kind, message)
    return code


def full_terminal() -> bool:
    """Whether a full-screen app can run: both ends are terminals and the terminal is not dumb."""
    term = os.environ.get("TERM", "")
    return sys.stdin.isatty() and sys.stdout.isatty() and term not in ("", "dumb", "unknown")


OUR_PACKAGES = {"agent", "index", "serve", "train", "kernels", "bench"}


def missing_extra(prog: str, e: ImportError, extra: str, what: str) -> int:
    """A package of an extra that is not installed: say which extra to install (exit 2), not a traceback."""
    name = getattr(e, "name", None) or str(e)
    if name.split(".")[0] in OUR_PACKAGES:  # our own module failing to import is a bug: show it
        raise e
    print(f"{prog}: {what} needs the `{extra}` extra ({name} is not installed): "
          f"pip install -e '.[{extra}]'", file=sys.stderr)
    return 2


def _subcommand(name: str, rest: list[str]) -> int:
    prog = f"composer-agent {name}"
    try:
        import index.cli as index_cli
    except ImportError as e:
        return missing_extra(prog, e, "index", "semantic search")
    root = Path.cwd()
    if "--cwd" in rest:
        i = rest.index("--cwd")
        if i + 1 >= len(rest):
            print(f"composer-agent {name}: --cwd needs a directory", file=sys.stderr)
            return 2
        root = Path(rest[i + 1])
        rest = rest[:i] + rest[i + 2:]
    try:
        return getattr(index_cli, SUBCOMMANDS[name])(rest, root.resolve())
    except ImportError as e:  # the index extra's packages are imported lazily, on first use
        return missing_extra(prog, e, "index", "semantic search")


if __name__ == "__main__":
    sys.exit(main())
