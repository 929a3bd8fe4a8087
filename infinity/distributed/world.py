"""Which processes a model's chunks are sharded over.

The engine never creates a process group: the user (or ``torchrun`` and
``infinity train --nproc``) does, and :func:`resolve_world` only reads it. A
world of one process is the single-process engine, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
