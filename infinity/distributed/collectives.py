"""The collectives the engine runs on chunk shards, with errors that name the rank.

Every collective is called at a point every rank reaches in the same order
(a module's forward or backward, a gradient chunk completing, the step, a state
read): never from an I/O completion or a cache decision, which differ between
ranks. A peer that died or raised makes the call fail (gloo: the connection
closes; otherwise the group's timeout): the error says which rank saw it, during
what, and that the first error is in another rank's output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from infinity.distributed.world import World


class DistributedError(RuntimeError):
    """A collective failed: a peer rank stopped, raised or timed out."""


class Collectives:
    """Shard collectives over one :class:`World` (every call is collective)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.bytes_sent = 0  # payload bytes this rank put into collectives (a statistic)

    @contextmanager
    def _failing_as(self, what: str) -> Iterator[None]:
        try:
            yield
        except DistributedError:
            raise
        except (RuntimeError, ValueError) as exc:
            raise DistributedError(
                f"rank {self.world.rank} of {self.world.size}: {what} failed: {exc}. Another "
                "rank has probably stopped or raised: its error comes first in its output"
            ) from exc

    def all_gather_in_place(self, full: torch.Tensor, what: str) -> None:
        """Fill ``full`` (flat, ``size`` equal shards) from every rank's own shard,
        which each rank has already written at its place in ``full``."""
        world = self.world
        shard = full.numel() // world.size
        own = full[world.rank * shard : (world.rank + 1) * shard]
        with self._failing_as(what):
            dist.all_gather_single(full, own, group=world.group)
        self.bytes_sent += own.numel() * own.element_size()

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor, what: str) -> None:
        """``out`` = this rank's shard of the mean of ``full`` over the ranks."""
        with self._failing_as(what):
            dist.reduce_scatter_single(out, full, group=self.world.group)
        out.div_(self.world.size)
        self.bytes_sent += full.numel() * full.element_size()

    def broadcast(self, tensor: torch.Tensor, what: str, src: int = 0) -> None:
        """Every rank gets rank ``src``'s ``tensor`` (``src`` is a rank of the group)."""
        root = dist.get_global_rank(self.world.group, src)
        with self._failing_as(what):
            dist.broadcast(tensor, root, group=self.world.group)

    def any(self, flag: bool, what: str) -> bool:
        """True on every rank if ``flag`` is true on any."""
        value = torch.tensor([int(flag)], dtype=torch.int32)
        with self._failing_as(what):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.world.group)
        return bool(value.item())

    def sum(self, value: float, what: str) -> float:
        """The sum of ``value`` over the ranks (fp64)."""
        total = torch.tensor([value], dtype=torch.float64)
        with self._failing_as(what):
            dist.all_reduce(total, group=self.world.group)
        return float(total.item())

    def barrier(self, what: str) -> None:
        """Wait until every rank reaches this point."""
        with self._failing_as(what):
            dist.barrier(group=self.world.group)

    def gather_object(self, value: object, what: str) -> list[object]:
        """Every rank's picklable ``value``, in rank order (on every rank)."""
        values: list[object] = [None] * self.world.size
        with self._failing_as(what):
            dist.all_gather_object(values, value, group=self.world.group)
        return values

    def check_same(self, name: str, value: str, describe: Callable[[str], str] = str) -> None:
        """Raise on every rank unless ``value`` is the same on all (compared by rank 0's).

        ``describe`` turns a value into what the message shows.
        """
        values: list[str | None] = [None] * self.world.size
        with self._failing_as(f"comparing {name} across ranks"):
            dist.all_gather_object(values, value, group=self.world.group)
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise DistributedError(
                f"{name} differs across ranks: rank 0 has {describe(str(values[0]))}, rank "
                f"{differ[0]} has {describe(str(values[differ[0]]))}. Every rank must offload "
                "the same model with the same Config"
            )
