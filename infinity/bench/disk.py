"""The disk through the engine's own I/O path (``IOEngine``, a ``SwapFile``, O_DIRECT).

**Throughput sweeps** (``infinity bench nvme``, the I/O bound of ``bench train``):
:func:`measure_engine` writes sequentially, then reads. Throughput is reported in
GB/s = 10^9 bytes per second. Each configuration writes a fresh preallocated
:class:`~infinity.io.SwapFile` (so every point starts from the same on-disk state)
and then reads it back; the page cache is not involved (O_DIRECT). The
``aiofiles`` baseline is buffered Python I/O: its write time includes ``fsync``,
and its cached pages are dropped with ``posix_fadvise(DONTNEED)`` before the read
so the read comes from the disk.

**What the disk does for a training step**: overwrites, reads, and both at once.

``infinity bench scale`` sets each step against an *I/O bound*: the least time
this disk needs for the step's NVMe reads and writes. Two properties of the
disk decide it, and :func:`measure_engine` (a fresh file written, then read)
sees neither:

- a step **overwrites** its homes (written at ``offload``), and on ext4 the
  first write of a preallocated (unwritten) extent is much slower than an
  overwrite (measured here: 1.2-1.5 against 3.5-3.8 GB/s);
- a step **reads and writes at once**, and a disk need not do both at full
  speed: this VM's moved 2.25 GB/s in all with both directions busy, about
  what it takes to do them one after the other (1.6 GB/s reads, 3.6 GB/s
  writes alone).

:func:`measure_mix` measures, through the engine's own path (``IOEngine`` and
a ``SwapFile``, O_DIRECT, a registered buffer pool), the first write, the
read and the overwrite of one file, then reads of one half while the other
half is overwritten. :func:`io_bound_seconds` turns those rates into the time
for a step's bytes: both directions at the measured combined rate while both
have bytes left (or one after the other, if that is faster), then the rest alone.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import cast

import torch

from infinity._native.io import ALIGNMENT
from infinity.config import AioConfig
from infinity.io import IOEngine, IORequest, SwapFile, aligned_empty
from infinity.io.owned_dirs import make_owned_dir, reclaim_stale

GB = 10**9
MIN_REQUEST_BYTES = 1 << 20
# Cap on the host memory used for I/O buffers, whatever the queue shape.
MAX_BUFFER_BYTES = 1 << 30

Progress = Callable[[int], None]


@dataclass
class Point:
    """One configuration's result (GB/s = 1e9 bytes/s)."""

    backend: str
    block_size: int
    queue_depth: int
    threads: int
    write_gbps: float
    read_gbps: float
    # CPU time of the whole process (every thread, user + kernel) per GB moved:
    # what the transfers take from compute on the same cores.
    cpu_ms_per_gb: float = 0.0

    def aio(self) -> dict[str, object]:
        """The ``aio`` config block of this point, as ``infinity.Config(aio=...)`` takes it."""
        return {
            "backend": self.backend,
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "threads": self.threads,
        }

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return asdict(self)


