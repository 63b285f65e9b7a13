"""The ``gradsync`` command line: ``train``, ``bench``, ``sweep``, ``profile``, ``doctor``, ``simulate``
(see ``gradsync CMD --help``); a module per subcommand."""

from __future__ import annotations

import argparse
import sys

from . import bench, doctor, profile, simulate, sweep, train

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradsync", description=__doc__.split("; a module")[0] + ".")
    sub = parser.add_subparsers(dest="command", required=True)
    train.add_parser(sub)
    bench.add_parser(sub)
    sweep.add_parser(sub)
    profile.add_parser(sub)
    doctor.add_parser(sub)
    simulate.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..launch import imports_without_collection

    with imports_without_collection():  # the subcommands' options import torch
        parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.error(str(exc))
    except Exception as exc:  # a local rank failed: one message, not the launcher's traceback
        from ..launch import RankFailure

        if not isinstance(exc, RankFailure):
            raise
        report = getattr(exc, "report", None)
        print(report(argv) if report else f"gradsync: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gradsync: interrupted", file=sys.stderr)
        return 130


__all__ = ["build_parser", "main"]
