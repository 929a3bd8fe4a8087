"""Sharded chunks (data parallel): whole chunks built from every rank's shard.

With ``Plan.shard_count`` ranks, each rank's homes and staging hold one equal
shard of every chunk (elements ``Plan.home_window``); the device holds whole
chunks. This module maps shards to whole chunks in host memory (the device
side, gathering parameter chunks into their slots, is ``chunks/gathers.py``):
state reads and writes by tensor (``state_dict``, checkpoints, gradients,
norms) open a *whole* host copy of a chunk (:func:`open_whole`): gathered for
reading, and written back by each rank taking its own shard out of it.

An optimizer unit's shard is laid out like the unit of a chunk of the shard's
size (master, then each state slot's values and int8 scales): exactly a span
of the whole unit (``chunks/spans.py``), whose byte ranges say where each
piece goes.

NOTE: a gather is collective: all ranks call it for the same chunks in the
same order (state reads), never because of a cache decision or an I/O
completion, which differ between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from infinity.chunks.accounting import TierAccount
from infinity.chunks.cache import Copy
from infinity.chunks.spans import SpanKey, part_ranges
from infinity.core.names import Key, Kind
from infinity.core.plan import Plan
from infinity.distributed import Collectives


def shard_ranges(plan: Plan, key: Key, rank: int) -> list[tuple[int, int]]:
    """(byte offset in the whole chunk of ``key``, bytes) of each piece of ``rank``'s shard,
    in the order the shard's home lays them out."""
    kind, chunk = key[0], key[1]
    size = plan.home_elems(chunk)
    return part_ranges(plan, SpanKey(kind, chunk, rank * size, (rank + 1) * size))


def whole_bytes(plan: Plan, key: Key) -> int:
    """Bytes of ``key``'s whole chunk (every rank's shard)."""
    if key[0] is Kind.OPTIM:
        return plan.optim_bytes(key[1]) * plan.shard_count
    return plan.device_param_bytes(key[1])


def gather_whole(
    plan: Plan, collectives: Collectives, key: Key, shard: torch.Tensor, out: torch.Tensor
) -> None:
    """``out`` (uint8, :func:`whole_bytes`) = the whole chunk of ``key`` from every rank's
    ``shard`` (uint8, this rank's home bytes)."""
    count, nbytes = plan.shard_count, shard.numel()
    what = f"gathering {key[0].value} chunk {key[1]}"
    if key[0] is not Kind.OPTIM:
        out[plan.shard_rank * nbytes : (plan.shard_rank + 1) * nbytes].copy_(shard)
        collectives.all_gather_in_place(out, what)
        return
    # NOTE: the shards of a unit arrive rank after rank; each is then cut into
    # its pieces (master, slot values, scales), which go to their parts' places.
    gathered = torch.empty(count * nbytes, dtype=torch.uint8)
    gathered[plan.shard_rank * nbytes : (plan.shard_rank + 1) * nbytes].copy_(shard)
    collectives.all_gather_in_place(gathered, what)
    for rank in range(count):
        at = rank * nbytes
        for offset, size in shard_ranges(plan, key, rank):
            out[offset : offset + size].copy_(gathered[at : at + size])
            at += size


def take_shard(plan: Plan, key: Key, whole: torch.Tensor, shard: torch.Tensor) -> None:
    """``shard`` (this rank's home bytes of ``key``) = its part of ``whole``."""
    at = 0
    for offset, size in shard_ranges(plan, key, plan.shard_rank):
        shard[at : at + size].copy_(whole[offset : offset + size])
        at += size


def place_shard(plan: Plan, key: Key, shard: torch.Tensor, whole: torch.Tensor) -> None:
    """This rank's part of ``whole`` = ``shard`` (the inverse of :func:`take_shard`)."""
    at = 0
    for offset, size in shard_ranges(plan, key, plan.shard_rank):
        whole[offset : offset + size].copy_(shard[at : at + size])
        at += size


@dataclass
class WholeChunk:
    """A whole host copy of a chunk opened by :func:`open_whole` (sharded plans)."""

    key: Key
    region: torch.Tensor  # this rank's home bytes (a host home or staging copy)
    copy: Copy | None  # the staging copy behind ``region``, if any
    whole: torch.Tensor  # the chunk's bytes, every shard


def device_shard(plan: Plan, chunk: int, slot: torch.Tensor) -> torch.Tensor:
    """This rank's shard inside a whole device parameter or gradient slot (uint8)."""
    nbytes = plan.param_bytes(chunk)
    return slot[plan.shard_rank * nbytes : (plan.shard_rank + 1) * nbytes]


class HostAccess(Protocol):
    """What :func:`open_whole` uses of the chunk manager."""

    plan: Plan
    collectives: Collectives | None
    transient_account: TierAccount

    def open_host(
        self, key: Key, *, load: bool = True, writable: bool = True
    ) -> tuple[torch.Tensor, Copy | None]: ...

    def close_host(self, copy: Copy | None, *, modified: bool, keep: bool = False) -> None: ...


def open_whole(
    manager: HostAccess,
    key: Key,
    *,
    load: bool = True,
    writable: bool = True,
    gather: bool = True,
) -> tuple[torch.Tensor, WholeChunk | Copy | None]:
    """``manager.open_host`` of the whole chunk (every rank's shard): collective when
    sharded, where ``load`` gathers it; pair with :func:`close_whole`.

    ``gather=False`` (not collective) loads only this rank's part of the whole
    chunk, the rest being zeros: enough for writes every rank makes alike, of
    which each keeps only its own shard (loading state it was given whole).
    """
    region, copy = manager.open_host(key, load=load, writable=writable)
    plan = manager.plan
    if not plan.sharded:
        return region, copy
    assert manager.collectives is not None
    whole = torch.zeros(whole_bytes(plan, key), dtype=torch.uint8)
    account = manager.transient_account
    account.add(whole.nbytes)
    if load and gather:
        # NOTE: a unit's shards arrive in a buffer of their own (gather_whole), as large
        gathered = whole.nbytes if key[0] is Kind.OPTIM else 0
        account.add(gathered)
        try:
            gather_whole(plan, manager.collectives, key, region, whole)
        finally:
            account.sub(gathered)
    elif load:
        place_shard(plan, key, region, whole)
    return whole, WholeChunk(key, region, copy, whole)


def close_whole(
    manager: HostAccess, handle: WholeChunk | Copy | None, *, modified: bool, keep: bool = False
) -> None:
    """Finish with :func:`open_whole` (``keep`` as ``close_host``); if ``modified`` each
    rank stores its own shard of the whole chunk (every rank must have written the
    same whole values)."""
    if not isinstance(handle, WholeChunk):
        manager.close_host(handle, modified=modified, keep=keep)
        return
    manager.transient_account.sub(handle.whole.nbytes)
    if modified:
        take_shard(manager.plan, handle.key, handle.whole, handle.region)
    manager.close_host(handle.copy, modified=modified, keep=keep)
