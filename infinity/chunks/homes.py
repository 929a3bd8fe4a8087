"""Authoritative copies of chunks: host regions, NVMe offsets and device regions.

Every (kind, chunk) has exactly one home, fixed by the plan: a region of a host
arena (allocated once, exact size), an offset in one preallocated swap file, or
a region of a device arena (a chunk stepped on the device: see
NOTE [chunks homed on the device]).
Caches in the tiers above hold copies; the home is what survives eviction.

The first failed NVMe transfer of a chunk home is kept until someone acts on it
(:class:`IOFailures`). Every read and write of a chunk's NVMe home is a :class:`WatchedTransfer`. A
failure is recorded the first time anyone sees it (``done()`` polls included)
and, through :meth:`IOFailures.sweep`, even when nobody looks at that request
again: the engine checks at each of its entry points. The first failure is
*sticky*: once recorded, the engine refuses to go on, because the bytes of at
least one chunk can no longer be trusted (a read that did not land, or a home
that does not hold what was written).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infinity.chunks.pools import (
    AllOf,
    ChainedTransfer,
    Pending,
    SpanKey,
    TierAccount,
    Traffic,
    part_ranges,
    span_nbytes,
)
from infinity.core.names import DEVICE, HOST, NVME, Key, Kind
from infinity.core.plan import Plan
from infinity.devices.base import DeviceBackend
from infinity.io import IORequest, NVMeIOError, SwapFile

# Starts reading a swap file region (offset) into a buffer: ``SwapFile.read``, or
# a backend's reader straight into device memory (``DeviceBackend.nvme_reader``).
Reader = Callable[[torch.Tensor, int], IORequest]


class Arena:
    """A single allocation split into fixed regions (permanent homes of chunks)."""

    def __init__(
        self, tier: str, sizes: list[int], allocate: Callable[[int], torch.Tensor]
    ) -> None:
        self.tier = tier
        total = sum(sizes)
        self.slab = allocate(total) if total else torch.empty(0, dtype=torch.uint8)
        self.regions: list[torch.Tensor] = []
        offset = 0
        for size in sizes:
            self.regions.append(self.slab[offset : offset + size])
            offset += size
        self.reserved_bytes = total


class HomeStore:
    """Host arenas and the NVMe swap file holding every chunk's home copy."""

    def __init__(
        self,
        plan: Plan,
        alloc_host: Callable[[int], torch.Tensor],
        host_account: TierAccount,
        traffic: Traffic,
        swap_file: SwapFile | None = None,
        alloc_device: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """``alloc_device`` allocates the arena of device-homed keys (needed only when
        the plan homes some on the device)."""
        self.plan = plan
        self.traffic = traffic
        self.swap_file = swap_file
        if swap_file is not None:
            engine = swap_file.engine
            traffic.nvme_busy_clock = lambda: engine.busy_seconds
        self.failures = IOFailures()  # the first failed NVMe transfer, kept until acted on
        n = plan.layout.num_chunks
        self._where: dict[Key, str] = {}
        self._nbytes: dict[Key, int] = {}
        for i in range(n):
            self._add((Kind.PARAM, i), plan.param_home[i], plan.param_bytes(i))
            if plan.grad_home[i] is not None:
                self._add((Kind.GRAD, i), plan.grad_home[i], plan.param_bytes(i))
                self._add((Kind.OPTIM, i), plan.optim_home[i], plan.optim_bytes(i))
        host_keys = [k for k, t in self._where.items() if t == HOST]
        self.arena = Arena("host", [self._nbytes[k] for k in host_keys], alloc_host)
        # The regions as allocated; _host holds what each key uses of them.
        self._regions: dict[Key, torch.Tensor] = dict(
            zip(host_keys, self.arena.regions, strict=True)
        )
        self._host: dict[Key, torch.Tensor] = dict(self._regions)
        self._reserved = dict(self._nbytes)  # bytes of each home as placed
        host_account.reserved += self.arena.reserved_bytes
        host_account.add(self.arena.reserved_bytes)
        device_keys = [k for k, t in self._where.items() if t == DEVICE]
        self.device_arena: Arena | None = None
        self._device: dict[Key, torch.Tensor] = {}
        if device_keys:
            if alloc_device is None:
                raise AssertionError(
                    "the plan homes chunks on the device but no allocator was given"
                )
            sizes = [self._nbytes[k] for k in device_keys]
            self.device_arena = Arena("device", sizes, alloc_device)
            self._device = dict(zip(device_keys, self.device_arena.regions, strict=True))
            self._regions.update(self._device)
        self._offset: dict[Key, int] = {}
        self._writing: dict[Key, Pending] = {}  # the last write of each key, until it lands
        offset = 0
        for key, tier in self._where.items():
            if tier == NVME:
                self._offset[key] = offset
                offset += self._nbytes[key]
        if offset and swap_file is None:
            raise AssertionError("the plan puts states on NVMe but no swap file was given")
        if swap_file is not None and offset > swap_file.nbytes:
            raise AssertionError("swap file is smaller than the plan's NVMe bytes")

    def _add(self, key: Key, tier: str | None, nbytes: int) -> None:
        assert tier in (HOST, NVME, DEVICE)
        self._where[key] = tier
        self._nbytes[key] = nbytes

    def recut_units(self, plan: Plan) -> None:
        """Use ``plan``, whose optimizer units are cut for another optimizer (same
        homes, each unit no larger than its home: ``schedule/units.py``). Every
        NVMe home keeps its offset; a unit uses the start of its home."""
        for key in self._where:
            if key[0] is not Kind.OPTIM:
                continue
            nbytes = plan.optim_bytes(key[1])
            if nbytes > self._reserved[key]:
                raise AssertionError(f"{key}: a unit of {nbytes} bytes in a home of fewer")
            self._nbytes[key] = nbytes
            if key in self._device:
                self._device[key] = self._regions[key][:nbytes]
            elif key in self._regions:
                self._host[key] = self._regions[key][:nbytes]
        self.plan = plan

    def keys(self) -> list[Key]:
        """Every (kind, chunk) that has a home."""
        return list(self._where)

    def tier(self, key: Key) -> str:
        """``"host"``, ``"nvme"`` or ``"device"`` (a span's is its key's)."""
        if isinstance(key, SpanKey):
            return self._where[key.base]
        return self._where[key]

    def nbytes(self, key: Key) -> int:
        """Bytes of the home copy (of a span: its slice of every part)."""
        if isinstance(key, SpanKey):
            return span_nbytes(self.plan, key)
        return self._nbytes[key]

    def _ranges(self, key: Key) -> list[tuple[int, int]]:
        """(offset in the swap file, bytes) of each contiguous piece of ``key``'s home."""
        if isinstance(key, SpanKey):
            home = self._offset[key.base]
            parts = part_ranges(self.plan, key)
            return [(home + offset, nbytes) for offset, nbytes in parts]
        return [(self._offset[key], self._nbytes[key])]

    def host(self, key: Key) -> torch.Tensor:
        """The host region (uint8) of a host-homed key."""
        return self._host[key]

    def device(self, key: Key) -> torch.Tensor:
        """The device region (uint8) of a device-homed key."""
        return self._device[key]

    def _swap(self) -> SwapFile:
        """The swap file (NVMe-homed keys exist only when the plan gave it bytes)."""
        assert self.swap_file is not None
        return self.swap_file

    def read(self, key: Key, dst: torch.Tensor, reader: Reader | None = None) -> Pending:
        """Start reading an NVMe-homed key into ``dst`` (uint8, aligned) with ``reader``
        (default: the swap file's own, into host memory); returns the transfer. It
        starts only once a write of the same key still in flight has landed."""
        ranges = self._ranges(key)
        self.traffic.nvme_read_bytes += sum(n for _o, n in ranges)
        read = reader or self._swap().read
        return self._after_write(key, lambda: _each(read, dst, ranges))

    def write(self, key: Key, src: torch.Tensor) -> Pending:
        """Start writing ``src`` to an NVMe-homed key; returns the transfer (issued
        after a write of the same key still in flight, so the last one wins)."""
        ranges = self._ranges(key)
        self.traffic.nvme_write_bytes += sum(n for _o, n in ranges)
        swap = self._swap()
        transfer = self._after_write(key, lambda: _each(swap.write, src, ranges))
        self._writing[key] = transfer
        return transfer

    def _after_write(self, key: Key, submit: Callable[[], list[IORequest]]) -> Pending:
        # NOTE: requests to one file region may complete in any order. Callers
        # mostly keep them apart (a staging copy stays cached while its write
        # lands), but a copy evicted mid-write frees its key at once: this is
        # what keeps a re-read of that key from seeing the old bytes.
        # A failed earlier write raises here (and in the chain): the home does
        # not hold what the caller expects to read or to overwrite.
        # NOTE: the chain is kept in self._writing: it holds the failures, not self
        # (a cycle would keep the homes after the engine: NOTE [the model owns its engine]).
        failures = self.failures

        def start() -> Pending:
            watched = [failures.watch(request, key) for request in submit()]
            return watched[0] if len(watched) == 1 else AllOf(watched)

        previous = self._writing.get(key)
        if previous is None or previous.done():
            if previous is not None:
                previous.wait()
            self._writing.pop(key, None)
            return start()
        return ChainedTransfer(previous, start)


class DeviceHomeCopy:
    """A host copy of a device-homed key, for a reader on the host (a state dict, a
    checkpoint, the gradients): read from the device when opened (if loaded), written
    back when closed modified. Counted in ``account`` (the manager's transient copies)
    while open, as the other whole-chunk copies made for such readers are.
    NOTE [chunks homed on the device]."""

    def __init__(
        self,
        region: torch.Tensor,
        backend: DeviceBackend,
        traffic: Traffic,
        account: TierAccount,
    ) -> None:
        self.region = region
        self.tensor = torch.empty(region.numel(), dtype=torch.uint8)
        self._backend = backend
        self._traffic = traffic
        self._account = account
        account.add(self.tensor.numel())

    @classmethod
    def open(
        cls,
        homes: HomeStore,
        key: Key,
        backend: DeviceBackend,
        traffic: Traffic,
        account: TierAccount,
        *,
        load: bool,
    ) -> DeviceHomeCopy:
        """The copy of ``key``'s device home (its bytes read if ``load``)."""
        copy = cls(homes.device(key), backend, traffic, account)
        try:
            if load:
                with traffic.waiting("device"):
                    backend.copy_async(copy.tensor, copy.region).wait()
        except BaseException:
            account.sub(copy.tensor.numel())
            raise
        return copy

    def close(self, *, modified: bool) -> None:
        """Write the copy home if ``modified``; it is then given up."""
        try:
            if modified:
                with self._traffic.waiting("device"):
                    self._backend.copy_async(self.region, self.tensor).wait()
        finally:
            self._account.sub(self.tensor.numel())


def _each(
    transfer: Callable[[torch.Tensor, int], IORequest],
    buffer: torch.Tensor,
    ranges: list[tuple[int, int]],
) -> list[IORequest]:
    """One request per (file offset, bytes) range, over consecutive pieces of ``buffer``."""
    requests = []
    at = 0
    for offset, nbytes in ranges:
        requests.append(transfer(buffer[at : at + nbytes], offset))
        at += nbytes
    return requests


FIX = (
    "the model's weights and optimizer states are no longer reliable: load the last "
    "checkpoint into a freshly offloaded model (infinity.load_checkpoint) and continue "
    "from there"
)


def _describe(key: Key) -> str:
    kind, index = key[0], key[1]  # a span key carries its element range after these
    return f"{getattr(kind, 'value', kind)} chunk {index}"


class IOFailures:
    """The sticky first I/O error of one chunk manager, and its unchecked transfers."""

    def __init__(self) -> None:
        self.first: NVMeIOError | None = None
        self.reported = False  # the first error was raised at a caller at least once
        # (request, key) of each unchecked transfer; not the WatchedTransfer, which holds
        # this object (a cycle: NOTE [the model owns its engine]).
        self._watched: list[tuple[IORequest, Key]] = []

    def watch(self, request: IORequest, key: Key) -> WatchedTransfer:
        """Wrap a just-submitted transfer of ``key``'s home so its outcome is never lost."""
        if len(self._watched) > 64:
            self.sweep()
        self._watched.append((request, key))
        return WatchedTransfer(request, key, self)

    def record(self, error: NVMeIOError, key: Key, *, raised: bool) -> NVMeIOError:
        """Note a failed transfer of ``key``; returns the error to raise (the first one).
        ``raised``: the caller raises it now (else it waits for the next check)."""
        if self.first is None:
            what = _describe(key)
            first = NVMeIOError(
                error.errno,
                f"{what}: {error.strerror}. {FIX[0].upper()}{FIX[1:]}",
                error.filename,
                op=error.op,
                offset=error.offset,
                nbytes=error.nbytes,
            )
            first.chunk = what  # type: ignore[attr-defined]
            self.first = first
        self.reported = self.reported or raised
        # Raised again and again: a fresh traceback each time, not an ever longer one.
        return self.first.with_traceback(None)

    def sweep(self) -> None:
        """Look at every finished transfer: record a failure, forget the successes."""
        running = []
        for request, key in self._watched:
            if not request.done():
                running.append((request, key))
                continue
            error = request.exception()
            if error is not None:
                self.record(error, key, raised=False)
        self._watched = running

    def check(self) -> None:
        """Raise if a transfer has failed: the first error, or (once that was raised)
        a refusal naming it."""
        self.sweep()
        first = self.first
        if first is None:
            return
        if not self.reported:
            self.reported = True
            raise first.with_traceback(None)
        raise NVMeIOError(
            first.errno,
            f"this offloaded model stopped after an earlier I/O error and refuses to run: "
            f"{first.strerror}",
            first.filename,
            op=first.op,
            offset=first.offset,
            nbytes=first.nbytes,
        )

    def raise_unreported(self) -> None:
        """Raise the first error if it was never raised at a caller (``close``)."""
        self.sweep()
        if self.first is not None and not self.reported:
            self.reported = True
            raise self.first.with_traceback(None)


class WatchedTransfer:
    """An NVMe transfer of one chunk home whose failure is recorded when first seen.

    ``wait()`` raises the manager's first error (naming the chunk, the file,
    the offset and the errno) whenever this transfer failed, every time it is
    called: a failed read is never taken for landed data, a failed write
    never for a clean home.
    """

    __slots__ = ("_failures", "key", "request")

    def __init__(self, request: IORequest, key: Key, failures: IOFailures) -> None:
        self.request = request
        self.key = key
        self._failures = failures

    def done(self) -> bool:
        """Finished, successfully or not (a failure is recorded, not raised)."""
        if not self.request.done():
            return False
        error = self.request.exception()
        if error is not None:
            self._failures.record(error, self.key, raised=False)
        return True

    def wait(self) -> int:
        """Block until finished; raise the first I/O error if this transfer failed."""
        try:
            return self.request.wait()
        except NVMeIOError as exc:
            first = self._failures.record(exc, self.key, raised=True)
        raise first
