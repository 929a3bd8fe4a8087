"""The disk's rates for a training step's traffic, measured through the engine's own
I/O path (``IOEngine``, a ``SwapFile``, O_DIRECT, a registered buffer pool).

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

:func:`disk_rates` is the engine's measurement of the swap folder's disk (cached
per file system for the process): what ``infinity.stats(model)["last_step"]``
turns a step's NVMe bytes into seconds with (the step's bound,
:mod:`infinity.runtime.stepping`).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import cast

import torch

from infinity._native.io import ALIGNMENT
from infinity.config import AioConfig
from infinity.io.buffers import aligned_empty
from infinity.io.engine import IOEngine
from infinity.io.request import IORequest
from infinity.io.swapfile import SwapFile

GB = 10**9
MIN_REQUEST_BYTES = 1 << 20
# Cap on the host memory used for I/O buffers, whatever the queue shape.
MAX_BUFFER_BYTES = 1 << 30
# The engine's own probe (disk_rates): small, so it costs a fraction of a second and
# a few MiB of host memory once per process and file system.
PROBE_BYTES = 32 << 20
PROBE_BUFFER_BYTES = 8 << 20

Progress = Callable[[int], None]


def pool_shape(size: int, config: AioConfig) -> tuple[int, int]:
    """(request size, buffer pool size) for one configuration.

    The pool is twice the bytes the engine keeps in flight, cut into requests
    of a quarter of that (at least 1 MiB), so several requests are always queued (the workers
    take pieces of the next one as soon as a slot frees) while the buffers,
    reused round-robin, stay about as small as fio's per-I/O buffers.

    The footprint matters on virtualised disks: with buffers 8x larger
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


def stream_requests(
    submit: Callable[[int, int, int], IORequest],
    size: int,
    request: int,
    slots: int,
    progress: Progress | None,
    *,
    alongside: Callable[[int, int, int], IORequest] | None = None,
) -> float:
    """Runs ``submit(slot, offset, nbytes)`` over ``[0, size)`` with ``slots`` requests queued
    (buffers reused round-robin); with ``alongside``, each submission is followed by
    ``alongside(slot, size + offset, nbytes)``, the two alternating over the same slots
    (one direction over ``[0, size)`` while the other runs over ``[size, 2 * size)``).

    Returns the elapsed seconds from the first submission to the last completion.
    """
    submits = [(submit, 0)] if alongside is None else [(submit, 0), (alongside, size)]
    outstanding: list[IORequest | None] = [None] * slots
    start = time.perf_counter()
    offset, i = 0, 0
    while offset < size:
        nbytes = min(request, size - offset)
        for each, base in submits:
            slot = i % slots
            previous = outstanding[slot]
            if previous is not None:  # the slot's buffer is reused: wait for its last transfer
                previous.wait()
                if progress:
                    progress(previous.nbytes)
            outstanding[slot] = each(slot, base + offset, nbytes)
            i += 1
        offset += nbytes
    for req in outstanding:
        if req is not None and req.nbytes:
            req.wait()
    elapsed = time.perf_counter() - start
    if progress:
        for req in outstanding:
            if req is not None:
                progress(req.nbytes)
    return elapsed


def random_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of seeded random bytes."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def fill_incompressible(buf: torch.Tensor) -> None:
    """Fill ``buf`` with incompressible-looking bytes, so a compressing device cannot
    flatter the write; a 1 MiB random block is tiled (generating GiBs would dominate)."""
    block = random_bytes(min(1 << 20, buf.numel()))
    for start in range(0, buf.numel(), block.numel()):
        end = min(start + block.numel(), buf.numel())
        buf[start:end].copy_(block[: end - start])


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


def measure_mix(
    directory: str, size: int, config: AioConfig, max_buffer_bytes: int = MAX_BUFFER_BYTES
) -> DiskMix:
    """Write a fresh ``size``-byte file, read it, overwrite it, then read one half
    while overwriting the other (``size`` bytes in all each time), through at most
    ``max_buffer_bytes`` of buffers."""
    if size < 2 * ALIGNMENT or size % ALIGNMENT:
        raise ValueError(f"size={size} must be a multiple of {ALIGNMENT}, at least twice that")
    request, pool_bytes = pool_shape(min(size, max_buffer_bytes), config)
    # each half holds at least one request (a small size: requests of half of it)
    request = min(request, size // 2 // ALIGNMENT * ALIGNMENT)
    pool_bytes = max(request, pool_bytes // request * request)
    pool = aligned_empty(pool_bytes)
    fill_incompressible(pool)
    slots = pool_bytes // request
    views = [pool[i * request : (i + 1) * request] for i in range(slots)]
    half = size // 2 // request * request
    with IOEngine(config) as engine, SwapFile(directory, size, engine, name="bench") as sf:
        engine.register_buffers([pool])

        def write(slot: int, offset: int, nbytes: int) -> IORequest:
            return sf.write(views[slot][:nbytes], offset)

        def read(slot: int, offset: int, nbytes: int) -> IORequest:
            return sf.read(views[slot][:nbytes], offset)

        first_s = stream_requests(write, size, request, slots, None)
        read_s = stream_requests(read, size, request, slots, None)
        write_s = stream_requests(write, size, request, slots, None)
        both_s = stream_requests(write, half, request, slots, None, alongside=read)
    return DiskMix(
        read_gbps=size / read_s / GB,
        write_gbps=size / write_s / GB,
        first_write_gbps=size / first_s / GB,
        both_gbps=2 * half / both_s / GB,
    )


_measured: dict[int, DiskMix | None] = {}


def disk_rates(
    directory: str, config: AioConfig, before: Callable[[], None] | None = None
) -> DiskMix | None:
    """The rates of the disk holding ``directory`` (:func:`measure_mix` of
    :data:`PROBE_BYTES` through ``config``'s engine shape, at most
    :data:`PROBE_BUFFER_BYTES` of buffers), measured once per file system and
    process; ``None`` (with a warning) if the measurement failed, e.g. a full disk.
    ``before`` runs first when a measurement is made (the caller's own transfers
    finish, so they do not share the disk with it).

    A probe, not the truth: on a disk shared with other work the rates drift
    (``infinity bench nvme`` measures them properly); they only turn a step's
    bytes into the seconds of its bound.
    """
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return None
    if device not in _measured:
        small = replace(config, queue_depth=min(config.queue_depth, 8), threads=1)
        if before is not None:
            before()
        try:
            _measured[device] = measure_mix(directory, PROBE_BYTES, small, PROBE_BUFFER_BYTES)
        except OSError as exc:
            warnings.warn(
                f"could not measure the disk of '{directory}' ({exc}): steps report no "
                "NVMe seconds in their bound",
                RuntimeWarning,
                stacklevel=2,
            )
            _measured[device] = None
    return _measured[device]
