"""``infinity bench nvme``: sequential O_DIRECT throughput sweep of the I/O engine.

For every combination of backend x threads x block size x queue depth it
writes a fresh preallocated file of ``--size`` then reads it back, and also
times a buffered ``aiofiles`` baseline per block size, ``--repeats`` times in
interleaved passes. Prints a table (and with ``--json`` one JSON line last,
whose ``best.aio`` block loads into ``infinity.Config(aio=...)`` unchanged):
the recommendation is the least CPU per GB within the measured noise of the
top throughput (:mod:`infinity.bench.nvme_report`); optionally a PNG plot. The
measurements are :mod:`infinity.bench.disk`'s. Files are created in a private
sub-directory of ``--path`` and removed, also on Ctrl-C; after a kill, the next
run removes them.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

from infinity._native.io import ALIGNMENT, MAX_BLOCK_SIZE, MAX_QUEUE_DEPTH, MAX_THREADS
from infinity.cli.main import CommandError
from infinity.config import AioConfig
from infinity.io.directories import pseudo_filesystem, reclaim_stale
from infinity.utils.sizes import format_size, parse_size

_ALIGN_K = f"{ALIGNMENT // 1024}K"  # how sizes are written on this command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``infinity bench nvme``."""
    parser.add_argument("--path", required=True, help="directory on the disk to measure")
    parser.add_argument("--size", default="4GiB", help="bytes written then read per point")
    parser.add_argument(
        "--block-sizes", default="256K,1M,4M", help="comma-separated piece sizes (multiples of 4K)"
    )
    parser.add_argument(
        "--queue-depths", default="8,32,64", help="comma-separated pieces in flight per thread"
    )
    parser.add_argument(
        "--backends",
        default="all",
        help="comma-separated: io_uring, aio, threads, or 'all' (every backend working here)",
    )
    parser.add_argument("--threads", default="1", help="comma-separated worker thread counts")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="measurements of each configuration, in interleaved passes: their spread is the "
        "noise within which the cheapest configuration in CPU per GB is recommended",
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the buffered aiofiles baseline"
    )
    parser.add_argument(
        "--json", action="store_true", help="print a JSON summary as the last line of output"
    )
    parser.add_argument("--plot", metavar="PNG", help="write GB/s vs block size plots here")


def _int_list(flag: str, text: str, lo: int, hi: int) -> list[int]:
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or not lo <= int(item) <= hi:
            raise CommandError(
                f"{flag}: {item!r} is not an integer in {lo}..{hi} (e.g. {flag} 8,32)"
            )
        values.append(int(item))
    return list(dict.fromkeys(values))


def _block_sizes(text: str) -> list[int]:
    sizes = []
    for item in text.split(","):
        try:
            size = parse_size(item.strip(), name="block size")
        except ValueError:
            raise CommandError(
                f"--block-sizes: {item.strip()!r} is not a size; use e.g. 256K,1M,4M"
            ) from None
        if size < ALIGNMENT or size % ALIGNMENT or size > MAX_BLOCK_SIZE:
            raise CommandError(
                f"--block-sizes: {item.strip()} is not a multiple of {_ALIGN_K} between "
                f"{_ALIGN_K} and {MAX_BLOCK_SIZE >> 30}G (O_DIRECT alignment); use e.g. 256K,1M,4M"
            )
        sizes.append(size)
    return list(dict.fromkeys(sizes))


def _backends(text: str) -> list[str]:
    from infinity._native import native

    probes = native().io.probe_results()
    working = [name for name in ("io_uring", "aio", "threads") if not probes.get(name)]
    if text.strip() == "all":
        return working
    names = list(dict.fromkeys(item.strip() for item in text.split(",")))
    for name in names:
        if name not in probes:
            raise CommandError(
                f"--backends: unknown backend {name!r}; choose from io_uring, aio, threads or all"
            )
        if probes[name]:
            raise CommandError(
                f"--backends: {name} does not work on this machine ({probes[name]}); "
                f"working here: {','.join(working)}"
            )
    return names


