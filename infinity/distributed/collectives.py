"""The collectives the engine runs on chunk shards, with errors that name the rank.

Every collective is called at a point every rank reaches in the same order
(a module's forward or backward, a gradient chunk completing, the step, a state
read): never from an I/O completion or a cache decision, which differ between
ranks. A peer that died or raised makes the call fail (gloo: the connection
closes; otherwise the group's timeout): the error says which rank saw it, during
what, and that the first error is in another rank's output.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from infinity.distributed.failures import failure_message
from infinity.distributed.world import World

# torch 2.13 names the flat collectives all_gather_single and
# reduce_scatter_single; older releases (2.4 onwards, which we support: the
# CUDA builds users have) only have the *_tensor names, with the same
# positional arguments and the same work handles.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DistributedError(RuntimeError):
    """A collective failed: a peer rank stopped, raised or timed out."""


class InFlight:
    """A collective started asynchronously (a transfer handle: ``done``, ``wait``)."""

    __slots__ = ("_collectives", "_what", "_work")

    def __init__(self, work: Any, collectives: Collectives, what: str) -> None:
        self._work = work
        self._collectives = collectives
        self._what = what

    def done(self) -> bool:
        """The collective has completed (or failed: :meth:`wait` raises then)."""
        return bool(self._work.is_completed())

    def wait(self) -> None:
        """Wait for it; a failure raises :class:`DistributedError` naming the rank."""
        with self._collectives._failing_as(self._what):
            self._work.wait()

    def wait_for_compute(self) -> None:
        """Device copies are waited for by compute: on the CPU, simply waited."""
        self.wait()


class _Finished:
    """The work of a collective that completed before it was returned."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass


def _staged(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives where the groups' backends cannot address it (the fence
    device: gloo takes host and CUDA memory only). See NOTE [the fence device]: such a
    collective runs, synchronously, on a host copy."""
    return tensor.device.type not in ("cpu", "cuda")


class Collectives:
    """Shard collectives over one :class:`World` (every call is collective)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.bytes_sent = 0  # payload bytes this rank put into collectives (a statistic)
        self.seconds = 0.0  # time this rank spent in collectives and waiting for them

    def _group(self, tensor: torch.Tensor) -> Any:
        """The group for ``tensor``: the world's own for device tensors, its gloo twin
        for host memory."""
        return self.world.host_group if tensor.device.type == "cpu" else self.world.group

    @contextmanager
    def _failing_as(self, what: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        except DistributedError:
            raise
        except (RuntimeError, ValueError) as exc:
            raise DistributedError(failure_message(self.world, what, exc)) from exc
        finally:
            self.seconds += time.perf_counter() - started

    def all_gather_in_place(self, full: torch.Tensor, what: str) -> None:
        """Fill ``full`` (flat, ``size`` equal shards) from every rank's own shard,
        which each rank has already written at its place in ``full``."""
        self.start_all_gather(full, what).wait()

    def start_all_gather(self, full: torch.Tensor, what: str) -> InFlight:
        """:meth:`all_gather_in_place`, started: ``full`` is complete once the
        returned handle is done (and must not be read or reused before)."""
        world = self.world
        shard = full.numel() // world.size
        target = full.cpu() if _staged(full) else full
        own = target[world.rank * shard : (world.rank + 1) * shard]
        with self._failing_as(what):
            work = _all_gather_flat(target, own, group=self._group(target), async_op=True)
        self.bytes_sent += own.numel() * own.element_size()
        if target is not full:
            InFlight(work, self, what).wait()
            full.copy_(target)
            work = _Finished()
        return InFlight(work, self, what)

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor, what: str) -> None:
        """``out`` = this rank's shard of the mean of ``full`` over the ranks."""
        self.start_reduce_scatter(out, full, what).wait()
        out.div_(self.world.size)

    def start_reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, what: str) -> InFlight:
        """``out`` = this rank's shard of the *sum* of ``full`` over the ranks, started
        (``full`` must stay unchanged until the returned handle is done)."""
        staged = _staged(full) or _staged(out)
        target = torch.empty_like(out, device="cpu") if staged else out
        source = full.cpu() if staged else full
        with self._failing_as(what):
            work = _reduce_scatter_flat(target, source, group=self._group(source), async_op=True)
        self.bytes_sent += full.numel() * full.element_size()
        if staged:
            InFlight(work, self, what).wait()
            out.copy_(target)
            work = _Finished()
        return InFlight(work, self, what)

    def broadcast(self, tensor: torch.Tensor, what: str, src: int = 0) -> None:
        """Every rank gets rank ``src``'s ``tensor`` (``src`` is a rank of the group)."""
        target = tensor.cpu() if _staged(tensor) else tensor
        root = dist.get_global_rank(self._group(target), src)
        with self._failing_as(what):
            dist.broadcast(target, root, group=self._group(target))
        if target is not tensor:
            tensor.copy_(target)

    def any(self, flag: bool, what: str) -> bool:
        """True on every rank if ``flag`` is true on any."""
        value = torch.tensor([int(flag)], dtype=torch.int32)
        with self._failing_as(what):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.world.host_group)
        return bool(value.item())

    def any_each(self, flags: list[bool], what: str) -> list[bool]:
        """Per position, True on every rank if it is true on any (one collective)."""
        if not flags:
            return []
        values = torch.tensor(flags, dtype=torch.int32)
        with self._failing_as(what):
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.world.host_group)
        return [bool(v) for v in values.tolist()]

    def sum(self, value: float, what: str) -> float:
        """The sum of ``value`` over the ranks (fp64)."""
        total = torch.tensor([value], dtype=torch.float64)
        with self._failing_as(what):
            dist.all_reduce(total, group=self.world.host_group)
        return float(total.item())

    def barrier(self, what: str) -> None:
        """Wait until every rank reaches this point."""
        with self._failing_as(what):
            dist.barrier(group=self.world.host_group)

    def gather_object(self, value: object, what: str) -> list[object]:
        """Every rank's picklable ``value``, in rank order (on every rank)."""
        values: list[object] = [None] * self.world.size
        with self._failing_as(what):
            dist.all_gather_object(values, value, group=self.world.host_group)
        return values
