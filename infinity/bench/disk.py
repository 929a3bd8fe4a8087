"""The disk through the engine's own I/O path (``IOEngine``, a ``SwapFile``, O_DIRECT).

**Throughput sweeps** (``infinity bench nvme``, the I/O bound of ``bench train``):
:func:`measure_engine` writes sequentially, then reads. Throughput is reported in
GB/s = 10^9 bytes per second. Each configuration writes a fresh preallocated
:class:`~infinity.io.SwapFile` (so every point starts from the same on-disk state)
and then reads it back; the page cache is not involved (O_DIRECT). The
``aiofiles`` baseline is buffered Python I/O: its write time includes ``fsync``,
and its cached pages are dropped with ``posix_fadvise(DONTNEED)`` before the read
so the read comes from the disk.

What the disk does for a training step (overwrites, reads and writes at once)
is :mod:`infinity.io.rates`'s.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from dataclasses import asdict, dataclass
from typing import cast

from infinity.config import AioConfig
from infinity.io import IOEngine, IORequest, SwapFile, aligned_empty
from infinity.io.directories import make_owned_dir, reclaim_stale
from infinity.io.rates import (
    GB,
    Progress,
    fill_incompressible,
    pool_shape,
    random_bytes,
    stream_requests,
)


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


def measure_engine(
    directory: str, size: int, config: AioConfig, progress: Progress | None = None
) -> Point:
    """Write then read ``size`` bytes sequentially with one engine configuration.

    The buffer pool is registered with the engine (io_uring fixed buffers), as
    the training engine registers its staging slabs.
    """
    request, pool_bytes = pool_shape(size, config)
    pool = aligned_empty(pool_bytes)
    fill_incompressible(pool)
    slots = pool_bytes // request
    views = [pool[i * request : (i + 1) * request] for i in range(slots)]
    with IOEngine(config) as engine, SwapFile(directory, size, engine, name="bench") as sf:
        engine.register_buffers([pool])  # None or why not: the plain path works too

        def write(slot: int, offset: int, nbytes: int) -> IORequest:
            return sf.write(views[slot][:nbytes], offset)

        def read(slot: int, offset: int, nbytes: int) -> IORequest:
            return sf.read(views[slot][:nbytes], offset)

        cpu_before = _cpu_seconds()
        write_s = stream_requests(write, size, request, slots, progress)
        read_s = stream_requests(read, size, request, slots, progress)
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

    block = bytes(random_bytes(block_size).numpy().tobytes())
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
