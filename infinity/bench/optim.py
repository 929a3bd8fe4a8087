"""``infinity bench optim``: each CPU optimizer kernel against its torch counterpart,
in GB/s against the measured memory roofline.

The contenders (``infinity/bench/optim_contenders.py``): for Adam, Lion and SGD
with momentum, our step and torch's, with fp32 gradients and mixed (bf16
gradients in, bf16 parameters out), plus memory-bandwidth probes whose fastest
is the roofline. All run on the same buffers and thread count, timed in
interleaved rounds so background load hits them alike. ``--optimizers``
picks which (default all); ``--isa`` forces the native kernels' instruction
set (e.g. ``avx2`` to see what a machine without AVX-512 would get).
``infinity bench adam`` is the old name of ``--optimizers adam``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import psutil
import torch

from infinity.bench import optim_contenders as contenders
from infinity.cli.main import CommandError
from infinity.optim import kernels
from infinity.utils.sizes import parse_size

_PRECISIONS = ("fp32", "mixed")


def add_arguments(parser: argparse.ArgumentParser, *, optimizers: str = "adam,lion,sgd") -> None:
    """Flags of ``infinity bench optim`` (``optimizers``: the default of --optimizers)."""
    parser.add_argument(
        "--optimizers",
        default=optimizers,
        help="comma-separated optimizers to time, each against torch's counterpart: "
        f"{', '.join(contenders.OPTIMIZERS)} (default {optimizers})",
    )
    parser.add_argument(
        "--size",
        default="64M",
        help="parameters per step: a count with an optional binary suffix, "
        "K/M/G = 2^10/2^20/2^30 (64M = 67,108,864 parameters); default 64M",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for every contender, ours and torch's (default: physical cores)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds after one warm-up (default 5)"
    )
    parser.add_argument(
        "--isa",
        default="auto",
        help="kernel instruction set: auto (widest available), avx512, avx2 or scalar",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on the last line"
    )


def parse_optimizers(text: str) -> list[str]:
    """``adam,lion`` -> ``["adam", "lion"]`` in the order given; ``CommandError`` for
    an unknown or repeated name."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in contenders.OPTIMIZERS]
    if not names or unknown:
        raise CommandError(
            f"--optimizers={text!r}: choose from {', '.join(contenders.OPTIMIZERS)} "
            "(comma-separated, e.g. adam,lion)"
        )
    if len(set(names)) != len(names):
        raise CommandError(f"--optimizers={text!r} names an optimizer twice")
    return names


def _parse_args(args: argparse.Namespace) -> tuple[list[str], int, int, int]:
    optimizers = parse_optimizers(args.optimizers)
    try:
        n = parse_size(args.size, name="--size")
    except ValueError:
        raise CommandError(
            f"--size={args.size!r} is not a parameter count; use e.g. 64M "
            "(= 64 x 2^20 parameters), 1G or 500000"
        ) from None
    if n < 1:
        raise CommandError(f"--size={args.size!r} must be at least 1 parameter")
    threads = kernels.default_num_threads() if args.threads is None else args.threads
    if threads < 1:
        raise CommandError(f"--threads={threads} must be >= 1")
    if args.repeats < 1:
        raise CommandError(f"--repeats={args.repeats} must be >= 1")
    if args.isa != "auto" and args.isa not in kernels.available_isas():
        raise CommandError(
            f"--isa={args.isa!r} is not available on this CPU; "
            f"choose auto or one of {', '.join(kernels.available_isas())}"
        )
    per_param = contenders.BASE_FOOTPRINT + sum(contenders.STATE_FOOTPRINT[o] for o in optimizers)
    need, have = n * per_param, psutil.virtual_memory().available
    if need > 0.8 * have:
        raise CommandError(
            f"--size={args.size} needs ~{need / 2**30:.1f} GiB of RAM, "
            f"only {have / 2**30:.1f} GiB is available; use a smaller --size"
        )
    return optimizers, n, threads, args.repeats


