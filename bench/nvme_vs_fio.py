"""Our I/O engine against fio on the same directory, in the same run.

For each repeat, interleaved (in alternating order) so drift in the disk or
the machine hits both alike: fio (``--direct=1 --ioengine=libaio --iodepth=QD --rw=write`` then
``--rw=read``, fresh file) and then infinity's engine on each backend (fresh
preallocated swap file, sequential write then read, same block size, queue
depth and size). Prints the median GB/s (1e9 bytes/s) of each and the ratios
ours/fio; the target is >= 0.95 for both directions.

Usage:
    python bench/nvme_vs_fio.py --path /mnt/nvme/bench [--size 2GiB] [--block-size 1M]
        [--queue-depth 32] [--repeat 3] [--backends io_uring,aio] [--threads 1] [--json]

fio must be installed: ``apt-get install fio`` (Debian/Ubuntu), ``dnf install
fio`` (Fedora/RHEL), ``brew install fio`` (macOS; but this engine is Linux-only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from infinity.bench.nvme import GB, measure_engine
from infinity.config import AioConfig
from infinity.io import available_backends
from infinity.utils.sizes import format_size, parse_size

TARGET = 0.95


def run_fio(directory: str, size: int, block_size: int, depth: int, rw: str) -> float:
    """GB/s of one fio job (``rw`` is ``write`` or ``read``) on ``directory/fio.bin``."""
    cmd = [
        "fio",
        "--name=infinity-vs-fio",
        f"--filename={os.path.join(directory, 'fio.bin')}",
        "--direct=1",
        "--ioengine=libaio",
        f"--iodepth={depth}",
        f"--rw={rw}",
        f"--bs={block_size}",
        f"--size={size}",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    # NOTE: fio may print warnings before the JSON document.
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return job[rw]["bw_bytes"] / GB


def fio_pass(root: str, size: int, block_size: int, depth: int) -> tuple[float, float]:
    """(write, read) GB/s of fio on a fresh file in a private directory under ``root``."""
    private = tempfile.mkdtemp(prefix="infinity-fio-", dir=root)
    try:
        write = run_fio(private, size, block_size, depth, "write")
        read = run_fio(private, size, block_size, depth, "read")
        return write, read
    finally:
        shutil.rmtree(private, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="existing directory on the disk to measure")
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--block-size", default="1M")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backends", default=",".join(b for b in available_backends()))
    parser.add_argument("--json", action="store_true", help="also print a JSON line last")
    args = parser.parse_args(argv)

    if shutil.which("fio") is None:
        print(
            "fio is not installed. Install it with `apt-get install fio` (Debian/Ubuntu) or "
            "`dnf install fio` (Fedora/RHEL), then run this again.",
            file=sys.stderr,
        )
        return 2
    if not os.path.isdir(args.path):
        print(f"--path {args.path!r} is not an existing directory", file=sys.stderr)
        return 2
    size = parse_size(args.size, name="--size")
    block_size = parse_size(args.block_size, name="--block-size")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]

    fio: list[tuple[float, float]] = []
    ours: dict[str, list[tuple[float, float]]] = {b: [] for b in backends}
    for i in range(args.repeat):
        # NOTE: the order alternates between repeats, so whatever state one
        # run leaves behind (device or host caches, free-extent layout) favours
        # neither side systematically.
        order = ["fio", *backends] if i % 2 == 0 else [*backends, "fio"]
        for name in order:
            if name == "fio":
                w, r = fio_pass(args.path, size, block_size, args.queue_depth)
                fio.append((w, r))
            else:
                config = AioConfig(name, block_size, args.queue_depth, args.threads)
                p = measure_engine(args.path, size, config)
                w, r = p.write_gbps, p.read_gbps
                ours[name].append((w, r))
            print(f"repeat {i + 1}: {name:<8} write {w:.3f} read {r:.3f} GB/s", flush=True)

    def median(values: list[tuple[float, float]], k: int) -> float:
        return statistics.median(v[k] for v in values)

    fio_w, fio_r = median(fio, 0), median(fio, 1)
    print()
    print(
        f"size {format_size(size)}, block size {format_size(block_size)}, queue depth "
        f"{args.queue_depth}, threads {args.threads}, median of {args.repeat} (GB/s = 1e9 B/s)"
    )
    print(f"{'':<10} {'write':>8} {'read':>8} {'write/fio':>10} {'read/fio':>9}")
    print(f"{'fio':<10} {fio_w:>8.3f} {fio_r:>8.3f}")
    summary = {"fio": {"write_gbps": fio_w, "read_gbps": fio_r}, "ours": {}}
    for backend, values in ours.items():
        w, r = median(values, 0), median(values, 1)
        print(f"{backend:<10} {w:>8.3f} {r:>8.3f} {w / fio_w:>10.2f} {r / fio_r:>9.2f}")
        summary["ours"][backend] = {
            "write_gbps": w,
            "read_gbps": r,
            "write_ratio": w / fio_w,
            "read_ratio": r / fio_r,
        }
    best = max(summary["ours"].items(), key=lambda kv: kv[1]["write_ratio"] + kv[1]["read_ratio"])
    met = best[1]["write_ratio"] >= TARGET and best[1]["read_ratio"] >= TARGET
    print(
        f"best backend {best[0]}: write {best[1]['write_ratio']:.2f}x, read "
        f"{best[1]['read_ratio']:.2f}x fio (target >= {TARGET}: {'met' if met else 'NOT met'})"
    )
    if args.json:
        print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
