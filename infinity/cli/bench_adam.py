"""``infinity bench adam``: the old name of ``infinity bench optim --optimizers adam``.

Kept so scripts and docs that call it keep working; it prints a one-line note
(on stderr: ``--json`` still ends stdout with the JSON object) and runs
:mod:`infinity.cli.bench_optim` with Adam as the default optimizer.
"""

from __future__ import annotations

import argparse
import sys

from infinity.cli import bench_optim


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``infinity bench optim``, with ``--optimizers adam`` by default."""
    bench_optim.add_arguments(parser, optimizers="adam")


def run(args: argparse.Namespace) -> int:
    """Print the deprecation note, then run ``infinity bench optim``."""
    sys.stderr.write(
        "infinity: note: `infinity bench adam` is now `infinity bench optim --optimizers adam` "
        "(the old name will go)\n"
    )
    return bench_optim.run(args)
