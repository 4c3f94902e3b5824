"""The `edgerun` command line: the parser of every subcommand (edgerun.commands, one module each), and main."""

from __future__ import annotations

import argparse
import sys

from edgerun.errors import EdgerunError


def build_parser() -> argparse.ArgumentParser:
    from edgerun import __version__
    from edgerun.commands import (
        bench,
        generate,
        loss_eval,
        master,
        model,
        netem,
        node,
        plan,
        profile,
        sap,
        serve,
        status,
        testbed,
        tune,
    )
    from edgerun.commands.common import DEFAULT_THREADS

    parser = argparse.ArgumentParser(
        prog="edgerun",
        description="Run one LLM across several small, unequal devices on a lossy network.",
    )
    parser.add_argument("--version", action="version", version=f"edgerun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (generate, profile, plan, master):
        command.add_parser(sub)
    serve.add_commands(sub, DEFAULT_THREADS)
    for command in (tune, node, model, bench, testbed, netem, status, sap, loss_eval):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except EdgerunError as e:
        print(f"edgerun: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edgerun: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
