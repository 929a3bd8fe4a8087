"""Run directories and checkpoints of ``infinity train``: ``DIR/run-<id>/step-00000042/``.

Every run saves only into its own ``run-<id>`` directory, created exclusively
(a name that is taken is never reused) and held under an exclusive ``flock``
for as long as the process lives, so two runs never write or prune the same
checkpoints, and a second process resuming a run that is still training forks
a new run instead. ``--checkpoint-dir`` is checked when the command starts:
it must be a directory this user may write and that nobody else can tamper
with (owned by this user, or sticky like ``/tmp``; never world-writable
without the sticky bit).

Each checkpoint, complete or absent, is an ``infinity.save_checkpoint``
directory plus ``trainer.json`` (the run's settings, step counter, LR-schedule
state and RNG state). Both are written into a hidden staging directory tagged
with this process (``.step-N.partial-<host>-<pid>-...``) that is renamed into
place only when complete, so a ``step-*`` directory is always a whole
checkpoint: an interrupted save leaves the previous ones untouched, and its
staging directory is reclaimed by the next save once the process is gone.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from infinity.checkpoint import temporaries
from infinity.checkpoint.format import fsync_dir
from infinity.checkpoint.save import write_checkpoint
from infinity.cli.main import CommandError
from infinity.cli.train.settings import RunSettings
from infinity.distributed.agreement import rank_zero_writes
from infinity.offload import engine_of

RUN_PREFIX = "run-"
TRAINER_FILE = "trainer.json"
FORMAT = "infinity-train"
VERSION = 1
_NAME = re.compile(r"^step-(\d{8,})$")
KEEP = 2  # the newest two of a run: a damaged newest one still leaves one to resume


def make_dirs(target: Path, flag: str) -> list[Path]:
    """Create the absolute directory ``target`` and its missing parents; returns those
    created, outermost first (``flag`` begins the error message)."""
    created = []
    for directory in [*reversed(target.parents), target]:
        if directory.exists():
            continue
        try:
            directory.mkdir()
        except FileExistsError:
            # a run started at the same time, or another rank of this run, made it
            # first (not ours to remove)
            continue
        except OSError as exc:
            raise CommandError(f"{flag}: cannot create '{directory}': {exc.strerror}") from None
        created.append(directory)
    return created


def remove_empty(created: list[Path]) -> None:
    """Remove the directories :func:`make_dirs` created, innermost first, while empty."""
    for directory in reversed(created):
        try:
            directory.rmdir()  # only when empty: never removes a checkpoint, or anything else
        except OSError:
            break


def _who(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def owned_safely(st: os.stat_result) -> bool:
    """Whether a directory with this ``stat`` is this user's and only this user's to change."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWOTH | stat.S_IWGRP)


