"""Resolve ``Config`` budgets (``"auto"`` included) and choose the chunk layout and plan."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Callable, Sequence

import psutil
import torch

from infinity.chunks.chunk_size import (
    MIN_AUTO_CHUNK_BYTES,
    chunk_cap,
    search_chunk_size,
)
from infinity.chunks.layout import ChunkLayout, TensorInfo, build_layout, chunk_alignment_elems
from infinity.config import AUTO, Config
from infinity.distributed import SINGLE, World
from infinity.io.filesystems import nearest_existing
from infinity.optim.chunk_optimizer import ADAM, ChunkOptimizer
from infinity.runtime.params import ParamRegistry
from infinity.schedule.planner import Budgets, Plan, PlanError, make_plan
from infinity.utils.sizes import align_up, format_size

MAX_AUTO_CHUNK_BYTES = 256 << 20
# NOTE: activations="offload" or "auto" with an NVMe tier keep this share of host_memory
# for saved activations (their host share and the windows that move them to NVMe and
# back): the states plan within the rest, so saved tensors never take host memory
# beyond the budget (issue 41).
ACTIVATION_HOST_SHARE = 1 / 8
MIN_SEARCH_CHUNK_BYTES = 64 << 10
DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_budgets(config: Config, device: torch.device, local_ranks: int = 1) -> Budgets:
    """Budgets in bytes, with ``"auto"`` replaced by what this machine offers.

    ``local_ranks`` processes of one model share this machine: an ``"auto"``
    share of RAM or disk is divided among them (a GPU is each rank's own).
    """
    available = psutil.virtual_memory().available // local_ranks
    host = available // 2 if config.host_memory == AUTO else int(config.host_memory)
    if config.device_memory != AUTO:
        dev = int(config.device_memory)
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        dev = int(free * 0.8)
    else:
        dev = available // 4
    nvme: int | None = None
    if config.nvme_path is not None:
        nvme = (
            nvme_capacity(config.nvme_path) // local_ranks
            if config.nvme_memory == AUTO
            else int(config.nvme_memory)
        )
    moved = config.activations in ("offload", "auto") and nvme is not None
    return Budgets(
        device=dev, host=host, nvme=nvme, activations=ACTIVATION_HOST_SHARE if moved else 0.0
    )


def local_ranks(world: World) -> int:
    """Ranks of ``world`` on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else all of
    them (processes started some other way, e.g. ``torch.multiprocessing``, are
    taken to share one machine: the safe guess for ``"auto"`` budgets)."""
    if not world.sharded:
        return 1
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else world.size


def nvme_capacity(path: str) -> int:
    """90% of the free space of the filesystem holding ``path`` (or its nearest parent)."""
    return int(shutil.disk_usage(nearest_existing(path)).free * 0.9)


def choose_plan(
    tensors: Sequence[TensorInfo],
    working_sets_of: Callable[[ChunkLayout], Sequence[frozenset[int]]],
    *,
    config: Config,
    budgets: Budgets,
    optimizer: ChunkOptimizer = ADAM,
    shard_count: int = 1,
    shard_rank: int = 0,
) -> Plan:
    """Layout plus plan; with ``chunk_size="auto"`` try smaller chunks until the budgets fit.

    ``working_sets_of(layout)`` returns the chunk sets modules hold at once.
    Sharded over ``shard_count`` processes, every capacity is a multiple of
    ``shard_count`` shard granules (a chunk size is rounded up to one).
    """
    dtype = DTYPE_OF[config.dtype]
    element_size = torch.finfo(dtype).bits // 8
    has_master = config.dtype != "fp32"

    align = optimizer.state_format.element_alignment
    granule = optimizer.span_granule
    unit = 1
    if shard_count > 1:
        # NOTE: a shard's every part (parameters, gradients, the fp32 master, each
        # moment's values and int8 scales) must start and end on the I/O
        # alignment, exactly like a span's: one shard is a multiple of the span
        # granule and of the compute dtype's chunk granule.
        unit = shard_count * math.lcm(granule, chunk_alignment_elems(element_size))
        granule = unit

    def attempt(elems: int) -> Plan:
        layout = build_layout(
            tensors, elems, element_size, tensor_align=align, oversize_align=granule
        )
        return make_plan(
            layout,
            element_size=element_size,
            has_master=has_master,
            budgets=budgets,
            working_sets=working_sets_of(layout),
            prefetch_depth=config.prefetch_depth,
            consume_grads=config.overlap_optimizer is True,
            optimizer=optimizer,
            shard_count=shard_count,
            shard_rank=shard_rank,
        )

    if config.chunk_size != AUTO:
        asked = int(config.chunk_size) // element_size
        elems = align_up(asked, unit)
        try:
            return attempt(elems)
        except PlanError as exc:
            if elems <= asked:
                raise
            raise _shard_rounding_error(exc, elems * element_size, shard_count, config) from None
    # NOTE: a quarter of the device bounds even a raised cap, and a plan that
    # does not fit retries with smaller chunks.
    cap = chunk_cap(tensors, element_size, MAX_AUTO_CHUNK_BYTES)
    max_bytes = max(MIN_SEARCH_CHUNK_BYTES, min(cap, budgets.device // 4))
    # NOTE: the last try is always at the smallest cap, whatever the budget: the
    # bytes its error names are then what the same search fits at that budget
    # (halving from budget/4 ended on a cap that moved with the budget, so
    # raising it to the bytes named could end on a larger chunk needing more).
    caps = []
    while max_bytes > MIN_SEARCH_CHUNK_BYTES:
        caps.append(max_bytes)
        max_bytes //= 2
    caps.append(MIN_SEARCH_CHUNK_BYTES)
    last_error: PlanError | None = None
    for cap_bytes in caps:
        elems = search_chunk_size(
            tensors,
            element_size,
            max_bytes=cap_bytes,
            min_bytes=min(MIN_AUTO_CHUNK_BYTES, cap_bytes),
        )
        elems = align_up(elems, unit)
        try:
            return attempt(elems)
        except PlanError as exc:
            last_error = exc
    assert last_error is not None
    if unit * element_size > MIN_SEARCH_CHUNK_BYTES:
        raise _shard_rounding_error(last_error, unit * element_size, shard_count, config) from None
    # NOTE: the planner already tried every smaller chunk: "use a smaller
    # chunk_size" would send the user after what was done for them.
    raise PlanError(
        _without_smaller_chunk_advice(last_error)
        + f" (chunk_size='auto' tried chunks down to {MIN_SEARCH_CHUNK_BYTES >> 10} KiB)",
        needed=last_error.needed,
    ) from None


def _without_smaller_chunk_advice(exc: PlanError) -> str:
    """``exc``'s message without its "use a smaller chunk_size" advice (for plans where
    a smaller chunk was tried already, or cannot exist)."""
    return (
        str(exc)
        .replace(", or use a smaller chunk_size", "")
        .replace(" or use a smaller chunk_size", "")
    )


def _shard_rounding_error(
    exc: PlanError, chunk_bytes: int, shard_count: int, config: Config
) -> PlanError:
    """``exc`` for a sharded plan whose chunks were rounded up to whole shard granules:
    "a smaller chunk_size" cannot help there, so the message says what sets the size."""
    return PlanError(
        f"{_without_smaller_chunk_advice(exc)} (sharded over {shard_count} processes with "
        f"optimizer_state_dtype="
        f"{config.optimizer_state_dtype!r}, every chunk holds a whole aligned shard per process, "
        f"so chunks are at least {format_size(chunk_bytes)} of parameters: a smaller "
        "chunk_size cannot go below that; raise the budget, or use fewer processes or "
        "another optimizer_state_dtype)",
        needed=exc.needed,
    )


def plan_for(
    registry: ParamRegistry,
    config: Config,
    device: torch.device,
    optimizer: ChunkOptimizer = ADAM,
    world: World = SINGLE,
    budgets: Budgets | None = None,
) -> Plan:
    """The plan for a model's parameter registry under ``config`` (nothing is allocated);
    the optimizer's state slots are stored as ``config.optimizer_state_dtype``; homes
    hold ``world.rank``'s shard of every chunk. ``budgets``: resolved already (a plan
    made again for the same model keeps the ones its first plan resolved: free
    memory and disk have changed since, not the model's budgets)."""
    plan = choose_plan(
        registry.tensor_infos(),
        registry.working_sets,
        config=config,
        budgets=budgets or resolve_budgets(config, device, local_ranks(world)),
        optimizer=optimizer.with_state_dtype(config.optimizer_state_dtype),
        shard_count=world.size,
        shard_rank=world.rank,
    )
    return dataclasses.replace(plan, recomputes_blocks=bool(registry.recomputed))
