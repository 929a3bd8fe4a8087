"""Data parallelism over ``torch.distributed``: who the ranks are and the collectives
the chunk manager runs on chunk shards (see ``docs/design/data-parallel.md``, "Sharding")."""

from infinity.distributed.collectives import (
    SINGLE,
    Collectives,
    DistributedError,
    World,
    resolve_world,
)

__all__ = ["SINGLE", "Collectives", "DistributedError", "World", "resolve_world"]
