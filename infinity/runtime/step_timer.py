"""Per-step timing and traffic, and the step's bound: the slowest of its resources.

A step (the interval between two optimizer steps) uses four resources, each with
a least time for its work (NOTE [the step's bound]):

- the device's compute, from the step's first forward to ``optimizer.step()``,
  less the time the device idled for the engine's waits and host updates
  (:mod:`infinity.devices.step_clock`: a GPU's events; where compute
  shares the host's cores, the host's clock);
- the host optimizer: its chunk updates, waits excluded;
- the host-device link each way: the copies' busy time on a GPU's copy stream, or
  their bytes at a measured memcpy rate on the CPU;
- the disk: the step's NVMe bytes at the swap folder's measured rates
  (:func:`~infinity.io.rates.disk_rates`), reads and writes at once where the disk
  does both faster (:func:`~infinity.io.rates.io_bound_seconds`), or the time the
  disk was busy with them if that was less (the probe saw a slower disk).

Everything else should hide behind the largest of them, ``bound_seconds``;
``step_over_bound`` says how far the step is from it. ``hook_seconds`` is the host
time inside the engine's hooks: where the step is far above its bound with little
waiting, this is what the device idled for. Where compute shares the
host's cores, the device compute and the host optimizer add up into one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infinity.chunks.accounting import Traffic
from infinity.devices.base import DeviceBackend
from infinity.io.rates import GB, DiskMix, io_bound_seconds

Lap = dict[str, float]

_memcpy_rate: list[float] = []


def memcpy_bytes_per_second() -> float:
    """This host's memcpy rate (bytes/s), measured once per process on 8 MiB.

    NOTE: small, so the probe stays out of the step's memory peak; the caches may
    flatter it, which only lowers the link's seconds (the bound stays a lower bound).
    """
    if not _memcpy_rate:
        src = torch.ones(8 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        _memcpy_rate.append(src.numel() / max(best, 1e-9))
    return _memcpy_rate[0]


@dataclass
class _Pending:
    """A lap whose device clock may still be running: resolved when first read."""

    lap: dict[str, float]
    device_compute: Callable[[], float]
    link: Callable[[], tuple[float, float]] | None


class StepTimer:
    """Splits each step interval into time waiting per tier and the rest (compute),
    and sets it against the step's bound (module docstring)."""

    def __init__(
        self,
        traffic: Traffic,
        backend: DeviceBackend,
        disk: Callable[[], DiskMix | None] | None = None,
    ) -> None:
        """``disk`` measures the swap folder's disk (None: no NVMe tier)."""
        self._traffic = traffic
        self._backend = backend
        self._disk = disk
        self._start = time.perf_counter()
        self._base = traffic.snapshot()
        self._pending: _Pending | None = None
        self._last: Lap = {}
        self._bound_by = ""

    def begin_span(self) -> None:
        """A forward starts: the first of a step opens its span (later ones, of
        accumulated micro-batches or an evaluation, continue it)."""
        self._backend.clock.open_span()

    def lap(self) -> None:
        """Close the current interval (called at the end of an optimizer step)."""
        now = time.perf_counter()
        current = self._traffic.snapshot()
        delta = {k: current[k] - self._base.get(k, 0.0) for k in current}
        seconds = now - self._start
        waiting = sum(v for k, v in delta.items() if k.startswith("wait_"))
        delta["seconds"] = seconds
        delta["compute_seconds"] = max(0.0, seconds - waiting)
        self._pending = _Pending(
            delta, self._backend.clock.close_span(), self._backend.clock.take_link_seconds()
        )
        self._start, self._base = now, current

    @property
    def last(self) -> Lap:
        """The last interval: traffic deltas, ``seconds``, ``compute_seconds`` and its
        bound (module docstring), all numbers. Reading it first waits for the device's
        clock."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._last, self._bound_by = self._resolve(pending)
        return self._last

    @property
    def bound_by(self) -> str:
        """The resource that bounds the last interval (``""`` before the first step)."""
        _ = self.last
        return self._bound_by

    def _resolve(self, pending: _Pending) -> tuple[Lap, str]:
        lap: Lap = dict(pending.lap)
        d = pending.lap
        optimizer = d.get("host_optimizer_seconds", 0.0)
        compute = pending.device_compute()
        if pending.link is not None:
            h2d, d2h = pending.link()
        else:
            rate = memcpy_bytes_per_second()
            h2d, d2h = d.get("h2d_bytes", 0.0) / rate, d.get("d2h_bytes", 0.0) / rate
        read, write = d.get("nvme_read_bytes", 0.0), d.get("nvme_write_bytes", 0.0)
        disk = self._disk() if self._disk is not None and read + write > 0 else None
        lap["device_compute_seconds"] = compute
        lap["h2d_seconds"] = h2d
        lap["d2h_seconds"] = d2h
        if disk is not None:
            lap["nvme_read_seconds"] = read / (disk.read_gbps * GB)
            lap["nvme_write_seconds"] = write / (disk.write_gbps * GB)
            # NOTE: the probe is small; where the engine's own transfers kept the
            # disk busy for less time, the disk is faster than the probe saw.
            busy = d.get("nvme_busy_seconds", 0.0)
            at_rates = io_bound_seconds(read, write, disk)
            lap["nvme_seconds"] = min(at_rates, busy) if busy > 0 else at_rates
        parts = {"host to device": h2d, "device to host": d2h}
        if self._backend.computes_apart:
            parts |= {"device compute": compute, "host optimizer": optimizer}
        else:
            parts["host compute and optimizer"] = compute + optimizer
        if disk is not None:
            parts["nvme"] = lap["nvme_seconds"]
        bound_by = max(parts, key=lambda name: parts[name])
        bound = parts[bound_by]
        lap["bound_seconds"] = bound
        lap["step_over_bound"] = d["seconds"] / bound if bound > 0 else float("inf")
        return lap, bound_by