def _measure(optimizers: list[str], n: int, threads: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of every contender in every round (``"adam ours fp32"``, ``"probe triad"``)."""
    saved_threads = (kernels.get_num_threads(), torch.get_num_threads())
    kernels.set_num_threads(threads)
    torch.set_num_threads(threads)
    try:
        buffers = contenders.Buffers(n)
        fns = dict(contenders.probes(buffers))
        for name in optimizers:
            for label, fn in contenders.BUILDERS[name](buffers).items():
                fns[f"{name} {label}"] = fn
        for fn in fns.values():  # warm-up: page faults, torch's state allocation
            fn()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        return times
    finally:
        kernels.set_num_threads(saved_threads[0])
        torch.set_num_threads(saved_threads[1])


def _report(
    optimizers: list[str], n: int, threads: int, repeats: int, times: dict[str, list[float]]
) -> dict[str, Any]:
    probes = {
        name: nbytes * n / min(times[f"probe {name}"]) / 1e9
        for name, nbytes in contenders.PROBE_BYTES.items()
    }
    roofline = max(probes.values())
    results: dict[str, dict[str, Any]] = {}
    ratios: dict[str, float] = {}
    for optimizer in optimizers:
        for precision in _PRECISIONS:
            for side in ("ours", "torch"):
                name = f"{optimizer} {side} {precision}"
                best, median = min(times[name]), statistics.median(times[name])
                gbps = contenders.BYTES_PER_PARAM[optimizer] * n / best / 1e9
                results[name] = {
                    "optimizer": optimizer,
                    "side": side,
                    "precision": precision,
                    "gparams_per_s": n / best / 1e9,
                    "gparams_per_s_median": n / median / 1e9,
                    "gbps": gbps,
                    "roofline_fraction": gbps / roofline,
                }
            ours, theirs = (results[f"{optimizer} {s} {precision}"] for s in ("ours", "torch"))
            ratios[f"{optimizer} {precision}"] = ours["gparams_per_s"] / theirs["gparams_per_s"]
    return {
        "params": n,
        "threads": threads,
        "repeats": repeats,
        "isa": kernels.active_isa(),
        "optimizers": optimizers,
        "bytes_per_param": {o: contenders.BYTES_PER_PARAM[o] for o in optimizers},
        "probes_gbps": probes,
        "roofline_gbps": roofline,
        "results": results,
        "ours_vs_torch": ratios,
    }


def _label(result: dict[str, Any]) -> str:
    optimizer, mixed = result["optimizer"], result["precision"] == "mixed"
    if result["side"] == "ours":
        return f"{optimizer} ours {result['precision']}" + (" (bf16 grad/out)" if mixed else "")
    return f"{optimizer} {contenders.TORCH_LABELS[optimizer]}" + (" + casts" if mixed else "")


def _print_table(report: dict[str, Any]) -> None:
    n = report["params"]
    print(
        f"infinity bench optim: {n:,} parameters, {report['threads']} threads, "
        f"best of {report['repeats']} rounds, kernel ISA {report['isa']}"
    )
    print(
        f"{'contender':<44}{'Gparams/s':>10}{'(median)':>10}{'GB/s':>8}{'roofline':>10}{'ratio':>8}"
    )
    for name, gbps in report["probes_gbps"].items():
        fraction = gbps / report["roofline_gbps"]
        print(f"{'memory probe: ' + name:<44}{'':>20}{gbps:>8.1f}{fraction:>10.0%}")
    for r in report["results"].values():
        key = f"{r['optimizer']} {r['precision']}"
        ratio = f"{report['ours_vs_torch'][key]:.2f}x" if r["side"] == "ours" else ""
        print(
            f"{_label(r):<44}{r['gparams_per_s']:>10.3f}{r['gparams_per_s_median']:>10.3f}"
            f"{r['gbps']:>8.1f}{r['roofline_fraction']:>10.0%}{ratio:>8}"
        )
    per_param = ", ".join(f"{o} {b}" for o, b in report["bytes_per_param"].items())
    print(
        f"bytes/param (fp32 and mixed): {per_param}; roofline {report['roofline_gbps']:.1f} GB/s; "
        "ratio = ours / torch, same run"
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table, and with ``--json`` one JSON object on the last line."""
    optimizers, n, threads, repeats = _parse_args(args)
    kernels.force_isa(None if args.isa == "auto" else args.isa)
    try:
        report = _report(optimizers, n, threads, repeats, _measure(optimizers, n, threads, repeats))
    finally:
        kernels.force_isa(None)
    _print_table(report)
    if args.json:
        print(json.dumps(report))
    return 0


class RenamedAdam:
    """``infinity bench adam``: the old name of ``infinity bench optim --optimizers adam``.

    Kept so scripts and docs that call it keep working: the flags of ``bench optim``
    with Adam as the default optimizer, and a one-line note (on stderr: ``--json``
    still ends stdout with the JSON object). ``infinity/cli/main.py`` registers it
    as ``infinity.bench.optim:RenamedAdam``.
    """

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Flags of ``infinity bench optim``, with ``--optimizers adam`` by default."""
        add_arguments(parser, optimizers="adam")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        """Print the deprecation note, then run ``infinity bench optim``."""
        sys.stderr.write(
            "infinity: note: `infinity bench adam` is now `infinity bench optim --optimizers adam` "
            "(the old name will go)\n"
        )
        return run(args)
