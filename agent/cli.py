"""`composer-agent`: the entry point. Flags live here and nowhere else.

Heavy modules are imported only inside the code paths that need them, so `--help` and `--version`
stay fast.
"""

from __future__ import annotations

import argparse
import sys

from agent import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-agent",
        description="Composer: a fast, local-first coding agent.",
    )
    p.add_argument("--version", action="version", version=f"composer-agent {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