def check_directory(directory: Path) -> list[Path]:
    """Create ``--checkpoint-dir`` if missing and refuse one this run cannot own.

    Returns the directories it created (removed again if the run saves nothing).
    """
    flag = f"--checkpoint-dir: '{directory}'"
    created = make_dirs(directory.absolute(), flag)
    if not directory.is_dir():
        raise CommandError(f"{flag} is not a directory; pass a directory (or 'none')")
    st = directory.stat()
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & stat.S_IWOTH and not sticky:
        raise CommandError(
            f"{flag} is writable by everyone without the sticky bit, so anyone could replace "
            f"or delete its checkpoints; use a directory of your own (or chmod +t '{directory}')"
        )
    if st.st_uid != os.geteuid() and not sticky:
        raise CommandError(
            f"{flag} belongs to {_who(st.st_uid)}, not to you; use a directory of your own"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CommandError(f"{flag} is not writable by you; use a directory of your own")
    return created


class RunDirectory:
    """This run's ``DIR/run-<id>``: created or continued, and locked until :meth:`close`."""

    def __init__(self, path: Path, fd: int, created: list[Path], fresh: bool) -> None:
        self.path = path
        self.run_id = path.name.removeprefix(RUN_PREFIX)
        self._fd = fd
        self._created = created  # dirs made for this run, removed by close() if still empty
        self.fresh = fresh  # a new run (not continuing one)

    @classmethod
    def new(cls, directory: Path, created: list[Path]) -> RunDirectory:
        """A new run in ``directory`` (already checked) under a fresh id.

        Temporaries that dead processes left in ``directory`` and in this user's
        run directories there are reclaimed first (their checkpoints are not touched).
        """
        for path in [directory, *directory.glob(f"{RUN_PREFIX}*")]:
            temporaries.reclaim(path)
        for _attempt in range(100):
            path = directory / f"{RUN_PREFIX}{uuid.uuid4().hex[:12]}"
            try:
                path.mkdir(mode=0o755)
            except FileExistsError:
                continue  # taken (even planted by someone else): never reuse a name
            except OSError as exc:
                raise CommandError(
                    f"--checkpoint-dir: cannot create '{path}': {exc.strerror}"
                ) from None
            fd = _lock(path)
            assert fd is not None  # a directory we just created exclusively
            return cls(path, fd, [*created, path], fresh=True)
        raise CommandError(f"--checkpoint-dir: no free run name in '{directory}'")

    @classmethod
    def resume(cls, run_dir: Path) -> RunDirectory | None:
        """Continue the run in ``run_dir``; None if it is not ours or another process holds it."""
        try:
            st = run_dir.lstat()
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode) or not owned_safely(st):
            return None
        fd = _lock(run_dir)
        if fd is None:
            return None
        temporaries.reclaim(run_dir)
        return cls(run_dir, fd, [], fresh=False)

    def close(self) -> None:
        """Release the lock; remove what was created for this run if nothing was saved in it."""
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        remove_empty(self._created)


