"""The gradient side of the chunk manager: device gradient slots and their flush.

A component the :class:`~infinity.chunks.manager.ChunkManager` holds (and
builds): it owns the gradient lifecycle of every chunk
(:class:`~infinity.chunks.states.GradStates`) and the fp16 overflow note,
and uses the device cache and host staging it is given, never the manager.
Gradients are the only data that flows device -> host: a flush copies a device
gradient chunk to its home (host, or host staging then NVMe), overwriting at
the start of an accumulation cycle and adding afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from typing import cast

import torch

from infinity.chunks.cache import Copy, TierCache
from infinity.chunks.homes import DeviceHomeCopy, HomeStore, Key, Kind
from infinity.chunks.pools import ChainedTransfer, Pending, Traffic, is_split, span_key, span_ranges
from infinity.chunks.shards import device_shard
from infinity.chunks.staging import HostStaging
from infinity.chunks.states import Clock, GradState, GradStates
from infinity.core.names import DEVICE, HOST
from infinity.core.plan import Plan
from infinity.devices.base import DeviceBackend
from infinity.distributed import Collectives


def chunk_key(copy: Copy) -> Key:
    """The (kind, chunk) of a copy in the manager's caches.

    A retired device slot still landing is keyed ``("retired", key, id)``
    (see ``TierCache``); its ``[0]`` is no ``Kind``, so kind tests skip it.
    """
    return cast(Key, copy.key)


class GradientFlow:
    """Device gradient chunks: taking a slot, writing gradients in, flushing them home."""

    def __init__(
        self,
        num_chunks: int,
        dtype: torch.dtype,
        backend: DeviceBackend,
        homes: HomeStore,
        device: TierCache,
        staging: HostStaging,
        traffic: Traffic,
        clock: Clock,
        collectives: Collectives | None = None,
    ) -> None:
        """``collectives``: a sharded plan's ranks (each flush reduce-scatters the
        whole device chunk and keeps this rank's shard of the mean)."""
        self.dtype = dtype
        self.collectives = collectives
        self.backend = backend
        self.homes = homes
        self.device = device
        self.staging = staging
        self.traffic = traffic
        self.clock = clock
        # Where each chunk's gradients of the current accumulation cycle are.
        self.grads = GradStates(num_chunks)
        # fp16: an inf/NaN gradient was seen in this accumulation cycle (the step is skipped).
        self.found_inf = False
        self.check_overflow = False
        # overlap_optimizer=True: NVMe-homed gradients wait in staging for their
        # step and are dropped once used, never written (the promise of that
        # mode is that nothing reads them after the step): GradState.CONSUMED.
        self.consume_grads = False

    def _grad_on_device(self, i: int) -> Copy:
        """Gradient chunk ``i`` on the device (a fresh slot if it has none); what
        :meth:`write_grad` leaves unwritten is zeroed when the chunk is flushed."""
        key = (Kind.GRAD, i)
        copy = self.device.get(key)
        if copy is None:
            # Adding to gradients a step dropped could only fail at the flush.
            self.check_grad_kept(key)
            nbytes = self.homes.plan.device_param_bytes(i)
            copy = self.device.insert(key, nbytes, self.clock.now)
            copy.dirty = True
            if self.collectives is not None:
                # NOTE: a flush is collective, so it must happen where every rank
                # flushes (a chunk's gradients complete, the end of backward),
                # never when one rank's cache runs short: pinned until then.
                copy.pins += 1
            # Not zeroed now: most of a chunk is about to be overwritten by
            # its tensors' gradients, so only the gaps are zeroed, at the flush.
            self.grads.slot_taken(i)
        self.device.touch(key, self.clock.now)
        return copy

    def write_grad(self, i: int, start: int, grad: torch.Tensor) -> None:
        """Copy ``grad`` into device gradient chunk ``i`` at element ``start``
        (taking a device slot for the chunk if it has none)."""
        flat = self._grad_on_device(i).typed(self.dtype)
        end = start + grad.numel()
        flat[start:end].view(grad.shape).copy_(grad)
        self.grads.written[i].append((start, end))

    def _zero_unwritten(self, i: int, grads: torch.Tensor) -> None:
        """Zero what no gradient was written to in device chunk ``i`` (gaps, unused tensors)."""
        cursor = 0
        for start, end in sorted(self.grads.written[i]):
            if start > cursor:
                grads[cursor:start].zero_()
            cursor = max(cursor, end)
        if cursor < grads.numel():
            grads[cursor:].zero_()

    def flush_grad(self, i: int) -> None:
        """Move gradient chunk ``i`` off the device, adding it to its home."""
        copy = self.device.get((Kind.GRAD, i))
        if copy is not None:
            self._evict(copy)

    def flush_all_grads(self) -> None:
        """Flush every gradient chunk on the device (end of backward), in chunk order
        (the order of a sharded plan's collectives)."""
        grads = [c for c in self.device if chunk_key(c)[0] is Kind.GRAD]
        if self.collectives is not None:
            grads.sort(key=lambda c: chunk_key(c)[1])
        for copy in grads:
            self._evict(copy)

    def _evict(self, copy: Copy) -> None:
        if self.collectives is not None:
            copy.pins -= 1  # pinned since its slot was taken (_grad_on_device)
        self.device.evict(copy.key)

    def write_back_device(self, copy: Copy) -> None:
        """Flush a dirty device gradient copy home (the device cache's write-back)."""
        kind, i = chunk_key(copy)
        if kind is not Kind.GRAD:
            raise AssertionError(f"device copy {copy.key} is dirty but only gradients flow back")
        grads = copy.typed(self.dtype)
        self._zero_unwritten(i, grads)
        if self.grads.norms_wanted and self.grads[i] is GradState.RECEIVING:
            self._take_norms(i, grads)
        key: Key = (Kind.GRAD, i)
        nbytes = self.homes.nbytes(key)
        source = copy.tensor
        to_home: Callable[[torch.Tensor], Pending] | None = None
        if self.collectives is not None:
            if self.grads[i] is GradState.RECEIVING and not self.check_overflow:
                to_home = self._start_reduce_scatter(copy, i)
            else:
                source = self._reduce_scatter(copy, i)
        if to_home is None:
            self._check_finite(source.view(self.dtype))
            to_home = partial(self._copy_to, source)
        if self.homes.tier(key) == DEVICE:
            self._flush_on_device(key, source)
            return
        self.traffic.d2h_bytes += nbytes
        if is_split(self.homes.plan, i):
            self._flush_in_spans(copy, i)
            return
        if self.grads[i] is GradState.RECEIVING:
            # First gradients of this accumulation cycle: a plain copy home, left
            # in flight (the device slot is reused only once it has landed).
            if self.homes.tier(key) == HOST:
                d2h = to_home(self.homes.host(key))
                copy.pending.append(d2h)
                self.staging.home_fill[key] = d2h
                self.grads.flushed(i)
                return
            home = self.staging.staged(key, load=False)
            assert home is not None
            d2h = to_home(home.tensor)
            copy.pending.append(d2h)
            home.fill = d2h  # readers of the staging copy wait for it
            if self.consume_grads:
                # The step will most likely use these bytes straight from
                # staging and drop them (consume_grad): write them home only if
                # the slot is evicted first (_write_back_staging).
                home.pending.append(d2h)
                home.dirty = True
            else:
                staged = home.tensor
                write = ChainedTransfer(d2h, partial(self.homes.write, key, staged))
                home.pending.append(write)
            self.grads.flushed(i)
            return
        if self.homes.tier(key) == HOST:
            self.staging.wait_home(key)
            self._add_into(self.homes.host(key), source, i, nbytes)
        else:
            # The home on NVMe is only ever changed through its staging
            # copy, so a cached staging copy can never be stale.
            home = self.staging.staged(key, load=True)
            assert home is not None
            home.pins += 1  # the transient slot below must not take this one
            try:
                self._add_into(home.tensor, source, i, nbytes)
            finally:
                home.pins -= 1
            home.pending.append(self.homes.write(key, home.tensor))
            home.dirty = False  # the sum is on its way home
        self.grads.flushed(i)

    def _flush_on_device(self, key: Key, source: torch.Tensor) -> None:
        """A device slot's gradients into their home on the device, copied or added there
        in the compute stream's order: NOTE [chunks homed on the device]."""
        i = key[1]
        home = self.homes.device(key)
        if self.grads[i] is GradState.RECEIVING:
            self.backend.copy_on_device(home, source)
        else:
            summed = home.view(self.dtype)
            summed.add_(source.view(self.dtype))
            self._check_finite(summed)  # as _add_into: a sum of finite fp16 may overflow
        self.grads.flushed(i)

    def _take_norms(self, i: int, grads: torch.Tensor) -> None:
        """Keep the 2-norms of chunk ``i``'s tensors' gradients, taken on the device before
        they leave: NOTE [gradient norms on the device]. Not for a sharded chunk (the
        device holds this rank's part of the sum), a chunk in spans, or fp16 (its norms
        are of unscaled values)."""
        if self.collectives is not None or self.check_overflow or is_split(self.homes.plan, i):
            return
        slots = [s for s in self.homes.plan.layout.chunks[i].slots if s.numel]
        if not slots:
            return
        # One launch for the chunk's tensors (torch's own clip_grad_norm_ takes its
        # norms with _foreach_norm on a GPU); on the host it is vector_norm per tensor.
        norms = torch.stack(
            torch._foreach_norm(
                [grads[s.offset : s.offset + s.numel].view(s.shape) for s in slots],
                2.0,
                dtype=torch.float32,
            )
        )
        self.grads.norms[i] = (tuple(s.index for s in slots), norms)

    def _flush_in_spans(self, copy: Copy, i: int) -> None:
        """:meth:`write_back_device` of an oversize gradient chunk, span by span through
        staging slots of the normal size (``chunks/pools.py``); its gaps are zeroed.

        Unlike a normal chunk, its staged bytes are written home even with
        ``consume_grads``: spans are not kept for the step to consume.
        """
        key: Key = (Kind.GRAD, i)
        size = self.homes.plan.element_size
        receiving = self.grads[i] is GradState.RECEIVING
        if self.homes.tier(key) == HOST:
            if receiving:
                d2h = self.backend.copy_async(self.homes.host(key), copy.tensor)
                copy.pending.append(d2h)
                self.staging.home_fill[key] = d2h
            else:
                self.staging.wait_home(key)
                total = self.homes.host(key)
                for start, end in span_ranges(self.homes.plan, i):
                    device = copy.tensor[start * size : end * size]
                    self._add_into(
                        total[start * size : end * size], device, ("span", i, start), device.numel()
                    )
            self.grads.flushed(i)
            return
        for start, end in span_ranges(self.homes.plan, i):
            span = span_key(Kind.GRAD, i, start, end)
            device = copy.tensor[start * size : end * size]
            if receiving:
                home = self.staging.staged(span, load=False)
                assert home is not None
                d2h = self.backend.copy_async(home.tensor, device)
                copy.pending.append(d2h)
                home.fill = d2h  # readers of the staging copy wait for it
                home.pending.append(
                    ChainedTransfer(d2h, partial(self.homes.write, span, home.tensor))
                )
                continue
            home = self.staging.staged(span, load=True)
            assert home is not None
            home.pins += 1  # the transient slot of the sum must not take this one
            try:
                self._add_into(home.tensor, device, span, device.numel())
            finally:
                home.pins -= 1
            home.pending.append(self.homes.write(span, home.tensor))
        self.grads.flushed(i)

    def consume_grad(self, copy: Copy | DeviceHomeCopy | None) -> None:
        """The optimizer step is done with a gradient chunk's staging copy: if its
        bytes never went home (``consume_grads``), drop them instead of writing them."""
        if not isinstance(copy, Copy) or not copy.dirty or copy.pins:
            return
        i = chunk_key(copy)[1]
        if self.grads[i] is not GradState.FLUSHED:
            # ADDING: more gradients of the chunk are on the device (a
            # tensor used again after the early step); their flush adds to
            # these bytes, so they are kept and written home as usual.
            return
        copy.dirty = False
        self.grads.consumed(i)
        self.staging.caches[Kind.GRAD].remove(copy.key)

    def check_grad_kept(self, key: Key) -> None:
        """Raise if ``key`` is a gradient chunk whose gradients a step consumed."""
        kind, i = key[0], key[1]
        if kind is Kind.GRAD and self.grads.dropped(i):
            raise RuntimeError(
                f"the gradients of chunk {i} were used by the overlapped optimizer step and are "
                "not kept (Config(overlap_optimizer=True) drops them instead of writing them to "
                "NVMe). Call optimizer.zero_grad() after optimizer.step(), and read gradients "
                "before the step with overlap_optimizer=False."
            )

    def _copy_to(self, source: torch.Tensor, dst: torch.Tensor) -> Pending:
        return self.backend.copy_async(dst, source)

    def _start_reduce_scatter(self, copy: Copy, i: int) -> Callable[[torch.Tensor], Pending]:
        """Sharded, the first flush of an accumulation cycle: start reducing device
        gradient chunk ``i``; returns how to bring this rank's mean shard to a home
        buffer once it has landed (backward goes on meanwhile)."""
        assert self.collectives is not None
        size = self.collectives.world.size
        # NOTE: reduced in place, into this rank's shard of the slot itself (the slot is
        # held until the copy home lands): a buffer of its own stayed alive in the
        # pending copy until the step, one shard of every gradient chunk on the device
        # outside every budget (the fence sweep's allocator found it).
        mean = device_shard(self.homes.plan, i, copy.tensor).view(self.dtype)
        work = self.collectives.start_reduce_scatter(
            mean, copy.typed(self.dtype), f"reducing gradient chunk {i}"
        )

        backend = self.backend  # not self: the chain waits in the slot's copy (a cycle)

        def to_home(dst: torch.Tensor) -> Pending:
            def copy_mean() -> Pending:
                mean.div_(size)
                return backend.copy_async(dst, mean.view(torch.uint8))

            return ChainedTransfer(work, copy_mean)

        return to_home

    def _reduce_scatter(self, copy: Copy, i: int) -> torch.Tensor:
        """Sharded: the mean over the ranks of device gradient chunk ``i``, this rank's
        shard of it, written at the shard's place in the slot (returned, uint8)."""
        assert self.collectives is not None
        own = device_shard(self.homes.plan, i, copy.tensor)
        self.collectives.reduce_scatter_mean(
            own.view(self.dtype), copy.typed(self.dtype), f"reducing gradient chunk {i}"
        )
        return own

    def _add_into(
        self, total: torch.Tensor, source: torch.Tensor, tag: Hashable, nbytes: int
    ) -> None:
        """``total += `` the device gradient bytes ``source`` (both uint8), through a
        transient staging slot of ``nbytes`` keyed by ``tag``."""
        cache = self.staging.caches[Kind.GRAD]
        stage_key = ("incoming", tag)
        stage = cache.insert(stage_key, nbytes, self.clock.now)
        try:
            handle = self.backend.copy_async(stage.tensor, source)
            with self.traffic.waiting("device"):
                handle.wait()
            summed = total.view(self.dtype)
            summed.add_(stage.typed(self.dtype))
            # NOTE: adding two finite fp16 gradients can overflow, so accumulated
            # sums are checked too, not only what came off the device.
            self._check_finite(summed)
        finally:
            cache.remove(stage_key)

    def overflowed(self) -> bool:
        """fp16: an inf/NaN gradient was seen in this accumulation cycle (by any rank:
        every rank skips the same steps)."""
        if self.collectives is None:
            return self.found_inf
        return self.collectives.any(self.found_inf, "checking fp16 gradients for overflow")

    def _check_finite(self, grads: torch.Tensor) -> None:
        """fp16: note an inf/NaN gradient (the step is then skipped).

        NOTE: from the extremes (a NaN anywhere makes both NaN, an infinity is one of
        them): ``isfinite(grads).all()`` made a mask of the chunk, and its
        intermediates, on the device beside every budget (found by the fence sweep)."""
        if self.check_overflow and grads.numel():
            low, high = torch.aminmax(grads)
            if not bool(torch.isfinite(low) & torch.isfinite(high)):
                self.found_inf = True

    def invalidate_grads(self) -> None:
        """Gradients were zeroed: the next flush overwrites instead of adding."""
        self.grads.zero_all()
        self.found_inf = False


def grad_norm_bytes(plan: Plan, granule: int) -> int:
    """The most device bytes the gradient norms taken at the flushes hold at once
    (NOTE [gradient norms on the device]): one fp32 per tensor of every trainable
    chunk kept, plus, while a chunk's are taken, one allocation per tensor before
    they are stacked (``granule``: the allocator's rounding). 0 where none are taken."""
    if plan.sharded:
        return 0
    counts = [
        sum(1 for s in spec.slots if s.numel)
        for i, spec in enumerate(plan.layout.chunks)
        if spec.trainable and not is_split(plan, i)
    ]
    kept = sum(-(-4 * n // granule) * granule for n in counts)
    return kept + max(counts, default=0) * -(-4 // granule) * granule
