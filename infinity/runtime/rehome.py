"""Homes planned again for the optimizer constructed over an offloaded model.

``offload()`` plans and allocates every home for Adam's units
(NOTE [homes planned for the optimizer]). When the optimizer constructed over the model
keeps less state per parameter (Lion, SGD, Adafactor) and nothing holds
optimizer state yet, :func:`bind_optimizer` plans the homes again for it,
with the budgets the first plan resolved. Where the new plan keeps every home
(loose budgets), the units are only re-cut inside them
(``runtime/optimizer_binding.py``). Otherwise the model *re-homes*: a new
chunk manager (and swap file) is built for the new plan, every parameter's
values (the fp32 masters of a 16-bit run) are copied into it chunk by chunk
through the tensor-value access, and the engine's components are built again
on it (``OffloadEngine.assemble``); the old homes are released after.

Nothing is lost on any failure: the old homes are only read until the new
ones hold every value, and the engine switches to them in one step. Where the
new homes cannot be had (the NVMe budget or the disk cannot hold both swap
files during the move, the RAM both homes, an allocation fails) the old plan
is kept with one warning saying why, and the units are re-cut in it, as
before this module. With data parallel ranks every rank decides the same
(:meth:`~infinity.distributed.Collectives.any`: if one rank cannot re-home,
none does).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from contextlib import closing
from typing import Any, Protocol

import psutil
import torch

from infinity.activations.policy import ActivationPolicy
from infinity.activations.store import ActivationStore
from infinity.chunks.homes import Kind
from infinity.chunks.manager import ChunkManager
from infinity.chunks.states import TensorState
from infinity.chunks.tensor_views import tensor_values
from infinity.config import Config
from infinity.core.plan import Plan, PlanError
from infinity.devices.base import DeviceBackend
from infinity.distributed import Collectives, World
from infinity.io import SwapFile
from infinity.io.filesystems import nearest_existing
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.runtime.budgets import plan_for
from infinity.runtime.gradients import GradientSink
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.optimizer_binding import recut, wanted_layout
from infinity.runtime.params import ParamRegistry, tensor_index
from infinity.runtime.swap import (
    activation_host_room,
    close_activation_store,
    open_activation_store,
    open_swap,
    release_swap,
    swap_directory,
)
from infinity.runtime.update_queue import UpdateQueue
from infinity.schedule.eviction import LRUPolicy, TraceDrivenPolicy
from infinity.schedule.units import units_for
from infinity.utils.sizes import format_size

log = logging.getLogger("infinity")


def build_manager(
    plan: Plan,
    dtype: torch.dtype,
    backend: DeviceBackend,
    swap: SwapFile | None,
    collectives: Collectives,
    alloc_device: Callable[[int], torch.Tensor] | None = None,
) -> ChunkManager:
    """A chunk manager allocating ``plan``'s homes and slots (the engine's policies)."""
    return ChunkManager(
        plan,
        dtype,
        backend,
        swap,
        device_policy=TraceDrivenPolicy(),
        host_policy=LRUPolicy,
        collectives=collectives,
        alloc_device=alloc_device,
    )


def _device_slabs(old: ChunkManager) -> Callable[[int], torch.Tensor] | None:
    """An allocator of device slabs that hands out ``old``'s slabs of the asked size
    first; ``None`` (allocate anew) if one of its slots still holds a copy.

    NOTE: device slots hold copies only (at rest no gradient is there), and
    neither manager touches the device while the values move (host homes and
    staging only), so the new manager may take the old one's slabs: a device
    budget near the GPU's memory (``"auto"``: 80% of it free) could not hold
    two sets. The old manager keeps them, unused, until it is dropped.
    """
    old.synchronize()  # no transfer still reads or fills a slot
    for key in old.device.keys():
        if isinstance(key, tuple) and key[0] is Kind.PARAM:
            old.device.discard(key)  # a clean copy: its home holds the values
    if list(old.device.keys()):
        return None  # a copy still in use (a live view, a transfer): not reusable
    spare: dict[int, list[torch.Tensor]] = {}
    for pool in old.device.pools.values():
        if pool.slab.numel():
            spare.setdefault(pool.slab.numel(), []).append(pool.slab)

    def alloc(nbytes: int) -> torch.Tensor:
        slabs = spare.get(nbytes)
        return slabs.pop() if slabs else old.backend.alloc_device(nbytes)

    return alloc


class Rehomable(Protocol):
    """What re-homing reads and replaces of an engine (``OffloadEngine``)."""

    config: Config
    registry: ParamRegistry
    device: torch.device
    dtype: torch.dtype
    backend: DeviceBackend
    world: World
    collectives: Collectives
    home_plan: Plan
    chunks: ModelChunks
    queue: UpdateQueue
    sink: GradientSink
    swaps: list[SwapFile]
    swap: SwapFile | None
    activations: ActivationStore | None
    activation_policy: ActivationPolicy

    def assemble(
        self, plan: Plan, manager: ChunkManager, swap: SwapFile | None, units: ChunkOptimizer[Any]
    ) -> None: ...


def bind_optimizer(engine: Rehomable, chunk_optimizer: ChunkOptimizer[Any], owner: str) -> None:
    """Lay ``engine``'s homes and units out for ``chunk_optimizer`` (of the optimizer
    class ``owner``): re-home where a new plan moves homes and they can be had,
    else re-cut the units in the current homes.

    Raises as :func:`~infinity.runtime.optimizer_binding.wanted_layout` and
    :func:`~infinity.runtime.optimizer_binding.recut` do (nothing changed), or
    with whatever a failed copy raised (the old homes kept, the new released).
    """
    wanted = wanted_layout(engine.chunks, chunk_optimizer, owner, engine.config)
    if wanted is None:
        return
    if not _rehome(engine, wanted):
        recut(engine.chunks, engine.home_plan, engine.queue, wanted, engine.config)
        if engine.activations is not None:
            # NOTE: the re-cut plan holds this optimizer's per-tensor states, which
            # the host room of saved activations leaves out (nothing is saved now).
            engine.activations.set_allowance(
                activation_host_room(
                    engine.chunks.plan, engine.chunks.manager.host_account.reserved
                )
            )


def _rehome(engine: Rehomable, wanted: ChunkOptimizer[Any]) -> bool:
    """Move ``engine`` to homes planned for ``wanted``; False where it keeps its own."""
    plan, why_not = _new_plan(engine, wanted)
    built: tuple[ChunkManager, SwapFile | None] | None = None
    if plan is not None:
        try:
            built = _build(engine, plan)
        except Exception as exc:  # NOTE: any failure to allocate keeps the old homes
            why_not = f"allocating them failed ({type(exc).__name__}: {exc})"
    # NOTE: every rank reaches this collective (the same optimizer over the same
    # state): one that cannot re-home keeps every rank on the old plan.
    if engine.world.sharded and engine.collectives.any(
        built is None, "agreeing whether to plan the homes again for the optimizer"
    ):
        if built is not None:
            why_not = "another rank cannot (see its warning)"
            _discard(engine, built[1])
            built = None
    if built is None:
        if why_not:
            home = engine.chunks.home_optimizer
            log.warning(
                "infinity: kept the homes planned for %s instead of planning them again for "
                "%s (its units are cut inside them: its traffic, but the host and NVMe bytes "
                "reserved stay): %s",
                home.front_end or home.name,
                wanted.front_end or wanted.name,
                why_not,
            )
        return False
    assert plan is not None
    manager, swap = built
    # NOTE: sharded, the copy gathers and broadcasts: a rank failing in it leaves the
    # others to fail in their next collective (DistributedError); each keeps its old homes.
    try:
        _copy_values(engine.chunks, manager)
    except BaseException:
        _discard(engine, swap)
        raise
    old = engine.home_plan
    _switch(engine, plan, manager, swap, wanted)
    log.info(
        "infinity: homes planned again for %s: host %s, NVMe %s (were %s, %s)",
        wanted.front_end or wanted.name,
        format_size(plan.host_bytes),
        format_size(plan.nvme_bytes),
        format_size(old.host_bytes),
        format_size(old.nvme_bytes),
    )
    return True


def _new_plan(engine: Rehomable, wanted: ChunkOptimizer[Any]) -> tuple[Plan | None, str]:
    """The plan to move to, or ``None`` and why not ("": the homes would not change)."""
    busy = _busy(engine)
    if busy:
        return None, busy
    old = engine.home_plan
    try:
        plan = plan_for(
            engine.registry,
            engine.config,
            engine.device,
            wanted,
            world=engine.world,
            budgets=old.budgets,
        )
    except PlanError as exc:
        return None, f"no plan for it fits the budgets ({exc})"
    same = (
        plan.layout == old.layout
        and (plan.param_home, plan.grad_home, plan.optim_home)
        == (old.param_home, old.grad_home, old.optim_home)
        and plan.device_slots == old.device_slots
    )
    if same and _recut_fits(engine, wanted):
        return None, ""
    return (None, reason) if (reason := _no_room(engine, plan)) else (plan, "")


def _recut_fits(engine: Rehomable, wanted: ChunkOptimizer[Any]) -> bool:
    """``wanted``'s units and per-tensor states fit the current homes and staging.

    NOTE: a plan made for ``wanted`` can keep every home and still differ in
    staging (fewer or smaller slots, to make room for per-tensor states); re-cut
    in the old staging, those states can pass the host budget (issue 29's sweep:
    Adafactor with every home on NVMe). Then the model re-homes.
    """
    try:
        units_for(
            engine.home_plan,
            wanted,
            consume_grads=engine.config.overlap_optimizer is True,
            planned_for=engine.chunks.home_optimizer,
        )
    except ValueError:
        return False
    return True


def _busy(engine: Rehomable) -> str:
    """Why the values cannot move now ("" if they can): only the homes hold data."""
    chunks = engine.chunks
    if engine.sink.running or any(chunks.has_grad[i] for i in range(len(chunks.has_grad))):
        return "a backward ran before the optimizer was constructed (gradients are held)"
    at_rest = (TensorState.FREE, TensorState.HOLD)
    if any(state not in at_rest for counters in chunks.states for state in counters.states):
        # NOTE: a graph of that forward may hold views of the current chunks.
        return "a forward ran before the optimizer was constructed; construct it first"
    return ""


def _no_room(engine: Rehomable, plan: Plan) -> str:
    """Why ``plan``'s homes cannot be allocated beside the current ones ("" if they can):
    both exist while the values move."""
    old = engine.home_plan
    nvme = old.budgets.nvme
    if plan.nvme_bytes and nvme is not None and old.nvme_bytes + plan.nvme_bytes > nvme:
        return (
            f"its swap file ({format_size(plan.nvme_bytes)}) and the current one "
            f"({format_size(old.nvme_bytes)}) exist together while the values move, more than "
            f"nvme_memory ({format_size(nvme)})"
        )
    if plan.nvme_bytes:
        free = shutil.disk_usage(nearest_existing(swap_directory(engine.config))).free
        if plan.nvme_bytes > free:
            return (
                f"its swap file ({format_size(plan.nvme_bytes)}) does not fit the free disk "
                f"space at nvme_path ({format_size(free)})"
            )
    ram = plan.host_bytes + (plan.device_bytes if engine.backend.shares_host_memory else 0)
    available = psutil.virtual_memory().available
    if ram > available:
        return (
            f"its host memory ({format_size(ram)}) does not fit the RAM available beside the "
            f"current homes ({format_size(available)})"
        )
    return ""


def _build(engine: Rehomable, plan: Plan) -> tuple[ChunkManager, SwapFile | None]:
    """``plan``'s swap file and chunk manager (nothing in them yet)."""
    swap = open_swap(engine.config, plan.nvme_bytes)
    if swap is not None:
        engine.swaps.append(swap)  # NOTE: the finalizer removes it if the process ends now
    try:
        slabs = _device_slabs(engine.chunks.manager)
        manager = build_manager(plan, engine.dtype, engine.backend, swap, engine.collectives, slabs)
        return manager, swap
    except BaseException:
        _discard(engine, swap)
        raise


