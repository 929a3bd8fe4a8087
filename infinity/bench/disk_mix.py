"""What the disk does for a training step: overwrites, reads, and both at once.

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

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from infinity._native.io import ALIGNMENT
from infinity.bench.disk import GB, _fill, _pool_bytes, _stream
from infinity.config import AioConfig
from infinity.io import IOEngine, IORequest, SwapFile, aligned_empty


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
