"""The `dimmer` command line. Exit status: 0 done, 2 bad input, 1 anything else."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dimmer import __version__


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dimmer", description="Power-transient controller for AI training campuses.")
    p.add_argument("--version", action="version", version=f"dimmer {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("controllers", help="list the controllers this version provides")
    args = p.parse_args(argv)
    if args.command == "controllers":
        from dimmer.control import controller_names

        sys.stdout.write("\n".join(controller_names()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
