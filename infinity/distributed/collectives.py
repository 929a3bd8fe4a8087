"""Who the ranks are, the collectives the engine runs on chunk shards, and what a
failed collective means, in words a user can act on.

Which processes a model's chunks are sharded over (:class:`World`): the engine
never creates a process group: the user (or ``torchrun`` and ``infinity train
--nproc``) does, and :func:`resolve_world` only reads it. A world of one process
is the single-process engine, unchanged.

Every collective is called at a point every rank reaches in the same order
(a module's forward or backward, a gradient chunk completing, the step, a state
read): never from an I/O completion or a cache decision, which differ between
ranks. A peer that died or raised makes the call fail (gloo: the connection
closes; otherwise the group's timeout): the error says which rank saw it, during
what, and that the first error is in another rank's output.

Measured with gloo on one machine (``tests/distributed/test_faults.py``): a peer
that exits or crashes, before or during a collective, closes its connections and
the waiting rank's call fails within milliseconds ("Connection reset by peer" /
"Connection closed by peer"); a peer that is alive but never joins the call is
only noticed at the process group's timeout ("Timed out waiting ...").
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` processes of ``group`` (``None``: alone)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    # The same ranks over gloo, for tensors in host memory (agreements, whole
    # chunks read by tensor): ``group`` itself when it is gloo; NCCL takes only
    # GPU tensors.
    host_group: Any = None

    @property
    def sharded(self) -> bool:
        """More than one process: every chunk is split into ``size`` shards."""
        return self.size > 1


SINGLE = World()


def resolve_world(process_group: Any = None) -> World:
    """The world of ``process_group``, or of the default group if one is initialised.

    Raises:
        ValueError: ``process_group`` was given but ``torch.distributed`` is not
            initialised (the group cannot be real).
    """
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return SINGLE
        group = dist.group.WORLD
    else:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "Config(process_group=...) was given but torch.distributed is not "
                "initialised: call torch.distributed.init_process_group() first (torchrun "
                "sets up the environment for it)"
            )
        group = process_group
    size = dist.get_world_size(group)
    if size == 1:
        return SINGLE
    host_group = group
    if dist.get_backend(group) != "gloo":
        # NOTE: collective (every rank of the group creates it, in the same order).
        host_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
    return World(rank=dist.get_rank(group), size=size, group=group, host_group=host_group)


_CLOSED = ("connection reset", "connection closed", "broken pipe", "connection refused")
_TIMED_OUT = ("timed out", "timeout")
# gloo prefixes its source location and appends the same advice to every error.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
_BOILERPLATE = " This is typically caused by"


def failure_message(world: World, what: str, exc: BaseException) -> str:
    """``rank r of n: <what> failed: <why, and what to look at>. (<backend's words>)``."""
    text = str(exc)
    lowered = text.lower()
    peer = f"rank {1 - world.rank}" if world.size == 2 else "a peer rank"
    if any(word in lowered for word in _CLOSED):
        cause = (
            f"the connection to {peer} closed: that process exited or crashed (its own "
            "error, if it had one, is in its output)"
        )
    elif any(word in lowered for word in _TIMED_OUT):
        cause = (
            f"{peer} did not join within the process group's timeout: it is hung, much "
            "slower, or stopped before this point (raise the timeout with "
            "init_process_group(timeout=...) or `infinity train --dist-timeout`)"
        )
    else:
        cause = "another rank has probably stopped or raised: its error comes first in its output"
    detail = _SOURCE_PREFIX.sub("", text.split(_BOILERPLATE)[0].strip()).splitlines()
    said = f" (torch.distributed: {detail[0]})" if detail else ""
    return f"rank {world.rank} of {world.size}: {what} failed: {cause}{said}"


# torch 2.13 names the flat collectives all_gather_single and
# reduce_scatter_single; older releases (2.4 onwards, which we support: the
# CUDA builds users have) only have the *_tensor names, with the same
# positional arguments and the same work handles.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DistributedError(RuntimeError):
    """A collective failed: a peer rank stopped, raised or timed out."""


# The calls into a sharded model that run collectives, which every rank must make
# together, in the same order (Collectives.align); the index is what ranks exchange.
ENTRIES = (
    "a training forward",
    "a forward without gradients",
    "backward",
    "optimizer.step()",
    "reading parameter values (state_dict)",
    "writing parameter values (load_state_dict)",
    "reading gradients (infinity.gradients)",
    "reading gradient norms (clip_grad_norm_)",
    "save_checkpoint",
    "load_checkpoint",
    "save_pretrained",
)


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
        self.entries = 0  # calls into the model this rank made (align)

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

    def align(self, entry: str) -> None:
        """Collective, at the start of each call of :data:`ENTRIES`: raise on every rank
        unless every rank is making the same call.

        NOTE: a rank that alone evaluates, generates, reads ``state_dict()`` or loads
        one (the habit of DDP code: ``if rank == 0: ...``) pairs its gathers with
        whatever the others run next: gloo aborted the process ("collective
        mismatch"), NCCL hangs, and same-sized collectives of another kind (a gather
        against a reduce-scatter) could exchange wrong bytes silently. One small
        exchange on the host group at each entry makes the first diverging call an
        error on every rank, naming what each was doing.
        """
        if not self.world.sharded:
            return
        self.entries += 1
        mine = torch.tensor([ENTRIES.index(entry), self.entries], dtype=torch.int64)
        everyone = torch.empty(2 * self.world.size, dtype=torch.int64)
        with self._failing_as(f"starting {entry}"):
            _all_gather_flat(everyone, mine, group=self.world.host_group)
        codes, counts = everyone.view(-1, 2).t().tolist()
        if len(set(codes)) == 1:
            return
        doing = "; ".join(
            f"rank {rank} is starting {ENTRIES[code]} (its call {count} into the model)"
            for rank, (code, count) in enumerate(zip(codes, counts, strict=True))
        )
        raise DistributedError(
            f"rank {self.world.rank} of {self.world.size}: the ranks diverged: {doing}. "
            "Under data parallel every rank must make every call into the offloaded model, "
            "in the same order: each forward (evaluations and generation too: "
            "generate(..., synced_gpus=True)), backward, clip_grad_norm_, optimizer.step(), "
            "state_dict(), "
            "load_state_dict() and checkpoint saves and loads gather or reduce the sharded "
            "chunks over all ranks. Evaluate and save on every rank (each on its share of "
            "the batches); let rank 0 alone only print or write what they computed"
        )

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
