"""Entry point of the ``infinity`` command: dispatches to one module per command.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their command runs, so ``infinity --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

# (command path, module, help)
_COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("train",), "infinity.cli.train", "train a GPT-style model beyond the memory budgets"),
    (("plan",), "infinity.cli.plan", "show where each kind of state would live, and traffic"),
    (("bench", "nvme"), "infinity.cli.bench_nvme", "NVMe throughput sweep (vs a Python baseline)"),
    (("bench", "adam"), "infinity.cli.bench_adam", "CPU-Adam throughput vs torch AdamW(fused)"),
    (("bench", "train"), "infinity.cli.bench_train", "end-to-end step time vs plain PyTorch"),
]


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit code 2."""


def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infinity", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text in _COMMANDS:
        if len(path) == 1:
            target = sub.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                group = sub.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = group.add_subparsers(dest="subcommand", required=True)
            target = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        target.set_defaults(_module=module)
        # Only the selected command's module is imported to add its flags.
        if argv[: len(path)] == list(path):
            importlib.import_module(module).add_arguments(target)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = _build_parser(argv).parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except CommandError as exc:
        print(f"infinity: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("infinity: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The process entry point (``infinity`` and ``python -m infinity``): run
    :func:`main`, then exit with its code.

    NOTE: a command's own Ctrl-C handling ends when it returns. A second Ctrl-C
    pressed while the process winds down (engine finalizers, interpreter
    shutdown) would otherwise kill it by signal or print a traceback after a
    clean stop; the run is already over, so it is ignored.
    """
    try:
        code = main()
    except KeyboardInterrupt:  # landed between the command's handlers and here
        code = 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _forget_caught_interrupt()
    sys.exit(code)


def _forget_caught_interrupt() -> None:
    """Stop CPython from turning a Ctrl-C we handled into a death by SIGINT at exit.

    NOTE: CPython flags a KeyboardInterrupt that ends code run through
    ``PyRun_String`` as unhandled even when a caller catches it (extension
    code in the training step runs such code), and under ``python -m`` it then
    kills the process with SIGINT after a clean exit: exit -2 instead of 130
    in about 1 run in 8 with two quick Ctrl-Cs. Running an empty string
    through the same path resets the flag.
    """
    if sys.implementation.name != "cpython":
        return
    import ctypes

    try:
        ctypes.pythonapi.PyRun_SimpleString(b"")
    except (AttributeError, OSError):
        pass