def _discard(engine: Rehomable, swap: SwapFile | None) -> None:
    """Give up new homes: remove their swap file (their memory goes with the manager)."""
    if swap is not None:
        engine.swaps.remove(swap)
        release_swap(swap)


def _copy_values(chunks: ModelChunks, new: ChunkManager) -> None:
    """Every parameter's values, from ``chunks``' homes into ``new``'s (laid out by its
    plan), one chunk of ``new`` at a time; zero optimizer states.

    NOTE: the fp32 master is the value where there is one (a 16-bit run's
    trainable chunks): the parameter is its rounding, as at offload.
    """
    old = chunks.manager
    old_layout, layout = chunks.layout, new.plan.layout
    chunks.manager.synchronize()  # the initial values' writes have landed
    by_chunk = layout.group_by_chunk(chunks.registry.entries, tensor_index)
    for chunk in range(layout.num_chunks):
        values = torch.zeros(layout.chunks[chunk].capacity, dtype=torch.float32)
        members_here = by_chunk.get(chunk, [])
        for source, members in old_layout.group_by_chunk(members_here, tensor_index).items():
            master = old.plan.has_master and old_layout.chunks[source].trainable
            kind, dtype = (Kind.OPTIM, torch.float32) if master else (Kind.PARAM, chunks.dtype)
            slots = [old_layout.slots[entry.index] for entry in members]
            with closing(tensor_values(old, kind, source, slots, dtype)) as flats:
                for entry, flat in zip(members, flats, strict=True):
                    slot = layout.slots[entry.index]
                    values[slot.offset : slot.offset + slot.numel].copy_(flat)
        new.write_initial(chunk, values, background=True)
    new.synchronize()


def _switch(
    engine: Rehomable,
    plan: Plan,
    manager: ChunkManager,
    swap: SwapFile | None,
    wanted: ChunkOptimizer[Any],
) -> None:
    """Build ``engine``'s components on the new homes, then release the old ones."""
    old_chunks, old_swap = engine.chunks, engine.swap
    manager.traffic.add(old_chunks.manager.traffic)
    engine.assemble(plan, manager, swap, wanted)
    chunks = engine.chunks
    chunks.unset.update(old_chunks.unset)
    for entry in engine.registry.entries:
        if old_chunks.state_of(entry) is not TensorState.FREE:
            chunks.set_state(entry, TensorState.HOLD)
    if engine.activations is not None:
        # NOTE: its host room is what the homes leave (nothing is saved in it now).
        close_activation_store(engine.activations)
        store = open_activation_store(
            engine.config, plan, engine.backend, manager.host_account.reserved
        )
        engine.activations = engine.activation_policy.store = store
        if store is not None:
            chunks.activation_bytes = store.tier_bytes
    engine.activation_policy.device_room = max(0, plan.budgets.device - plan.device_bytes)
    if old_swap is not None:
        engine.swaps.remove(old_swap)
        release_swap(old_swap)
