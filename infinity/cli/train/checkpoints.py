"""Checkpoints of ``infinity train`` runs: ``DIR/run-<id>/step-00000042/``, complete or absent.

Each checkpoint is an ``infinity.save_checkpoint`` directory plus
``trainer.json`` (the run's settings, step counter, LR-schedule state and RNG
state). Both are written into a hidden staging directory tagged with this
process (``.step-N.partial-<host>-<pid>-...``) that is renamed into place
only when complete, so a ``step-*`` directory is always a whole checkpoint:
an interrupted save leaves the previous ones untouched, and its staging
directory is reclaimed by the next save once the process is gone. A run
writes and prunes only its own directory (``runs.py``).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from infinity.checkpoint import temporaries
from infinity.checkpoint.format import fsync_dir
from infinity.checkpoint.save import write_checkpoint
from infinity.cli.train.runs import RUN_PREFIX, RunDirectory
from infinity.cli.train.settings import RunSettings
from infinity.distributed.agreement import rank_zero_writes
from infinity.offload import engine_of

TRAINER_FILE = "trainer.json"
FORMAT = "infinity-train"
VERSION = 1
_NAME = re.compile(r"^step-(\d{8,})$")
KEEP = 2  # the newest two of a run: a damaged newest one still leaves one to resume


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


def restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer states from the checkpoint at ``path`` (CRC-checked)."""
    infinity.load_checkpoint(path, model, optimizer)
