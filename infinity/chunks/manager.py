"""The chunk manager: the one owner of placement, transfers and byte accounting.

It moves chunk bytes between tiers and nothing else: which chunk is needed when
is decided above it (runtime hooks, the prefetcher, the optimizer pipeline).

Data flow: parameters go home -> (host staging, if the home is NVMe) -> device;
gradients go device -> host home (adding to what earlier micro-batches left) or
-> host staging -> NVMe; optimizer units and updated parameters go between
their homes and the optimizer through host staging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Hashable

import torch

from infinity.chunks.cache import Copy, EvictionPolicy, TierCache
from infinity.chunks.grad_flow import GradientFlow, chunk_key
from infinity.chunks.homes import DeviceHomeCopy, HomeStore, Key, Kind
from infinity.chunks.movers import Purpose, Stop, device_mover, route_table
from infinity.chunks.pools import (
    SlabPool,
    SpanKey,
    TierAccount,
    Traffic,
    first_span,
    is_split,
    part_ranges,
    span_key,
)
from infinity.chunks.shards import InUse, gather_param, start_gathers
from infinity.chunks.staging import HostStaging
from infinity.chunks.states import Clock, GradStates, UpdateStates
from infinity.core.names import DEVICE, HOST, NVME
from infinity.core.plan import Plan
from infinity.devices.base import DeviceBackend
from infinity.distributed import SINGLE, Collectives
from infinity.io import SwapFile

log = logging.getLogger("infinity")


class ChunkManager:
    """Places chunk copies in the device and host tiers and accounts every byte.

    Composed of :class:`~infinity.chunks.staging.HostStaging` (``host``: the
    staging slots of NVMe-homed chunks) and
    :class:`~infinity.chunks.grad_flow.GradientFlow` (``grad_flow``: device
    gradient chunks and their flush), both built here and given what they use;
    neither knows the manager. Callers use each one's verbs directly.
    """

    def __init__(
        self,
        plan: Plan,
        dtype: torch.dtype,
        backend: DeviceBackend,
        swap_file: SwapFile | None = None,
        *,
        device_policy: EvictionPolicy,
        host_policy: Callable[[], EvictionPolicy],
        collectives: Collectives | None = None,
        alloc_device: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """``device_policy`` ranks device copies; ``host_policy`` makes the policy of
        each kind's host staging cache (the strategies are the schedule's).
        ``collectives`` joins the ranks of a sharded plan (``chunks/shards.py``).
        ``alloc_device`` allocates the device slabs (default: the backend's)."""
        if plan.sharded and collectives is None:
            raise AssertionError("a sharded plan needs the collectives of its ranks")
        self.plan = plan
        # One process's (a manager built alone, in tests) answers every collective itself.
        self.collectives = collectives if collectives is not None else Collectives(SINGLE)
        self.dtype = dtype
        self.backend = backend
        self.traffic = Traffic(stall=backend.clock.stall)
        self.device_account = TierAccount("device", plan.budgets.device)
        self.host_account = TierAccount("host", plan.budgets.host)
        self.nvme_account = TierAccount("nvme", plan.budgets.nvme)
        # Whole-chunk and whole-tensor copies in host memory, outside the host budget:
        # sharded chunks opened whole (Adafactor's step, state dicts, checkpoints) and
        # an oversize tensor Adafactor steps whole (runtime/memory.py gives the limit).
        self.transient_account = TierAccount("host transient copies", None)
        self.homes = HomeStore(
            plan,
            backend.alloc_host,
            self.host_account,
            self.traffic,
            swap_file,
            alloc_device or backend.alloc_device,
        )
        # NOTE [routes are data]: how bytes travel between the homes and the
        # device; a backend that reads NVMe into device memory shortens one.
        self.nvme_reader = backend.nvme_reader(swap_file) if swap_file is not None else None
        self.routes = route_table(nvme_to_device=self.nvme_reader is not None)
        device_mover(self.routes(Purpose.COMPUTE, NVME))  # a route no mover runs fails here
        self.failures = self.homes.failures  # the sticky first NVMe error
        self.nvme_account.reserved = plan.nvme_bytes
        self.nvme_account.add(plan.nvme_bytes)
        self.clock = Clock()
        device_pools = {
            size: SlabPool("device", size, count, alloc_device or backend.alloc_device)
            for size, count in plan.device_slots.items()
        }
        self.device_account.reserved = sum(p.reserved_bytes for p in device_pools.values())
        if self.homes.device_arena is not None:  # NOTE [chunks homed on the device]
            self.device_account.reserved += self.homes.device_arena.reserved_bytes
            self.device_account.add(self.homes.device_arena.reserved_bytes)
        self.device = TierCache(
            "device",
            device_pools,
            device_policy,
            self.device_account,
            self._write_back_device,
            lend_larger=not plan.recomputes_blocks,
        )
        self.host = HostStaging(
            plan,
            backend,
            self.homes,
            self.device,
            self.host_account,
            self.traffic,
            self.clock,
            host_policy,
        )
        self.staging = self.host.caches
        self.fixed_buffers = self.host.register(swap_file)
        n = plan.layout.num_chunks
        self.grad_flow = GradientFlow(
            n,
            dtype,
            backend,
            self.homes,
            self.device,
            self.host,
            self.traffic,
            self.clock,
            collectives if plan.sharded else None,
        )
        # Where each chunk's optimizer update is: moved by the engine's update
        # pipeline only; checked here, on every read of parameter bytes.
        self.updates = UpdateStates(n)
        self.in_use = InUse(plan.spare_device_slots)  # sharded: what every rank holds

    def _write_back_device(self, copy: Copy) -> None:
        """The device cache's write-back of a dirty copy: its gradients go home."""
        self.grad_flow.write_back_device(copy)

    @property
    def moment(self) -> int:
        """The current moment of the iteration (set by the runtime at every access)."""
        return self.clock.now

    @moment.setter
    def moment(self, value: int) -> None:
        self.clock.now = value

    @property
    def grads(self) -> GradStates:
        """Where each chunk's gradients of the current accumulation cycle are."""
        return self.grad_flow.grads

    # --- host staging -------------------------------------------------------------
    def prefetch_host(self, key: Key, protect: Collection[Key] = ()) -> bool:
        """Start reading an NVMe-homed key into host staging (no-op if host-homed);
        False if no staging slot was free without evicting a key of ``protect``
        (try again later). An oversize key starts its first span."""
        if self.homes.tier(key) == DEVICE:
            return True  # stepped where it lives: nothing to read
        if self.homes.tier(key) != HOST:
            key = first_span(self.plan, key)
        cache = self.staging[key[0]]
        if key in cache:  # the common case: polls retry reads already started
            cache.touch(key, self.moment)
            return True
        if self.homes.tier(key) == HOST:
            return True
        self.grad_flow.check_grad_kept(key)
        copy = self.host.staged(
            key, load=True, wait=False, prefetch=True, from_device=True, protect=protect
        )
        return copy is not None

    # --- device tier -------------------------------------------------------------
    def fetch_param(self, i: int, *, prefetch: bool = False) -> Copy | None:
        """Start bringing parameter chunk ``i`` to the device; returns its device copy.

        With ``prefetch`` nothing blocks and nothing needed sooner than chunk
        ``i`` is evicted (per the eviction policy's next-use estimate); then
        ``None`` means "not now".
        """
        # NOTE: the prefetcher never asks for a chunk whose update is queued; a
        # needed one runs its update first (never on the prefetch path: it may wait).
        if prefetch:
            self.updates.check_readable(i)
        else:
            self.updates.ensure_readable(i)
        key = (Kind.PARAM, i)
        if self.plan.sharded:
            if prefetch:
                raise AssertionError("sharded chunks are gathered on demand only (prefetch_params)")
            return gather_param(self, i)
        copy = self.device.get(key)
        if copy is not None:
            return copy
        nbytes = self.homes.nbytes(key)
        if prefetch:
            copy = self.device.try_insert(key, nbytes, self.moment, self.sooner_than(key))
            if copy is None:
                return None
        else:
            copy = self.device.insert(key, nbytes, self.moment)
        route = self.routes(Purpose.COMPUTE, self.homes.tier(key))
        fill = device_mover(route)(self, i, copy, prefetch)
        if fill is None:
            self.device.remove(key)
            return None
        copy.pending.append(fill)
        copy.filled = True
        if route.stops[-2] not in (Stop.NVME, Stop.DEVICE_HOME):  # h2d: bytes from host memory
            self.traffic.h2d_bytes += nbytes  # (a direct mover counts what it copies)
        return copy

    def prefetch_params(self, upcoming: Callable[[Callable[[int], bool]], list[int]]) -> None:
        """Start bringing the parameter chunks the schedule needs next towards the
        device, in order, without blocking or evicting anything needed sooner; stop at
        the first that cannot start now. ``upcoming(resident)`` names them, given
        which chunks are resident.

        NOTE: sharded, the gathers are collective, so the list must be the same on
        every rank: the next needs, whatever each rank has cached. Only this rank's
        shard of a chunk not every rank can take now is read into host staging
        (``chunks/shards.py start_gathers``).
        """
        if self.plan.sharded:
            start_gathers(self, upcoming(lambda _chunk: False), self.host.host_ready)
            return
        for i in upcoming(lambda chunk: (Kind.PARAM, chunk) in self.device):
            if self.updates.queued(i):
                break  # its update has not run: the home still holds old values
            if self.fetch_param(i, prefetch=True) is None:
                break  # no room without evicting something needed sooner

    def sooner_than(self, key: Key) -> Callable[[Hashable], bool]:
        """Eviction filter for prefetching ``key``: only copies needed after it (by the
        device policy's forecast; any copy without one)."""
        # Duck-typed, not isinstance(ForecastingPolicy): a runtime-checkable
        # Protocol check walks the protocol's attributes on every call, and this
        # runs for every prefetch (about 2 ms of a 100 ms step).
        next_use: Callable[[Hashable, int], float] | None = getattr(
            self.device.policy, "next_use", None
        )
        if next_use is None:
            return lambda _victim: False
        moment = self.moment
        mine = next_use(key, moment)
        return lambda victim: next_use(victim, moment) > mine

    def param_on_device(self, i: int) -> Copy:
        """Parameter chunk ``i`` resident on the device (fetched if needed)."""
        copy = self.fetch_param(i)
        assert copy is not None
        self.device.touch(copy.key, self.moment)
        if copy.pending:
            with self.traffic.waiting("device"):
                for pending in copy.pending:
                    # A device copy's transfers are the backend's handles (or
                    # chains ending in one), which can wait on the compute stream.
                    pending.wait_for_compute()  # type: ignore[attr-defined]
        return copy

    def param_alias(self, i: int) -> torch.Tensor:
        """Parameter chunk ``i`` on the device, as a fresh alias of its slot (uint8).

        NOTE: the alias is registered before this returns, so nothing (a
        prefetch, another fetch) can evict the copy while the caller binds views.
        """
        copy = self.param_on_device(i)
        alias = self.backend.alias(copy.tensor)
        copy.add_alias(alias)
        return alias

    def poll(self) -> None:
        """Advance two-stage transfers whose first stage has landed (never blocks)."""
        for copy in self.device:
            if copy.pending:
                copy.in_flight()

    def drop_param(self, i: int) -> None:
        """Forget cached copies of parameter chunk ``i`` (its home was updated)."""
        key = (Kind.PARAM, i)
        if key in self.device:
            # NOTE: a view made before the update may still be alive (a cycle not
            # yet collected, or an autograd node still running during an
            # overlapped step): it keeps the old values, and its slot, until it dies.
            self.device.discard(key)

    # --- host side: optimizer and state access ----------------------------------
    def open_host(
        self, key: Key, *, load: bool = True, writable: bool = True, on_device: bool = False
    ) -> tuple[torch.Tensor, Copy | DeviceHomeCopy | None]:
        """Host bytes of ``key`` to read or update; pair with :meth:`close_host`.

        A host-homed key gives its home; an NVMe-homed one a pinned staging
        copy (read first if ``load``). Its data has landed; with ``writable``
        every transfer still reading the buffer has finished as well. A
        device-homed key gives its home where the device's memory is the host's
        (the CPU backend) or the caller computes on the device (``on_device``:
        an update stepped there), else a host copy (:class:`DeviceHomeCopy`).

        NOTE: reading parameter or optimizer bytes of a chunk whose update
        trails the step runs that update first (``UpdateStates.ensure_readable``).
        A chunk queued during backward (overlap_optimizer) passes: reading state
        between backward and ``optimizer.step()`` shows each chunk as its
        update left it, updated or not yet.
        """
        if key[0] is not Kind.GRAD:
            self.updates.ensure_readable(key[1], early=False)
        if self.homes.tier(key) == HOST:
            self.host.wait_home(key)
            return self.homes.host(key), None
        if self.homes.tier(key) == DEVICE:
            if on_device or self.backend.shares_host_memory:
                return self.homes.device(key), None
            home_copy = DeviceHomeCopy.open(
                self.homes, key, self.backend, self.traffic, self.transient_account, load=load
            )
            return home_copy.tensor, home_copy
        if load:
            # A consumed gradient chunk is never cached in staging, so
            # checking before the lookup is checking every read from disk.
            self.grad_flow.check_grad_kept(key)
        # Pinned inside ``staged`` from the moment the copy is placed: the
        # caller holds a reference (a pin) that only close_host gives back.
        copy = self.host.staged(key, load=load, writable=writable, from_device=True, pin=True)
        assert copy is not None
        return copy.tensor, copy

    def open_span(
        self,
        kind: Kind,
        chunk: int,
        start: int,
        end: int,
        *,
        load: bool = True,
        writable: bool = True,
        on_device: bool = False,
    ) -> tuple[list[torch.Tensor], Copy | DeviceHomeCopy | None]:
        """Host bytes (uint8) of elements ``[start, end)`` of every part of ``(kind, chunk)``;
        pair with ``close_host(copy, ...)``.

        A host-homed key gives slices of its home (no copy); an NVMe-homed one a
        staging copy of the span, read first if ``load``; a device-homed one as
        :meth:`open_host` gives it (``on_device``).
        """
        key: Key = (kind, chunk)
        span = SpanKey(kind, chunk, start, end)
        capacity = self.plan.layout.chunks[chunk].capacity
        ranges = part_ranges(self.plan, span)
        if self.homes.tier(key) in (HOST, DEVICE):
            # NOTE: a device home's host copy is of the whole chunk: written back whole,
            # so a span of it is read first even where the caller writes all of the span.
            whole = (start, end) == (0, capacity)
            region, home_copy = self.open_host(
                key, load=load or not whole, writable=writable, on_device=on_device
            )
            return [region[offset : offset + nbytes] for offset, nbytes in ranges], home_copy
        if not is_split(self.plan, chunk) and (start, end) == (0, capacity):
            region, copy = self.open_host(key, load=load, writable=writable)
        else:
            region, copy = self.open_host(
                span_key(kind, chunk, start, end), load=load, writable=writable
            )
        parts, at = [], 0
        for _offset, nbytes in ranges:
            parts.append(region[at : at + nbytes])
            at += nbytes
        return parts, copy

    def close_host(
        self, copy: Copy | DeviceHomeCopy | None, *, modified: bool, keep: bool = False
    ) -> None:
        """Finish with :meth:`open_host`: start writing it home if ``modified``.

        ``keep`` leaves the staging copy cached (the write completes in the
        background; the slot is reused only after it has); otherwise this waits.

        Each :meth:`open_host` holds one pin of the copy, and two holders may
        share one copy (a state read of a span an update also holds). Only the
        last holder's close drops it: one that closes earlier gives back its
        pin and leaves the copy to the others, cached.
        """
        if copy is None:
            return
        if isinstance(copy, DeviceHomeCopy):
            copy.close(modified=modified)
            return
        if copy.pins <= 0:
            raise AssertionError(f"staging copy {copy.key} closed more often than opened")
        copy.pins -= 1
        if modified:
            copy.pending.append(self.homes.write(chunk_key(copy), copy.tensor))
        if keep or copy.dirty or copy.pins:
            # NOTE: a dirty copy (gradients an overlapped step has yet to consume,
            # never written home) stays cached: dropping it would lose them.
            return
        with self.traffic.waiting("nvme"):
            self.staging[chunk_key(copy)[0]].drop(copy)

    def recut_units(self, plan: Plan) -> None:
        """Use ``plan``: the same layout and homes, optimizer units cut for another
        optimizer (``schedule/units.py``)."""
        self.synchronize()  # NOTE: every transfer landed: staged units are home
        self.homes.recut_units(plan)
        self.host.recut_units(plan)
        self.plan = plan

    def synchronize(self) -> None:
        """Wait for every transfer in flight in every tier."""
        for key in list(self.host.home_fill):
            self.host.wait_home(key)
        for cache in (self.device, *self.staging.values()):
            for copy in cache:
                copy.wait()
        self.backend.synchronize()
        self.failures.check()
