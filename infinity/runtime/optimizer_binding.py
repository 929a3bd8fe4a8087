"""Which optimizer a model's optimizer units are laid out for: the one constructed over it.

NOTE [the layout is decided once, late]: ``offload()`` only checks the budgets
with Adam's plan; the homes are planned and allocated for the first optimizer
constructed over the model (:func:`first_plan`), or for Adam at the first
forward or read of the chunks. An optimizer constructed after that has its
units cut inside the homes (:func:`recut`: the fp32 master first, as in every
layout, so masters written at offload stay valid); where they do not fit the
error says to construct it first. Once any tensor holds optimizer state (a
step, a loaded checkpoint or state dict), the layout is fixed: another
optimizer is refused, naming both.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from infinity.chunks.spans import is_split
from infinity.config import Config, ConfigError
from infinity.core.plan import Plan, PlanError
from infinity.distributed import World
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.runtime.budgets import plan_for
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.params import ParamRegistry
from infinity.runtime.update_queue import UpdateQueue
from infinity.schedule.units import units_for
from infinity.utils.sizes import format_size

log = logging.getLogger("infinity")


def stored_as(chunk_optimizer: ChunkOptimizer[Any], config: Config) -> ChunkOptimizer[Any]:
    """``chunk_optimizer`` storing its state as ``config.optimizer_state_dtype``; a
    :class:`~infinity.config.ConfigError` if it cannot."""
    try:
        return chunk_optimizer.with_state_dtype(config.optimizer_state_dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def first_plan(
    registry: ParamRegistry,
    config: Config,
    device: torch.device,
    world: World,
    offload_plan: Plan,
    offload_optimizer: ChunkOptimizer[Any],
    wanted: ChunkOptimizer[Any],
) -> Plan | None:
    """The homes planned for ``wanted`` with the budgets ``offload_plan`` resolved
    (``offload_plan`` itself where it was made for the same units); ``None``, with
    a warning, where no plan for ``wanted`` fits them (its units are then cut inside
    the offload plan's homes)."""
    if same_layout(wanted, offload_optimizer):
        return offload_plan
    try:
        return plan_for(registry, config, device, wanted, world=world, budgets=offload_plan.budgets)
    except PlanError as exc:
        log.warning(
            "infinity: no plan for %s fits the budgets (%s); its units are cut inside the homes "
            "planned for Adam",
            wanted.front_end or wanted.name,
            exc,
        )
        return None


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
    chunks.tensor_states.clear()  # NOTE: no tensor has stepped: nothing is lost


def check_whole_tensors(plan: Plan, owner: str, *, overlap: bool) -> None:
    """Raise :class:`~infinity.config.ConfigError` where the whole tensors an optimizer
    reads in its step (``ChunkOptimizer.whole_tensors``) cannot be brought together.

    NOTE: an oversize chunk staged in spans holds one tensor, which the step
    gathers from its spans; a sharded chunk is gathered from every rank
    (``runtime/whole_tensor_step.py``). Each such update is then collective and
    runs where every rank runs it, see
    NOTE [collective updates run in a fixed order]: not during backward, where
    chunks complete at different moments on each rank, and not over a shard in spans.
    """
    if not plan.sharded:
        return
    if overlap:
        raise ConfigError(
            f"{owner} reads whole tensors in its step, which on a model sharded over "
            f"{plan.shard_count} processes gathers each chunk from every rank: that cannot "
            "run during backward. Use Config(overlap_optimizer=False) (the default), or "
            "CPUAdam, CPULion or CPUSGD with overlap_optimizer=True"
        )
    split = [i for i in range(plan.layout.num_chunks) if is_split(plan, i)]
    if split:
        raise ConfigError(
            f"{owner} reads whole tensors in its step, but chunk {split[0]} (of "
            f"{format_size(plan.param_bytes(split[0]))} per process) is staged in spans on a "
            f"model sharded over {plan.shard_count} processes: gathering it from every rank "
            "is not supported. Give Config(chunk_size=...) at least the largest tensor's "
            "share per process, or use CPUAdam, CPULion or CPUSGD"
        )
