"""The engine's native resources: the NVMe swap file (with its I/O engine) and
their release, which must not need the model (see :func:`release`), and the
removal of swap files when the process is ended by SIGTERM or SIGHUP.

By default these signals end the process at once: no ``close()``, finalizer or
``atexit`` runs, and the swap files (as large as the NVMe state) would stay
until the next run in the same place reclaims them. So while an engine with a
swap file lives, a handler is installed for each of them (from the main thread
only, and only over the default action or a Python handler: an ignored signal
stays ignored). It unlinks every swap file of this process, then chains: it
calls the handler installed before it, or restores the default action and
raises the signal again, so the process still dies by it (exit status -15, or
143 in a shell). The signal is never swallowed.

Unlinking is safe even if the chained handler lets the process go on:
a file stays usable through its open descriptor until it is closed, and only
then is its space freed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any

import torch.distributed as dist

from infinity.activations.spill import ActivationSpill
from infinity.activations.store import ActivationStore, split_allowance
from infinity.config import Config, ConfigError
from infinity.core.plan import Plan
from infinity.devices.base import DeviceBackend
from infinity.distributed import resolve_world
from infinity.io import IOEngine, SwapFile
from infinity.io.directories import pseudo_filesystem, reclaim_stale


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

    One ``nvme_path`` then serves every local rank, and nodes sharing it (a
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
    guard(swap.path, swap.directory)
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
            on_open=lambda swap: guard(swap.path, swap.directory),
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
            unguard(path)


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
        unguard(swap.path)
        swap.engine.close()


SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_files: dict[str, tuple[int, str]] = {}  # swap file -> (owner pid, its directory)
_previous: dict[int, Any] = {}  # signal -> the handler ours replaced (kept for stale chains)
_installed: set[int] = set()


def guard(path: str, directory: str) -> None:
    """Remove ``path`` and its (then empty) ``directory`` if SIGTERM/SIGHUP ends the process."""
    _files[path] = (os.getpid(), directory)
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works only there; an engine made there later installs it
    for signum in SIGNALS:
        if signum in _installed:
            continue
        current = signal.getsignal(signum)
        if current is signal.SIG_IGN or current is None:
            continue  # ignored, or a handler from C that Python cannot chain to
        _previous[signum] = current
        signal.signal(signum, _on_signal)
        _installed.add(signum)


def unguard(path: str) -> None:
    """``path`` was removed normally; the last one restores the handlers (if still ours)."""
    _files.pop(path, None)
    if _files or threading.current_thread() is not threading.main_thread():
        return
    for signum in list(_installed):
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, _previous[signum])
        # If another handler replaced ours it may chain to ours later;
        # ours then only chains on, as _previous is kept.
        _installed.discard(signum)


def _on_signal(signum: int, frame: FrameType | None) -> Any:
    pid = os.getpid()
    for path, (owner, directory) in list(_files.items()):
        if owner != pid:
            continue  # a forked child must not remove its parent's files
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(directory)
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        return previous(signum, frame)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)  # dies here: the default action of SIGTERM/SIGHUP
    return None
