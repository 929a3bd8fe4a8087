"""Does the disk move small pieces slower? The engine's own I/O path at several piece sizes.

python bench/io_pieces.py --path DIR [--piece 196MiB --rounds 5 --bytes 1GiB --json]

Issue 26 part 4 suspected that int8 moments move their bytes slower than fp32
ones because their pieces are a quarter the size: a span of an oversize
optimizer unit is issued as one request per part (``chunks/pools.py``), and
an int8 moment's codes are a quarter of an fp32 moment's bytes (its block
scales 1/64 of them). This bench moves the same bytes through
:class:`~infinity.io.IOEngine` and a :class:`~infinity.io.SwapFile`
(O_DIRECT, the engine's default ``aio`` settings, a registered huge-page
buffer pool as the staging slots are) as requests of each size, and as the
pieces of one span of each unit, in the order the engine issues them:

- ``1x``: requests of ``--piece`` bytes (default 196 MiB: one fp32 moment of a
  span of the 1.86B/128k model's 51.4M-element chunks);
- ``0.25x``: a quarter of that (the int8 moment codes of the same span);
- ``--small`` sizes (default 4 MiB, the engine's block size, and 784 KiB, the
  int8 block scales of the span);
- ``fp32 unit`` / ``int8 unit``: one span of an optimizer unit, part after
  part, with ``--master`` (an fp32 master first: bf16 compute) or without
  (fp32 compute): fp32 moments ``[4C, 4C]``, int8 ``[C, C/64, C, C/64]``.

Each case writes, reads, and does both at once (one write and one read stream
over different regions, submitted alternately: the disk does both during a
step) ``--bytes`` bytes. The file is written whole first (reads of never
written extents would not reach the disk, and the first write of an extent
is slower than an overwrite). Cases run in rounds, in an order that rotates
every round, so drift in this shared disk hits them alike; each case reports
the median GB/s (1e9 bytes/s) over rounds, and its median ratio to ``1x``
over the rounds (paired: the ratio is taken within each round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from infinity._native.io import ALIGNMENT
from infinity.config import AioConfig
from infinity.io import IOEngine, IORequest, SwapFile, aligned_empty
from infinity.utils.sizes import align_up, format_size, parse_size

GB = 10**9
OPS = ("write", "read", "both")


@dataclass(frozen=True)
class Case:
    """Requests of these sizes, cycled, until the bytes are moved."""

    name: str
    pieces: tuple[int, ...]


def unit_pieces(chunk_elems: int, state: str, master: bool) -> tuple[int, ...]:
    """The requests of one span of ``chunk_elems`` elements of an Adam unit, in order
    (fp32 master, then each moment's values and, for int8, its block scales)."""
    head = (chunk_elems * 4,) if master else ()
    if state == "fp32":
        return head + (chunk_elems * 4,) * 2
    codes, scales = chunk_elems, align_up(-(-chunk_elems // 256) * 4, ALIGNMENT)
    return head + (codes, scales) * 2


class Ring:
    """A registered buffer pool handed out in order; a region is reused once the
    request that used it last has completed."""

    def __init__(self, nbytes: int) -> None:
        self.buf = aligned_empty(nbytes)
        self.buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
        self.at = 0
        self.busy: deque[tuple[IORequest, int, int]] = deque()

    def take(self, nbytes: int) -> torch.Tensor:
        """A free region of ``nbytes`` (waits for the oldest transfers until it is free)."""
        if self.at + nbytes > self.buf.numel():
            self.at = 0
        start, end = self.at, self.at + nbytes
        while self.busy and any(s < end and start < e for _r, s, e in self.busy):
            self.busy.popleft()[0].wait()
        self.at = end
        return self.buf[start:end]

    def hold(self, request: IORequest, region: torch.Tensor) -> None:
        start = region.data_ptr() - self.buf.data_ptr()
        self.busy.append((request, start, start + region.numel()))

    def drain(self) -> None:
        while self.busy:
            self.busy.popleft()[0].wait()


def _offsets(
    pieces: tuple[int, ...], start: int, nbytes: int, file_bytes: int
) -> Iterator[tuple[int, int]]:
    """(file offset, size) of consecutive requests cycling ``pieces`` from ``start``
    (wrapping inside the file) until ``nbytes`` are covered."""
    moved, i, at = 0, 0, start
    while moved < nbytes:
        size = pieces[i % len(pieces)]
        if at + size > file_bytes:
            at = 0
        yield at, size
        at += size
        moved += size
        i += 1


def run_case(sf: SwapFile, ring: Ring, case: Case, op: str, start: int, nbytes: int) -> float:
    """GB/s of one case: from the first submission to the last completion."""
    streams = []
    if op in ("write", "both"):
        streams.append((sf.write, _offsets(case.pieces, start, nbytes, sf.nbytes)))
    if op in ("read", "both"):
        other = (start + sf.nbytes // 2) % sf.nbytes if op == "both" else start
        other -= other % ALIGNMENT
        streams.append((sf.read, _offsets(case.pieces, other, nbytes, sf.nbytes)))
    moved = 0
    begin = time.perf_counter()
    live = list(streams)
    while live:
        for stream in list(live):
            submit, offsets = stream
            step = next(offsets, None)
            if step is None:
                live.remove(stream)
                continue
            offset, size = step
            region = ring.take(size)
            ring.hold(submit(region, offset), region)
            moved += size
    ring.drain()
    return moved / (time.perf_counter() - begin) / GB


def fill(sf: SwapFile, ring: Ring) -> None:
    """Write the whole file once (see the module docstring)."""
    piece = 64 << 20
    for offset in range(0, sf.nbytes, piece):
        size = min(piece, sf.nbytes - offset)
        region = ring.take(size)
        ring.hold(sf.write(region, offset), region)
    ring.drain()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="directory on the disk to measure")
    parser.add_argument("--piece", default="196MiB", help="the 1x request size")
    parser.add_argument("--small", default="4MiB,784KiB", help="more request sizes")
    parser.add_argument(
        "--chunk-elems", type=int, default=51_380_224, help="elements of a span (unit cases)"
    )
    parser.add_argument("--master", action="store_true", help="unit cases with an fp32 master")
    parser.add_argument("--bytes", default="1GiB", help="bytes per case, op and round")
    parser.add_argument("--file", default="6GiB", help="size of the file the cases move through")
    parser.add_argument("--pool", default="1GiB", help="buffer pool (bounds bytes in flight)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--queue-depth", type=int, default=AioConfig().queue_depth, help="aio.queue_depth"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    piece = parse_size(args.piece, name="--piece")
    cases = [Case("1x", (piece,)), Case("0.25x", (align_up(piece // 4, ALIGNMENT),))]
    for text in filter(None, args.small.split(",")):
        cases.append(Case(text, (parse_size(text, name="--small"),)))
    for state in ("fp32", "int8"):
        cases.append(Case(f"{state} unit", unit_pieces(args.chunk_elems, state, args.master)))
    nbytes = parse_size(args.bytes, name="--bytes")
    file_bytes = parse_size(args.file, name="--file")
    pool = max(parse_size(args.pool, name="--pool"), 2 * max(max(c.pieces) for c in cases))
    results: dict[str, dict[str, list[float]]] = {c.name: {op: [] for op in OPS} for c in cases}
    runs = [(c, op) for c in cases for op in OPS]
    ring = Ring(pool)
    aio = AioConfig(queue_depth=args.queue_depth)
    with IOEngine(aio) as engine, SwapFile(args.path, file_bytes, engine, name="pieces") as sf:
        engine.register_buffers([ring.buf])
        print(f"... writing the {format_size(file_bytes)} file once", file=sys.stderr, flush=True)
        fill(sf, ring)
        start = 0
        for r in range(args.rounds):
            print(f"... round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
            turn = (r * 5) % len(runs)
            for case, op in runs[turn:] + runs[:turn]:
                start = (start + nbytes + (256 << 20)) % file_bytes
                start -= start % ALIGNMENT
                results[case.name][op].append(run_case(sf, ring, case, op, start, nbytes))
        backend = engine.backend
    print(
        f"{backend}, block {format_size(aio.block_size)} x depth {aio.queue_depth}, "
        f"{format_size(nbytes)} per case and op, {args.rounds} rounds; median GB/s "
        "(ratio to 1x: median of the per-round ratios)"
    )
    print(f"{'case':<12}{'pieces':>34}" + "".join(f"{op:>18}" for op in OPS))
    base = results["1x"]
    summary: dict[str, dict] = {}
    for case in cases:
        cells, row = [], {}
        for op in OPS:
            values = results[case.name][op]
            ratio = statistics.median(a / b for a, b in zip(values, base[op], strict=True))
            row[op] = {"gbps": values, "median_gbps": statistics.median(values), "vs_1x": ratio}
            cells.append(f"{statistics.median(values):>9.2f} ({ratio:.2f}x)")
        shown = " ".join(format_size(p) for p in case.pieces[:5])
        print(f"{case.name:<12}{shown:>34}" + "".join(f"{c:>18}" for c in cells))
        summary[case.name] = {"pieces": list(case.pieces), **row}
    if args.json:
        print(json.dumps({"backend": backend, "bytes": nbytes, "cases": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