def _lock(path: Path) -> int | None:
    """An open descriptor of ``path`` holding an exclusive flock; None if another holds it.

    The kernel drops the lock when the process dies, however it dies, so a
    crashed run never blocks its resumption.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class TrainerState:
    """What ``trainer.json`` holds besides the model and optimizer."""

    step: int
    run_id: str
    settings: RunSettings
    scheduler: dict[str, Any]
    rng: bytes
    tokens: int
    last_loss: float | None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "run_id": self.run_id,
            "settings": self.settings.to_dict(),
            "scheduler": self.scheduler,
            "rng": base64.b64encode(self.rng).decode(),
            "tokens": self.tokens,
            "last_loss": self.last_loss,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], where: Path) -> TrainerState:
        """Parse ``trainer.json``; a clear error if it is not one of ours or is damaged."""
        if not isinstance(data, dict) or (data.get("format"), data.get("version")) != (
            FORMAT,
            VERSION,
        ):
            raise infinity.CheckpointError(
                f"{where} is not an infinity train checkpoint (v{VERSION})"
            )
        state = cls(
            step=int(data["step"]),
            run_id=str(data["run_id"]),
            settings=RunSettings.from_dict(data["settings"]),
            scheduler=data["scheduler"],
            rng=base64.b64decode(data["rng"], validate=True),
            tokens=int(data["tokens"]),
            last_loss=data["last_loss"],
        )
        # Checked here so a damaged trainer.json fails before the model is touched.
        if state.step < 0 or state.tokens < 0:
            raise ValueError(f"step {state.step} or tokens {state.tokens} below 0")
        epoch = state.scheduler.get("last_epoch") if isinstance(state.scheduler, dict) else None
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"scheduler last_epoch {epoch!r}")
        if len(state.rng) != torch.get_rng_state().numel():
            raise ValueError(f"rng state of {len(state.rng)} bytes")
        if state.last_loss is not None and type(state.last_loss) not in (int, float):
            raise ValueError(f"last_loss {state.last_loss!r}")
        return state


def checkpoint_path(directory: Path, step: int) -> Path:
    """Where the checkpoint after ``step`` lives in a run directory."""
    return directory / f"step-{step:08d}"


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of this user's complete checkpoints right in ``directory``, oldest first."""
    try:
        paths = list(directory.iterdir())
    except OSError:
        return []
    found = []
    for path in paths:
        match = _NAME.match(path.name)
        if match and _mine(path) and (path / TRAINER_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _mine(path: Path) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def latest_checkpoint(directory: Path) -> Path | None:
    """The most recently saved complete checkpoint of this user in ``directory``.

    ``directory`` is a run directory or a ``--checkpoint-dir`` holding run
    directories (and, from older versions, ``step-N`` directly); another
    user's runs and checkpoints are never picked.
    """
    candidates = [p for _s, p in complete_checkpoints(directory)]
    try:
        runs = [p for p in directory.iterdir() if p.name.startswith(RUN_PREFIX) and _mine(p)]
    except OSError:
        runs = []
    for run in runs:
        found = complete_checkpoints(run)
        if found:
            candidates.append(found[-1][1])
    if not candidates:
        return None
    return max(candidates, key=lambda p: (_saved_at(p), p.name))


def _saved_at(path: Path) -> int:
    try:
        return (path / TRAINER_FILE).stat().st_mtime_ns
    except OSError:
        return -1  # pruned by its (other) run since it was listed


def save(
    run: RunDirectory, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState
) -> Path:
    """Write the checkpoint after ``state.step`` into this run's directory; keep its newest
    :data:`KEEP`; return its path. Never overwrites a checkpoint and never touches another
    run's: an error (a full disk included) leaves no partial checkpoint behind.

    With the model sharded over several ranks this is collective: every rank
    gathers each chunk, rank 0 alone writes, and every rank raises if it failed.
    """
    final = checkpoint_path(run.path, state.step)
    engine = engine_of(model)
    if not engine.world.sharded:
        _fill(_stage(run, final), final, run, model, optimizer, state)
        _prune(run)
        return final

    def write(staging: Path | None) -> None:
        if staging is None:
            write_checkpoint(None, model, optimizer)  # this rank only gathers
        else:
            _fill(staging, final, run, model, optimizer, state)

    staged = rank_zero_writes(
        engine.collectives,
        f"save checkpoint {final}",
        lambda: _stage(run, final),
        write,
        before="nothing was saved for this step",
        after="nothing was saved for this step",
        error_type=infinity.CheckpointError,
    )
    if staged is not None:
        _prune(run)
    return final


def _stage(run: RunDirectory, final: Path) -> Path:
    """The empty staging directory the checkpoint at ``final`` is written into."""
    if os.path.lexists(final):
        raise infinity.CheckpointError(f"{final} exists already; it is not overwritten")
    temporaries.reclaim(run.path)
    staging = temporaries.temp_path(run.path, final.name)
    staging.mkdir()
    return staging


def _fill(
    staging: Path,
    final: Path,
    run: RunDirectory,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
) -> None:
    """Write the checkpoint into ``staging`` and rename it to ``final``, or remove it."""
    try:
        write_checkpoint(staging, model, optimizer)
        with open(staging / TRAINER_FILE, "w") as f:
            json.dump(replace(state, run_id=run.run_id).to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(staging)
        os.rename(staging, final)  # the run directory is locked: nobody else names steps
        fsync_dir(run.path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _prune(run: RunDirectory) -> None:
    for _step, old in complete_checkpoints(run.path)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def read_state(path: Path) -> TrainerState:
    """The trainer state of the checkpoint at ``path`` (no tensors are read)."""
    file = path / TRAINER_FILE
    try:
        return TrainerState.from_json(json.loads(file.read_text()), path)
    except FileNotFoundError:
        raise infinity.CheckpointError(
            f"{path} is not a complete checkpoint (no {TRAINER_FILE})"
        ) from None
    except OSError as exc:
        raise infinity.CheckpointError(f"cannot read {file}: {exc.strerror}") from None
    except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise infinity.CheckpointError(f"{file} is damaged: {exc}") from None
