"""Resolve ``Config`` budgets (``"auto"`` included) and choose the chunk layout and plan,
for the optimizer constructed over the model.

NOTE [the layout is decided once, late]: ``offload()`` only checks the budgets
with Adam's plan; the homes are planned and allocated for the first optimizer
constructed over the model (:func:`first_layout`), or for Adam at the first
forward or read of the chunks. An optimizer constructed after that has its
units cut inside the homes (:func:`recut`: the fp32 master first, as in every
layout, so masters written at offload stay valid); where they do not fit the
error says to construct it first. Once any tensor holds optimizer state (a
step, a loaded checkpoint or state dict), the layout is fixed: another
optimizer is refused, naming both.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch

from infinity.chunks.layout import (
    MIN_AUTO_CHUNK_BYTES,
    ChunkLayout,
    TensorInfo,
    build_layout,
    chunk_alignment_elems,
    chunk_cap,
    search_chunk_size,
)
from infinity.chunks.updates import check_whole_tensors
from infinity.config import AUTO, Config, ConfigError
from infinity.core.names import DEVICE
from infinity.core.plan import Plan, PlanError
from infinity.distributed import SINGLE, World
from infinity.io.directories import nearest_existing
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.optim.cpu_adam import ADAM
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.params import ParamRegistry
from infinity.runtime.update_queue import UpdateQueue
from infinity.schedule.planner import Budgets, make_plan
from infinity.schedule.units import units_for
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
    state_device: torch.device | None = None,
) -> Plan:
    """Layout plus plan; with ``chunk_size="auto"`` try smaller chunks until the budgets fit.
    ``state_device``: where the optimizer may step chunks homed there (``make_plan``).

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
        # A shard's every part (parameters, gradients, the fp32 master, each
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
            state_device=state_device,
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
    # A quarter of the device bounds even a raised cap, and a plan that
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
            # NOTE: without its traceback: kept, the error's frames (and the model in
            # offload's) would form a cycle that outlives the search until a collection.
            last_error = exc.with_traceback(None)
    assert last_error is not None
    if unit * element_size > MIN_SEARCH_CHUNK_BYTES:
        raise _shard_rounding_error(last_error, unit * element_size, shard_count, config) from None
    # The planner already tried every smaller chunk: "use a smaller
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
    *,
    device_homes: bool = True,
) -> Plan:
    """The plan for a model's parameter registry under ``config`` (nothing is allocated);
    the optimizer's state slots are stored as ``config.optimizer_state_dtype``; homes
    hold ``world.rank``'s shard of every chunk. ``budgets``: resolved already (a plan
    made again for the same model keeps the ones its first plan resolved: free
    memory and disk have changed since, not the model's budgets). ``device_homes``:
    chunks may be homed on ``device`` where the optimizer steps them there."""
    stored = optimizer.with_state_dtype(config.optimizer_state_dtype)
    budgets = budgets or resolve_budgets(config, device, local_ranks(world))
    # NOTE [chunks homed on the device]: only into room the user gave the chunks
    # (an explicit device_memory, or RAM on the CPU): "auto" on a GPU is a cap for the
    # cache, and the activations need what it leaves.
    homes_there = device_homes and stored.steps_on(device)
    homes_there = homes_there and (device.type == "cpu" or config.device_memory != AUTO)
    plan = choose_plan(
        registry.tensor_infos(),
        registry.working_sets,
        config=config,
        budgets=budgets,
        optimizer=stored,
        shard_count=world.size,
        shard_rank=world.rank,
        state_device=device if homes_there else None,
    )
    free = _free_on_gpu(device)
    if DEVICE in plan.optim_home and free is not None and plan.device_reserved_bytes > free:
        # A device_memory above what the GPU has free used to reserve only the slots it
        # needed; homes would take the rest and fail to allocate.
        log.warning(
            "infinity: device_memory=%s is more than %s has free (%s): no chunk is homed "
            "on it (NOTE [chunks homed on the device]); give at most the free bytes",
            format_size(budgets.device),
            device,
            format_size(free),
        )
        return plan_for(registry, config, device, optimizer, world, budgets, device_homes=False)
    return dataclasses.replace(plan, recomputes_blocks=bool(registry.recomputed))


