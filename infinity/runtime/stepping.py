"""The update pipeline: what the optimizer front-ends ask of an offloaded model's engine.

A component of :class:`~infinity.runtime.engine.OffloadEngine`: it plans the step
over chunks and hands the work to the :class:`~infinity.runtime.update_queue.UpdateQueue`
(host-only chunks run at once, NVMe-bound ones trail into the next forward), queues
chunks during backward with ``overlap_optimizer=True``, owns the step count and the
fp16 loss-scale state, and reads and writes the optimizer state as torch's.

Optimizer states and step counts of offloaded parameters as torch's optimizer
state (:func:`read_moments`, for ``state_dict()`` / ``load_state_dict()``, which
``transformers.Trainer`` and Accelerate save): copied chunk by chunk from the units,
in RAM for all of them as torch's (``infinity.save_checkpoint`` streams instead).

Per-step timing and traffic, and the step's bound (:class:`StepTimer`): the slowest
of the step's four resources (the device's compute less its idle time in the
engine's waits, the host optimizer, the host-device link each way, the disk at the
swap folder's measured rates), each at the least time its work needs; everything
else should hide behind it (NOTE [the step's bound] in docs/NOTES.md says how
each is measured). ``hook_seconds`` is the host time inside the engine's hooks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.manager import ChunkManager
from infinity.chunks.pieces import Window, windows
from infinity.chunks.pools import Traffic
from infinity.devices.base import DeviceBackend
from infinity.io.rates import GB, DiskMix, disk_rates, io_bound_seconds
from infinity.optim.chunk_optimizer import UnitViews
from infinity.optim.offloaded import LossScaler, MomentState, engine_of_param
from infinity.runtime.grad_ledger import GradientLedger
from infinity.runtime.model_chunks import LEGAL_LOSS_SCALE, Lifecycle, LossScale, ModelChunks
from infinity.runtime.offloaded_step import plan_chunk, plan_works
from infinity.runtime.update_queue import UpdateQueue


class UpdatePipeline:
    """Optimizer steps of offloaded parameters (called by the optimizer through the engine).

    Hyper-parameters are the optimizer's own objects (``CPUOptimizer.hyper_of``),
    handed to the chunk optimizer unread: equal ones share a kernel call.
    """

    def __init__(
        self,
        chunks: ModelChunks,
        queue: UpdateQueue,
        ledger: GradientLedger,
        scaler: LossScaler | None,
        prefetch: Callable[[], None],
    ) -> None:
        """``prefetch`` starts fetching the next forward's first chunks (the fetcher's)."""
        self.chunks = chunks
        self.queue = queue
        self.ledger = ledger
        self.scaler = scaler
        self.prefetch = prefetch
        self.manager = chunks.manager
        self.step_count = 0
        self.step_timer = StepTimer(
            self.manager.traffic, self.manager.backend, _disk_of(self.manager)
        )
        self.loss_scale = Lifecycle(LossScale.UNSCALED, LEGAL_LOSS_SCALE, "loss scale")
        # Weak reference to the optimizer holding this model's parameters (it registers).
        self.optimizer: Callable[[], Any] | None = None
        # overlap_optimizer: the hyper-parameters of this backward's early steps.
        self._early_hyper: Mapping[int, object] | None = None

    def note_loss_scaled(self) -> None:
        """The loss of the coming backward was multiplied by the fp16 loss scale."""
        self.loss_scale.move(LossScale.SCALED)

    def step(self, hyper_by_index: Mapping[int, object]) -> bool:
        """Update every parameter that has a gradient; False if fp16 overflow skipped it.

        Gradients are multiplied by their pending factor (gradient clipping, see
        :mod:`infinity.runtime.gradients`) and the inverse fp16 loss scale
        inside the kernel. NVMe-bound chunks are queued, not updated yet (see
        :mod:`infinity.runtime.update_queue`).
        """
        self.queue.settle()  # a step still trailing (two steps without a forward between)
        self.manager.in_use.release()  # sharded: the updates make the held copies stale
        self.ledger.collect_zeroed()
        # No global synchronize here: every reader waits for exactly the
        # transfer it needs (a gradient's flush, a staging read), and writes
        # still in flight from the backward keep running behind this step.
        grad_scale = 1.0
        if self.scaler is not None:
            scaled = self.loss_scale.state is LossScale.SCALED
            if not scaled and self.chunks.has_grad.any:
                raise RuntimeError(
                    "fp16 training needs loss scaling: call "
                    "`optimizer.scale_loss(loss).backward()` instead of `loss.backward()` "
                    "(bf16 and fp32 need no scaling)"
                )
            found_inf = self.manager.grad_flow.overflowed()
            grad_scale = 1.0 / self.scaler.scale
            self.scaler.update(found_inf)
            if scaled:
                self.loss_scale.move(LossScale.UNSCALED)
            if found_inf:
                self.step_timer.lap()
                return False
        self.ledger.apply_clamps()  # clip_grad_value_: into the chunks before they are read
        grad_scale *= self.ledger.step_factor(hyper_by_index.keys())
        # overlap_optimizer: chunks queued during backward whose reads had not landed.
        planned = plan_works(self.chunks, hyper_by_index, skip=self.queue.handled_early())
        works = self.queue.take_early() + planned
        self._early_hyper = None
        self.step_count += 1
        self.queue.start_step(works, grad_scale)
        # The next forward's first chunks can travel while the user loads data.
        self.manager.moment = -1
        self.prefetch()
        self.step_timer.lap()
        self.manager.failures.check()  # e.g. a write-back of this step that already failed
        return True

    def step_early(self, chunk: int) -> None:
        """overlap_optimizer: queue the update of a chunk whose gradients are all in."""
        optimizer = self.optimizer() if self.optimizer is not None else None
        if optimizer is None:
            return
        if self._early_hyper is None:
            # The optimizer groups hyper-parameters by engine: this model's
            # is found through the registry, never held here.
            engine = engine_of_param(self.chunks.registry.entries[0].param)
            hyper = optimizer.offloaded_hyper()  # a CPUOptimizer (infinity.optim.front_end)
            self._early_hyper = hyper.get(engine, {}) if engine is not None else {}
        self.queue.add_early(chunk, plan_chunk(self.chunks, chunk, self._early_hyper))


def _disk_of(manager: ChunkManager) -> Callable[[], DiskMix | None] | None:
    """The rates of the disk under ``manager``'s swap file, measured when first asked
    (after its transfers in flight land); None without an NVMe tier."""
    swap = manager.homes.swap_file
    if swap is None:
        return None
    directory, config = os.path.dirname(swap.path), swap.engine.config

    def rates() -> DiskMix | None:
        return disk_rates(directory, config, before=manager.synchronize)

    return rates


def read_moments(engine: ModelChunks, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
    """``(index, (step, {slot: state}))`` copies for tensors stepped at least once
    (the caller has settled queued updates: a stale read raises ``StaleRead``)."""
    stepped = [i for i in indices if engine.tensor_steps[i] > 0]
    optimizer = engine.chunk_optimizer
    for chunk, group in engine.layout.group_by_chunk(stepped, int).items():
        slots = [engine.layout.slots[i] for i in group]
        states = [
            {
                name: torch.empty(slot.numel, dtype=torch.float32, device="cpu")
                for name in optimizer.state_slots
            }
            for slot in slots
        ]
        for unit, window in _units(engine, chunk, write=False):
            for slot, values in zip(slots, states, strict=True):
                where = window.overlap(slot.offset, slot.numel)
                if where is None:
                    continue
                # fp32 copies whatever the stored format (int8 decoded), as torch's.
                for name, value in optimizer.read_state(unit, where[1]).items():
                    values[name][where[0]].copy_(value)
        for i, slot, values in zip(group, slots, states, strict=True):
            shaped = {k: v.view(slot.shape) for k, v in values.items()}
            yield i, (engine.tensor_steps[i], {**shaped, **_tensor_copies(engine, i)})


def _units(engine: ModelChunks, chunk: int, *, write: bool) -> Iterator[tuple[UnitViews, Window]]:
    """Each window of ``chunk``'s optimizer unit (whole, or its spans) with its unit views
    (state slots in the stored format).

    Writing, every rank writes the same states and keeps its shard: no gather
    (an int8 block never straddles two shards)."""
    optimizer, has_master = engine.chunk_optimizer, engine.plan.has_master
    each = windows(engine.manager, Kind.OPTIM, chunk, write=write, gather=not write)
    with closing(each):
        for window in each:
            yield optimizer.piece_views(window.parts, has_master), window


def check_moments(engine: ModelChunks, values: dict[int, MomentState | None]) -> None:
    """Raise (changing nothing) if a state does not fit its tensor."""
    for i, value in values.items():
        if value is None:
            continue
        step, states = value
        entry = engine.registry.entries[i]
        if not entry.trainable:
            raise ValueError(f"optimizer state for {entry.name}, which is frozen (no moments)")
        shape = engine.layout.slots[i].shape
        for key in engine.chunk_optimizer.state_slots:
            moment = states.get(key)  # absent: zeros (torch.optim.SGD's None buffer)
            if moment is not None and tuple(moment.shape) != tuple(shape):
                raise ValueError(
                    f"optimizer state {key} of {entry.name} has shape {tuple(moment.shape)}, the "
                    f"parameter has {tuple(shape)}: the state dict is from another model"
                )
        shapes = engine.chunk_optimizer.tensor_state_shapes(tuple(shape))
        for key, size in shapes.items():
            given = states.get(key)
            if given is None:
                raise ValueError(
                    f"optimizer state of {entry.name} has no {key!r} (it has {sorted(states)}): "
                    "the state dict is from another optimizer"
                )
            if tuple(given.shape) != size:
                raise ValueError(
                    f"optimizer state {key} of {entry.name} has shape {tuple(given.shape)}, "
                    f"a parameter of shape {tuple(shape)} has {size}: the state dict is from "
                    "another model"
                )
        if step < 0:
            raise ValueError(f"optimizer state of {entry.name} has step {step}")


def write_moments(engine: ModelChunks, values: dict[int, MomentState | None]) -> None:
    """Set moments and step counts (by tensor index; ``None``: no state, as never
    stepped); check with :func:`check_moments` first. The caller has settled."""
    for i, value in values.items():
        _set_tensor_state(engine, i, value[1] if value is not None else {})
    optimizer = engine.chunk_optimizer
    for chunk, group in engine.layout.group_by_chunk(values, int).items():
        slots = [engine.layout.slots[i] for i in group]
        flats = []
        for i, slot in zip(group, slots, strict=True):
            value = values[i]
            given = value[1] if value is not None else {}  # no state: zeros, as never stepped
            flats.append(
                {
                    name: (given[name] if name in given else torch.zeros(slot.numel, device="cpu"))
                    .reshape(-1)
                    .to(torch.float32)
                    for name in optimizer.state_slots
                }
            )
        for unit, window in _units(engine, chunk, write=True):
            for slot, flat in zip(slots, flats, strict=True):
                where = window.overlap(slot.offset, slot.numel)
                if where is not None:
                    optimizer.write_state(unit, where[1], {k: v[where[0]] for k, v in flat.items()})
        for i in group:
            value = values[i]
            engine.tensor_steps[i] = value[0] if value is not None else 0


def _tensor_copies(engine: ModelChunks, index: int) -> dict[str, torch.Tensor]:
    """Copies of tensor ``index``'s per-tensor states (none for most optimizers)."""
    return {name: value.clone() for name, value in engine.tensor_state(index).items()}


def _set_tensor_state(engine: ModelChunks, index: int, states: dict[str, torch.Tensor]) -> None:
    """Set tensor ``index``'s per-tensor states from ``states`` (zeros for those it
    leaves out, as a fresh state)."""
    current = engine.tensor_state(index)
    for name, value in current.items():
        given = states.get(name)
        if given is None:
            value.zero_()
        else:
            value.copy_(given.reshape(value.shape))


Lap = dict[str, float]

_memcpy_rate: list[float] = []


def memcpy_bytes_per_second() -> float:
    """This host's memcpy rate (bytes/s), measured once per process on 8 MiB.

    Small, so the probe stays out of the step's memory peak; the caches may
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
            # The probe is small; where the engine's own transfers kept the
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
