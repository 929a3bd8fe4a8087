"""Entry point of the ``infinity`` command: one module per command.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``
(``module:name`` names an object of the module that does); modules are imported
only when their command runs, so ``infinity --help`` is fast. ``infinity train``
is the package ``infinity/cli/train/``, ``infinity plan`` ``plan.py``; the
``infinity bench`` commands live beside their measurements in ``infinity/bench/``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import signal
import sys
from typing import Any

DESCRIPTION = (
    "Train PyTorch models larger than GPU and host memory: parameters, gradients\n"
    "and optimizer states live in chunks over the GPU, host RAM and an NVMe disk."
)

# (command path, module, help, example)
_COMMANDS: list[tuple[tuple[str, ...], str, str, str]] = [
    (
        ("train",),
        "infinity.cli.train",
        "train a GPT beyond the memory budgets, or fine-tune a local transformers model",
        "infinity train --preset tiny\n  infinity train --model ./llama --data notes.txt",
    ),
    (
        ("plan",),
        "infinity.cli.plan",
        "show where each kind of state would live, and traffic",
        "infinity plan --model 7b --device-memory 24GiB --host-memory 64GiB --nvme-path /nvme",
    ),
    (
        ("bench", "nvme"),
        "infinity.bench.nvme",
        "NVMe throughput sweep (vs a Python baseline)",
        "infinity bench nvme --path /nvme --size 1GiB",
    ),
    (
        ("bench", "optim"),
        "infinity.bench.optim",
        "CPU Adam, Lion and SGD kernels vs torch's, against the memory roofline",
        "infinity bench optim --optimizers adam,lion --size 16M",
    ),
    (
        ("bench", "adam"),
        "infinity.bench.optim:RenamedAdam",
        "old name of `bench optim --optimizers adam`",
        "infinity bench adam --size 16M",
    ),
    (
        ("bench", "train"),
        "infinity.bench.train",
        "end-to-end step time vs plain PyTorch",
        "infinity bench train --layers 4 --hidden 256",
    ),
    (
        ("bench", "scale"),
        "infinity.bench.scale",
        "train the largest Llama the free disk holds (states beyond RAM)",
        "infinity bench scale --nvme-path /nvme --params 500M",
    ),
]
_GROUPS = {"bench": "measure the engine's parts against baselines"}


def _table(paths: list[tuple[str, ...]]) -> str:
    """One line per command: its name and what it does."""
    rows = [c for c in _COMMANDS if c[0] in paths]
    width = max(len(" ".join(path)) for path, *_ in rows)
    return "\n".join(f"{' '.join(path):<{width}}  {help_text}" for path, _, help_text, _ in rows)


def _examples(paths: list[tuple[str, ...]]) -> str:
    """One example per command, and where to read more."""
    lines = ["examples:"] + [f"  {example}" for path, *_, example in _COMMANDS if path in paths]
    return "\n".join([*lines, "", "`infinity COMMAND --help` lists a command's options."])


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit code 2."""


def _subcommands(
    parser: argparse.ArgumentParser, prog: str, paths: list[tuple[str, ...]], metavar: str
) -> argparse._SubParsersAction:
    """The commands under ``parser``, listed by :func:`_table`.

    argparse's own list would show only "bench", not "bench optim"; and
    ``prog`` is given because argparse derives it from a custom usage line.
    """
    return parser.add_subparsers(
        prog=prog,
        title="commands",
        description=_table(paths),
        dest="command" if prog == "infinity" else "subcommand",
        required=True,
        metavar=metavar,
        help=argparse.SUPPRESS,
    )


def _build_parser(
    argv: list[str],
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and the parsers of command groups (``bench``)."""
    raw = argparse.RawDescriptionHelpFormatter
    everything = [path for path, *_ in _COMMANDS]
    parser = argparse.ArgumentParser(
        prog="infinity",
        usage="%(prog)s [-h] COMMAND ...",
        description=DESCRIPTION,
        epilog=_examples(everything),
        formatter_class=raw,
    )
    sub = _subcommands(parser, "infinity", everything, "COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    group_parsers: dict[str, argparse.ArgumentParser] = {}
    for path, module, help_text, example in _COMMANDS:
        if len(path) > 1 and path[0] not in groups:
            members = [p for p in everything if p[0] == path[0]]
            group = sub.add_parser(
                path[0],
                usage="%(prog)s [-h] BENCHMARK ...",
                description=_GROUPS[path[0]],
                epilog=_examples(members),
                formatter_class=raw,
            )
            group_parsers[path[0]] = group
            groups[path[0]] = _subcommands(group, f"infinity {path[0]}", members, "BENCHMARK")
        target = (groups[path[0]] if len(path) > 1 else sub).add_parser(
            path[-1], description=help_text, epilog=f"example:\n  {example}", formatter_class=raw
        )
        target.set_defaults(_module=module)
        # Only the selected command's module is imported to add its flags.
        if argv[: len(path)] == list(path):
            _command(module).add_arguments(target)
    return parser, group_parsers


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser, groups = _build_parser(argv)
    # A bare `infinity` (or `infinity bench`) shows the help, not a missing-argument error.
    if not argv or (len(argv) == 1 and argv[0] in groups):
        (groups[argv[0]] if argv else parser).print_help()
        return 2
    args = parser.parse_args(argv)
    args.argv = list(argv)  # `train --nproc N` re-runs the command line as N processes
    return _run(_command(args._module), args)


def _command(spec: str) -> Any:
    """The command a ``_COMMANDS`` entry names: a module, or ``module:name`` an object in it."""
    module, _, name = spec.partition(":")
    found = importlib.import_module(module)
    return getattr(found, name) if name else found


def _run(command: Any, args: argparse.Namespace) -> int:
    """Run a command; its exit code, or 2 after printing its error."""
    try:
        return int(command.run(args) or 0)
    except CommandError as exc:
        # NOTE: one write of the whole line: under `--nproc` every rank shares this
        # stderr, and print's separate write of the newline let two ranks' lines
        # run into one.
        sys.stderr.write(f"infinity: error: {exc}\n")
        sys.stderr.flush()
        return 2
    except KeyboardInterrupt:
        print("infinity: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The process entry point (``infinity`` and ``python -m infinity``): run
    :func:`main`, then exit with its code.

    A command's own Ctrl-C handling ends when it returns. A second Ctrl-C
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
    # NOTE: reference cycles a failed command left behind (a half-built engine
    # holding a rank's process group) are freed now, while the interpreter is
    # whole. Left to the collection at shutdown, gloo's threads were torn down
    # during finalisation and aborted the rank (SIGABRT) about once in eight runs.
    # After SIG_IGN: a Ctrl-C landing in a weakref callback run by the
    # collection printed an "Exception ignored ... KeyboardInterrupt" traceback.
    gc.collect()
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