def _free_on_gpu(device: torch.device) -> int | None:
    """Bytes ``device`` (a CUDA GPU) could allocate now; None elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    from infinity.devices.cuda import free_bytes  # NOTE: loads the native module

    return free_bytes(device)


log = logging.getLogger("infinity")


def stored_as(chunk_optimizer: ChunkOptimizer[Any], config: Config) -> ChunkOptimizer[Any]:
    """``chunk_optimizer`` storing its state as ``config.optimizer_state_dtype``; a
    :class:`~infinity.config.ConfigError` if it cannot."""
    try:
        return chunk_optimizer.with_state_dtype(config.optimizer_state_dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def first_layout(
    registry: ParamRegistry,
    config: Config,
    device: torch.device,
    world: World,
    offload: tuple[ChunkOptimizer[Any], Plan],
    chunk_optimizer: ChunkOptimizer[Any],
    owner: str,
) -> tuple[ChunkOptimizer[Any], Plan, str]:
    """The units and plan to lay a model out for, at the construction of its first
    optimizer ``owner`` (``chunk_optimizer``), and why (for messages): its own plan with
    the budgets of ``offload`` (the offload plan and its Adam), else (with a warning:
    no plan for it fits them) ``offload``'s, inside whose homes its units are cut.

    Raises :class:`~infinity.config.ConfigError` before anything is allocated where the
    optimizer cannot store its state as configured or cannot gather its whole tensors.
    """
    offload_units, offload_plan = offload
    wanted = stored_as(chunk_optimizer, config)
    plan: Plan | None = offload_plan
    if not same_layout(wanted, offload_units):
        try:
            plan = plan_for(
                registry, config, device, wanted, world=world, budgets=offload_plan.budgets
            )
        except PlanError as exc:
            log.warning(
                "infinity: no plan for %s fits the budgets (%s); its units are cut inside "
                "the homes planned for Adam",
                owner,
                exc,
            )
            plan = None
    if plan is None and DEVICE in offload_plan.optim_home and not wanted.steps_on(device):
        # Its units are cut inside Adam's homes, which it cannot step on the device: the
        # same homes without device homes (NOTE [chunks homed on the device]).
        offload_plan = plan_for(
            registry,
            config,
            device,
            offload_units,
            world=world,
            budgets=offload_plan.budgets,
            device_homes=False,
        )
    if wanted.whole_tensors:
        check_whole_tensors(plan or offload_plan, owner, overlap=config.overlap_optimizer is True)
    if plan is None:
        return offload_units, offload_plan, f"the construction of {owner}, whose plan did not fit"
    return wanted, plan, f"the construction of {owner}"


def same_layout(a: ChunkOptimizer[Any], b: ChunkOptimizer[Any]) -> bool:
    """Whether two chunk optimizers read and write units alike (same kind, by its
    name, and storage)."""
    return a.name == b.name and a.state_format == b.state_format


def wanted_layout(
    chunks: ModelChunks, chunk_optimizer: ChunkOptimizer[Any], owner: str, config: Config
) -> ChunkOptimizer[Any] | None:
    """``chunk_optimizer`` (of the optimizer class ``owner``) stored as
    ``config.optimizer_state_dtype``, if ``chunks``' units must change for it;
    ``None`` if they are laid out for it already.

    Raises :class:`~infinity.config.ConfigError` if the optimizer cannot store
    its state so, and ``ValueError`` naming both optimizers if the units already
    hold another optimizer's state. Nothing changes here.
    """
    wanted = stored_as(chunk_optimizer, config)
    current = chunks.chunk_optimizer
    if same_layout(wanted, current):
        return None
    stepped = sum(1 for steps in chunks.tensor_steps if steps)
    if stepped:
        raise ValueError(
            f"this model's optimizer state belongs to {current.front_end} (slots "
            f"{', '.join(current.state_slots) or 'none'}; {stepped} tensors hold state from "
            f"steps, a checkpoint or a state dict): {owner} (slots "
            f"{', '.join(wanted.state_slots) or 'none'}) "
            f"cannot take it over. Keep training with {current.front_end}, or start "
            f"{owner} from the weights alone: infinity.save_pretrained(model, dir), then a new "
            "infinity.offload(...) and infinity.load_pretrained(model, dir)"
        )
    if wanted.whole_tensors:
        check_whole_tensors(chunks.plan, owner, overlap=config.overlap_optimizer is True)
    device = chunks.manager.backend.device
    on_device = sum(home == DEVICE for home in chunks.plan.optim_home)
    if on_device and not wanted.steps_on(device):
        raise ValueError(
            f"{on_device} of this model's chunks are homed on {device} and stepped there "
            f"(planned for {current.front_end or current.name}), which {owner} cannot do "
            f"(NOTE [chunks homed on the device]): construct {owner} right after "
            "infinity.offload(), before the first forward, so the chunks are planned for it"
        )
    return wanted


def bind_optimizer(
    chunks: ModelChunks,
    home_plan: Plan,
    queue: UpdateQueue,
    chunk_optimizer: ChunkOptimizer[Any],
    owner: str,
    config: Config,
    laid_out_by: str,
) -> None:
    """Cut ``chunks``' units (homes of ``home_plan``, planned at ``laid_out_by``) for
    ``chunk_optimizer`` of the optimizer class ``owner``, where they are cut for
    another (with a warning, unless ``laid_out_by`` is "": planned just now, a
    warning said why not for it); raises as :func:`wanted_layout` and :func:`recut`
    do (nothing changed)."""
    wanted = wanted_layout(chunks, chunk_optimizer, owner, config)
    if wanted is None:
        return
    recut(chunks, home_plan, queue, wanted, config)
    home = chunks.home_optimizer
    if laid_out_by and not same_layout(wanted, home):
        advice = (
            f"construct {owner} right after infinity.offload(), before the first forward "
            "or any read of the model, to plan them for it"
        )
        log.warning(
            "infinity: the homes were planned for %s at %s; %s's units are cut inside them "
            "(its traffic, but the host and NVMe bytes reserved stay): %s",
            home.front_end or home.name,
            laid_out_by,
            owner,
            advice,
        )


def recut(
    chunks: ModelChunks,
    home_plan: Plan,
    queue: UpdateQueue,
    wanted: ChunkOptimizer[Any],
    config: Config,
) -> None:
    """Cut ``chunks``' optimizer units for ``wanted`` (from :func:`wanted_layout`) inside
    the homes of ``home_plan``.

    Raises ``ValueError`` naming the chunk if a unit does not fit its home;
    nothing changes then.
    """
    plan = units_for(
        home_plan,
        wanted,
        consume_grads=config.overlap_optimizer is True,
        planned_for=chunks.home_optimizer,
    )
    # NOTE: writes of the initial values (offload) may still be landing, and
    # staged copies of units are cut the old way: both are settled first.
    queue.settle()
    chunks.manager.recut_units(plan)
    chunks.plan = plan
    chunks.chunk_optimizer = wanted
    chunks.tensor_states.clear()  # no tensor has stepped: nothing is lost
