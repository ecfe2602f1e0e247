"""The ``cannikin`` command: ``demo`` (the main job), ``simulate``, ``plan`` and ``launch``.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds
its parser and sets ``func`` to a callable taking the parsed namespace and returning an
exit code. Heavy imports (torch, matplotlib) happen inside those callables only.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

_SUBCOMMANDS = ("demo", "simulate", "plan", "launch")


class _Parser(argparse.ArgumentParser):
    """argparse, but bad input prints one line and exits with status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cannikin", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in _SUBCOMMANDS:
        importlib.import_module(f"cannikin.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
