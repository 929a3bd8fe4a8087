"""The device tier's slots: how many of each chunk size the plan reserves.

Part of the planner (``schedule/planner.py``): the minimum a module's working
set needs, then the spare device room spread over every chunk size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from infinity.chunks.layout import ChunkLayout


class HeldBlock(frozenset[int]):
    """The chunks of a block recomputed in backward: all held at once, for as long
    as its backward runs, while its own gradients arrive (a working set that
    :func:`min_device_slots` gives a receiving slot in each chunk size)."""


def _classes(sizes: Iterable[int]) -> Counter[int]:
    return Counter(sizes)


def min_device_slots(
    layout: ChunkLayout,
    element_size: int,
    working_sets: Sequence[frozenset[int]],
    grad_slots: int = 1,
) -> dict[int, int]:
    """Device slots each size class needs: the largest set of chunks one module
    holds at once (its own and its ancestors' parameters), plus ``grad_slots``
    slots of the largest trainable size to receive gradients (a chunk fits any
    larger slot); a :class:`HeldBlock` also gets ``grad_slots`` receiving slots in
    each size it receives gradients in.

    Sharded, a gradient chunk stays on the device until it is complete
    (``GradientFlow``): a tied embedding's receives gradients the whole
    backward, beside the chunk being filled, hence two slots there."""
    need: Counter[int] = Counter()
    receiving: Counter[int] = Counter()
    for chunk_set in working_sets:
        per_class = _classes(layout.chunks[i].capacity * element_size for i in chunk_set)
        for size, count in per_class.items():
            need[size] = max(need[size], count)
        if not isinstance(chunk_set, HeldBlock):
            continue
        # NOTE: a held block's own gradients arrive while all of it is held, into a
        # slot of their size if one is free, else into a larger one, which a
        # parameter chunk of that size then lacks (PoolExhausted): each size the
        # block receives gradients in gets its own receiving slot.
        trainable = {
            layout.chunks[i].capacity * element_size
            for i in chunk_set
            if layout.chunks[i].trainable
        }
        for size in trainable:
            receiving[size] = max(receiving[size], per_class[size] + grad_slots)
    trainable_sizes = [c.capacity * element_size for c in layout.chunks if c.trainable]
    if trainable_sizes:
        need[max(trainable_sizes)] += grad_slots
    for size, count in receiving.items():
        need[size] = max(need[size], count)
    if not need and layout.chunks:
        need[layout.chunks[0].capacity * element_size] = 1
    return dict(need)


def add_device_slots(
    device: dict[int, int], chunk_bytes: Sequence[int], trainable: Sequence[bool], room: int
) -> dict[int, int]:
    """Spend ``room`` spare device bytes on more slots, for every chunk size alike.

    Each size gets slots for the same fraction of the copies its chunks can
    have on the device (a parameter copy each, plus a gradient copy if
    trainable; more would sit idle); bytes left over buy the largest slots
    still useful.

    NOTE: a chunk fits only a slot at least its size. Extra slots of the
    normal size alone left every oversize chunk (a large embedding, or every
    matrix of a model whose tensors exceed the chunk-size cap) to be fetched
    twice per step, however large the budget: a 70B GPT used 3.2 GiB of an
    80 GiB device.
    """
    out = Counter(device)
    wanted: Counter[int] = Counter()
    for size, grads in zip(chunk_bytes, trainable, strict=True):
        wanted[size] += 2 if grads else 1
    for size in wanted:
        wanted[size] = max(0, wanted[size] - out[size])
    total = sum(size * count for size, count in wanted.items())
    if total == 0 or room <= 0:
        return dict(out)
    share = min(1.0, room / total)
    for size in sorted(wanted, reverse=True):
        count = int(wanted[size] * share)
        out[size] += count
        wanted[size] -= count
        room -= count * size
    for size in sorted(wanted, reverse=True):
        count = min(wanted[size], room // size)
        out[size] += count
        room -= count * size
    return dict(out)