def _pool_bytes(size: int, config: AioConfig) -> tuple[int, int]:
    """(request size, buffer pool size) for one configuration.

    The pool is twice the bytes the engine keeps in flight, cut into requests
    of a quarter of that (at least 1 MiB), so several requests are always queued (the workers
    take pieces of the next one as soon as a slot frees) while the buffers,
    reused round-robin, stay about as small as fio's per-I/O buffers.

    NOTE: the footprint matters on virtualised disks: with buffers 8x larger
    than fio's, reads measured ~15% slower here for reasons outside the engine
    (the host's copy into guest memory leaves the CPU caches).
    """
    bs = cast(int, config.block_size)  # bytes once AioConfig is built
    in_flight = bs * config.queue_depth * config.threads
    # At least 1 MiB per request, so the Python loop is never what limits.
    request = max(bs, max(in_flight // 4, MIN_REQUEST_BYTES) // bs * bs)
    pool = min(max(2 * in_flight, 2 * request), MAX_BUFFER_BYTES, size)
    request = min(request, pool)
    pool = max(request, pool // request * request)
    return request, pool


def _stream(
    submit: Callable[[int, int, int], IORequest],
    size: int,
    request: int,
    slots: int,
    progress: Progress | None,
) -> float:
    """Runs ``submit(slot, offset, nbytes)`` over ``[0, size)`` with ``slots`` requests queued.

    Returns the elapsed seconds from the first submission to the last completion.
    """
    outstanding: list[IORequest | None] = [None] * slots
    start = time.perf_counter()
    offset, i = 0, 0
    while offset < size:
        slot = i % slots
        previous = outstanding[slot]
        if previous is not None:  # the slot's buffer is reused: wait for its last transfer
            previous.wait()
            if progress:
                progress(previous.nbytes)
        nbytes = min(request, size - offset)
        outstanding[slot] = submit(slot, offset, nbytes)
        offset += nbytes
        i += 1
    for req in outstanding:
        if req is not None and req.nbytes:
            req.wait()
    elapsed = time.perf_counter() - start
    if progress:
        for req in outstanding:
            if req is not None:
                progress(req.nbytes)
    return elapsed


def measure_engine(
    directory: str, size: int, config: AioConfig, progress: Progress | None = None
) -> Point:
    """Write then read ``size`` bytes sequentially with one engine configuration.

    The buffer pool is registered with the engine (io_uring fixed buffers), as
    the training engine registers its staging slabs.
    """
    request, pool_bytes = _pool_bytes(size, config)
    pool = aligned_empty(pool_bytes)
    _fill(pool)
    slots = pool_bytes // request
    views = [pool[i * request : (i + 1) * request] for i in range(slots)]
    with IOEngine(config) as engine, SwapFile(directory, size, engine, name="bench") as sf:
        engine.register_buffers([pool])  # None or why not: the plain path works too

        def write(slot: int, offset: int, nbytes: int) -> IORequest:
            return sf.write(views[slot][:nbytes], offset)

        def read(slot: int, offset: int, nbytes: int) -> IORequest:
            return sf.read(views[slot][:nbytes], offset)

        cpu_before = _cpu_seconds()
        write_s = _stream(write, size, request, slots, progress)
        read_s = _stream(read, size, request, slots, progress)
        cpu = _cpu_seconds() - cpu_before
        backend = engine.backend
    return Point(
        backend=backend,
        block_size=cast(int, config.block_size),
        queue_depth=config.queue_depth,
        threads=config.threads,
        write_gbps=size / write_s / GB,
        read_gbps=size / read_s / GB,
        cpu_ms_per_gb=cpu * 1000 / (2 * size / GB),
    )


def _cpu_seconds() -> float:
    """User + system CPU time of this process, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pattern(nbytes: int) -> torch.Tensor:
    """``nbytes`` of seeded random bytes."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _fill(buf: torch.Tensor) -> None:
    """Fill ``buf`` with incompressible-looking bytes, so a compressing device cannot
    flatter the write; a 1 MiB random block is tiled (generating GiBs would dominate)."""
    block = _pattern(min(1 << 20, buf.numel()))
    for start in range(0, buf.numel(), block.numel()):
        end = min(start + block.numel(), buf.numel())
        buf[start:end].copy_(block[: end - start])


def measure_aiofiles(
    directory: str, size: int, block_size: int, progress: Progress | None = None
) -> tuple[float, float]:
    """(write GB/s, read GB/s) of buffered ``aiofiles`` I/O in ``block_size`` chunks.

    The file is created in a private sub-directory of ``directory`` and removed
    (the next run removes it if this process is killed first).
    """
    reclaim_stale(directory)
    private = make_owned_dir(directory, "bench")
    path = os.path.join(private, "aiofiles.bin")
    try:
        return asyncio.run(_aiofiles_pass(path, size, block_size, progress))
    finally:
        for step in (lambda: os.unlink(path), lambda: os.rmdir(private)):
            try:
                step()
            except OSError:
                pass


async def _aiofiles_pass(
    path: str, size: int, block_size: int, progress: Progress | None
) -> tuple[float, float]:
    import aiofiles

    block = bytes(_pattern(block_size).numpy().tobytes())
    start = time.perf_counter()
    async with aiofiles.open(path, "wb") as f:
        written = 0
        while written < size:
            n = min(block_size, size - written)
            await f.write(block[:n] if n < block_size else block)
            written += n
            if progress:
                progress(n)
        await f.flush()
        # NOTE: fsync is part of the write: without it the "write" only fills
        # the page cache and the number says nothing about the disk.
        fd = f.fileno()
        await asyncio.to_thread(os.fsync, fd)
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # drop cached pages before the read
    write_s = time.perf_counter() - start

    start = time.perf_counter()
    async with aiofiles.open(path, "rb") as f:
        remaining = size
        while remaining > 0:
            chunk = await f.read(min(block_size, remaining))
            if not chunk:
                raise OSError(f"short read of the baseline file '{path}'")
            remaining -= len(chunk)
            if progress:
                progress(len(chunk))
    read_s = time.perf_counter() - start
    return size / write_s / GB, size / read_s / GB


@dataclass(frozen=True)
class DiskMix:
    """GB/s (1e9 bytes/s) of one measurement; ``both_gbps`` is reads and writes
    added up while the two run at once, in equal shares."""

    read_gbps: float
    write_gbps: float  # overwriting written extents, as a step does
    first_write_gbps: float  # the first write of a preallocated file
    both_gbps: float

    def as_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return asdict(self)


def faster(a: DiskMix, b: DiskMix) -> DiskMix:
    """The faster rate of each field (the stricter bound, on a disk that drifts)."""
    return DiskMix(**{k: max(v, getattr(b, k)) for k, v in asdict(a).items()})


def io_bound_seconds(read_bytes: float, write_bytes: float, disk: DiskMix) -> float:
    """Seconds for ``disk`` to read and write these bytes, the faster of two ways:
    both directions at once at ``both_gbps`` (half each) until the smaller one is
    done, or the same bytes one direction after the other; then the rest of the
    larger direction alone.

    A disk that does both at full speed (``both`` = read + write) gives about the
    slower direction alone; one that serialises them gives the sum.
    """
    shared = min(read_bytes, write_bytes)
    one_then_other = shared / (disk.read_gbps * GB) + shared / (disk.write_gbps * GB)
    seconds = min(2 * shared / (disk.both_gbps * GB), one_then_other)
    seconds += (read_bytes - shared) / (disk.read_gbps * GB)
    return seconds + (write_bytes - shared) / (disk.write_gbps * GB)


def _both(
    read: Callable[[int, int, int], IORequest],
    write: Callable[[int, int, int], IORequest],
    half: int,
    request: int,
    slots: int,
) -> float:
    """Seconds to read ``[half, 2 * half)`` while writing ``[0, half)``, submissions
    alternating, ``slots`` requests in flight (buffers reused round-robin)."""
    outstanding: list[IORequest | None] = [None] * slots
    start = time.perf_counter()
    offset, i = 0, 0
    while offset < half:
        nbytes = min(request, half - offset)
        for submit, base in ((write, 0), (read, half)):
            slot = i % slots
            previous = outstanding[slot]
            if previous is not None:
                previous.wait()
            outstanding[slot] = submit(slot, base + offset, nbytes)
            i += 1
        offset += nbytes
    for req in outstanding:
        if req is not None:
            req.wait()
    return time.perf_counter() - start


def measure_mix(directory: str, size: int, config: AioConfig) -> DiskMix:
    """Write a fresh ``size``-byte file, read it, overwrite it, then read one half
    while overwriting the other (``size`` bytes in all each time)."""
    if size < 2 * ALIGNMENT or size % ALIGNMENT:
        raise ValueError(f"size={size} must be a multiple of {ALIGNMENT}, at least twice that")
    request, pool_bytes = _pool_bytes(size, config)
    # each half holds at least one request (a small size: requests of half of it)
    request = min(request, size // 2 // ALIGNMENT * ALIGNMENT)
    pool_bytes = max(request, pool_bytes // request * request)
    pool = aligned_empty(pool_bytes)
    _fill(pool)
    slots = pool_bytes // request
    views = [pool[i * request : (i + 1) * request] for i in range(slots)]
    half = size // 2 // request * request
    with IOEngine(config) as engine, SwapFile(directory, size, engine, name="bench") as sf:
        engine.register_buffers([pool])

        def write(slot: int, offset: int, nbytes: int) -> IORequest:
            return sf.write(views[slot][:nbytes], offset)

        def read(slot: int, offset: int, nbytes: int) -> IORequest:
            return sf.read(views[slot][:nbytes], offset)

        first_s = _stream(write, size, request, slots, None)
        read_s = _stream(read, size, request, slots, None)
        write_s = _stream(write, size, request, slots, None)
        both_s = _both(read, write, half, request, slots)
    return DiskMix(
        read_gbps=size / read_s / GB,
        write_gbps=size / write_s / GB,
        first_write_gbps=size / first_s / GB,
        both_gbps=2 * half / both_s / GB,
    )
