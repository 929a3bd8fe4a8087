"""The engine's native resources: the NVMe swap file (with its I/O engine) and
their release, which must not need the model (see :func:`release`)."""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist

from infinity.activations.spill import ActivationSpill
from infinity.activations.store import ActivationStore, split_allowance
from infinity.config import Config, ConfigError
from infinity.core.plan import Plan
from infinity.devices.base import DeviceBackend
from infinity.distributed import resolve_world
from infinity.io import IOEngine, SwapFile
from infinity.io.filesystems import pseudo_filesystem
from infinity.io.owned_dirs import reclaim_stale
from infinity.runtime import signals


def prepare_nvme(config: Config) -> None:
    """Check ``config.nvme_path`` can hold files; remove swap directories there left
    by processes that are gone.

    NOTE: called before planning, whose ``nvme_memory="auto"`` counts free space.
    """
    path = config.nvme_path
    if path is None:
        return
    fs_type = pseudo_filesystem(path)
    if fs_type is not None:
        raise ConfigError(
            f"nvme_path={path!r} is on a {fs_type} file system, a kernel interface with no "
            "storage: swap files cannot be created there; use a directory on a disk "
            "(ideally an NVMe SSD), or no nvme_path to keep every state in memory"
        )
    reclaim_stale(path)
    own = swap_directory(config)
    if own != path:
        reclaim_stale(own)


def swap_directory(config: Config) -> str:
    """Where this process's swap directory goes: ``nvme_path``, or with chunks sharded
    over several ranks ``nvme_path/rank-<global rank>``.

    NOTE: one ``nvme_path`` then serves every local rank, and nodes sharing it (a
    network file system): each rank reclaims stale directories only in its own
    folder, where no other rank of the job ever writes. The empty ``rank-<r>``
    folders stay, as ``nvme_path`` itself does, for the next run.
    """
    path = config.nvme_path
    assert path is not None
    if not resolve_world(config.process_group).sharded:
        return path
    # Only the last component of nvme_path is created, as for one process; a missing
    # parent is reported by SwapFile with the path.
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.mkdir(path)
    return os.path.join(path, f"rank-{dist.get_rank()}")


def open_swap(config: Config, nbytes: int) -> SwapFile | None:
    """A preallocated swap file of ``nbytes`` under :func:`swap_directory`, or ``None``."""
    if nbytes == 0 or config.nvme_path is None:
        return None
    engine = IOEngine(config.aio)
    try:
        swap = SwapFile(swap_directory(config), nbytes, engine, name="chunks")
    except BaseException:
        engine.close()
        raise
    signals.guard(swap.path, swap.directory)
    return swap


def open_activation_store(
    config: Config, plan: Plan, backend: DeviceBackend, host_reserved: int
) -> ActivationStore | None:
    """The store of ``activations="offload"`` (``None`` for the other policies): host
    memory the states leave free (``host_reserved``: the manager's slabs; the
    optimizer's per-tensor states are the plan's), then swap files beside theirs."""
    if config.activations not in ("offload", "auto"):
        return None
    spill = None
    if config.nvme_path is not None:
        nvme = plan.budgets.nvme
        limit = None if nvme is None else max(0, nvme - plan.nvme_bytes)
        spill = ActivationSpill(
            swap_directory(config),
            config.aio,
            limit,
            on_open=lambda swap: signals.guard(swap.path, swap.directory),
        )
    share, read, write = split_allowance(
        activation_host_room(plan, host_reserved), spill is not None
    )
    return ActivationStore(
        backend.device,
        shares_host_memory=backend.shares_host_memory,
        host_capacity=share,
        min_bytes=int(config.activation_min_bytes),
        spill=spill,
        read_ahead=read,
        write_window=write,
        warn_when_full=config.activations == "offload",
    )


def activation_host_room(plan: Plan, host_reserved: int) -> int:
    """Host bytes saved activations may hold, their host share and both windows
    (``split_allowance``): the budget less the manager's slabs (``host_reserved``) and
    the optimizer's per-tensor states (Adafactor's factors)."""
    return max(0, plan.budgets.host - host_reserved - plan.tensor_state_bytes)


def close_activation_store(store: ActivationStore | None) -> None:
    """Finish its writes, remove its swap files (and their signal guards)."""
    if store is None:
        return
    paths = [swap.path for swap in store.spill.segments] if store.spill is not None else []
    try:
        store.close()
    finally:
        for path in paths:
            signals.unguard(path)


def release(backend: DeviceBackend, swaps: list[SwapFile]) -> None:
    """Stop the copy thread, remove the swap files and stop their I/O workers.

    ``swaps`` is the engine's own list: ``OffloadEngine.lay_out`` adds its file
    (after this finalizer was made at offload). Each step waits for the transfers
    it owns and runs even if the one before raised. NOTE: this is the model's
    finalizer, so it takes only the resources: a finalizer that reached the
    engine would reach the model (the engine's registry holds its parameters)
    and keep both alive until exit.
    """
    try:
        backend.close()
    finally:
        _release_all(swaps)


def _release_all(swaps: list[SwapFile]) -> None:
    """Release every swap file of ``swaps`` (emptying it), even if one raises."""
    if not swaps:
        return
    try:
        release_swap(swaps.pop())
    finally:
        _release_all(swaps)


def release_swap(swap: SwapFile) -> None:
    """Remove one swap file (with its signal guard) and stop its I/O workers."""
    try:
        swap.close()
    finally:
        signals.unguard(swap.path)
        swap.engine.close()