def _check_directory(path: Path) -> bool:
    """Checks ``--path`` is usable; returns True if it must be created (its parent exists)."""
    fs_type = pseudo_filesystem(path)
    if fs_type is not None:
        raise CommandError(
            f"--path: '{path}' is on a {fs_type} file system, a kernel interface with no "
            "storage; pick a directory on the disk to measure"
        )
    if path.exists():
        if not path.is_dir():
            raise CommandError(f"--path: '{path}' exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise CommandError(f"--path: '{path}' is not writable")
        return False
    parent = path.parent
    if not parent.is_dir():
        raise CommandError(
            f"--path: cannot create '{path}': its parent '{parent}' is not an existing "
            "directory; create it first or pick another path"
        )
    return True


def run(args: argparse.Namespace) -> int:
    """Run the sweep; returns 0 (user errors raise CommandError: exit code 2)."""
    try:
        size = parse_size(args.size, name="--size")
    except ValueError as exc:
        raise CommandError(f"{exc}") from None
    if size < ALIGNMENT or size % ALIGNMENT:
        raise CommandError(
            f"--size: {args.size} must be a positive multiple of {_ALIGN_K}, e.g. 1GiB"
        )
    block_sizes = _block_sizes(args.block_sizes)
    depths = _int_list("--queue-depths", args.queue_depths, 1, MAX_QUEUE_DEPTH)
    threads = _int_list("--threads", args.threads, 1, MAX_THREADS)
    if not 1 <= args.repeats <= 20:
        raise CommandError(f"--repeats {args.repeats} must be in 1..20 (e.g. --repeats 3)")
    backends = _backends(args.backends)
    path = Path(args.path).absolute()
    if args.plot:
        plot_dir = Path(args.plot).absolute().parent
        if not plot_dir.is_dir():
            raise CommandError(f"--plot: directory '{plot_dir}' does not exist")
    created = _check_directory(path)
    if created:
        try:
            path.mkdir()
        except OSError as exc:
            raise CommandError(f"--path: cannot create '{path}': {exc.strerror}") from None
    try:
        reclaim_stale(path)  # a killed earlier run's files would count as used space
        free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
        if free < size:
            raise CommandError(
                f"--size: {format_size(size)} does not fit in '{path}' "
                f"({format_size(free)} free); use a smaller --size"
            )
        return _sweep(args, path, size, block_sizes, depths, threads, backends)
    finally:
        if created:
            try:
                path.rmdir()  # only if we made it and it is empty again
            except OSError:
                pass


def _sweep(
    args: argparse.Namespace,
    path: Path,
    size: int,
    block_sizes: list[int],
    depths: list[int],
    threads: list[int],
    backends: list[str],
) -> int:
    from tqdm import tqdm

    from infinity.bench import nvme_report
    from infinity.bench.disk import measure_aiofiles, measure_engine

    combos = list(itertools.product(backends, threads, block_sizes, depths))
    passes = 2 * len(combos) * args.repeats + (0 if args.no_baseline else 2 * len(block_sizes))
    samples = []
    baseline: dict[int, tuple[float, float]] = {}
    with tqdm(
        total=passes * size, unit="B", unit_scale=True, desc="bench nvme", file=sys.stderr
    ) as bar:
        # Repeats in interleaved passes, so drift hits every configuration alike.
        for _repeat in range(args.repeats):
            for backend, nthreads, bs, qd in combos:
                bar.set_postfix_str(f"{backend} t={nthreads} bs={bs >> 10}K qd={qd}")
                config = AioConfig(backend=backend, block_size=bs, queue_depth=qd, threads=nthreads)
                try:
                    samples.append(measure_engine(str(path), size, config, bar.update))
                except OSError as exc:
                    raise CommandError(f"measuring {backend} in '{path}' failed: {exc}") from None
        if not args.no_baseline:
            for bs in block_sizes:
                bar.set_postfix_str(f"aiofiles bs={bs >> 10}K")
                baseline[bs] = measure_aiofiles(str(path), size, bs, bar.update)
    points, noise = nvme_report.combine_repeats(samples)
    choice = nvme_report.recommend(points, noise)
    print(nvme_report.table(points, baseline, size, choice, args.repeats))
    if args.plot:
        nvme_report.plot(points, baseline, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        print(nvme_report.json_line(nvme_report.summary(points, baseline, size, choice)))
    return 0
