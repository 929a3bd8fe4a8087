"""Checkpoints of ``infinity train`` runs: ``DIR/step-00000042/``, complete or absent.

Each checkpoint is an ``infinity.save_checkpoint`` directory plus
``trainer.json`` (the run's settings, step counter, LR-schedule state and RNG
state). Both are written into a hidden staging directory that is renamed into
place only when complete, so a ``step-*`` directory is always a whole
checkpoint: an interrupted save leaves the previous ones untouched.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from infinity.cli.train_settings import RunSettings

TRAINER_FILE = "trainer.json"
FORMAT = "infinity-train"
VERSION = 1
_NAME = re.compile(r"^step-(\d{8,})$")
KEEP = 2  # NOTE: the newest two of a run: a damaged newest one still leaves one to resume


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
        """Parse ``trainer.json``; a clear error if it is not one of ours."""
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise infinity.CheckpointError(
                f"{where} is not an infinity train checkpoint (v{VERSION})"
            )
        return cls(
            step=int(data["step"]),
            run_id=str(data["run_id"]),
            settings=RunSettings.from_dict(data["settings"]),
            scheduler=data["scheduler"],
            rng=base64.b64decode(data["rng"]),
            tokens=int(data["tokens"]),
            last_loss=data["last_loss"],
        )


def checkpoint_path(directory: Path, step: int) -> Path:
    """Where the checkpoint after ``step`` lives."""
    return directory / f"step-{step:08d}"


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match and (path / TRAINER_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, or ``None``."""
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState
) -> Path:
    """Write the checkpoint after ``state.step``; keep the newest :data:`KEEP`; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, state.step)
    if (final / TRAINER_FILE).is_file():
        return final  # this very step is saved already (e.g. Ctrl-C right after a save)
    staging = directory / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        infinity.save_checkpoint(staging, model, optimizer)
        with open(staging / TRAINER_FILE, "w") as f:
            json.dump(state.to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(staging)
        os.rename(staging, final)
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # A new run replaces the checkpoints of earlier runs in the same directory;
    # only this run's newest KEEP stay.
    mine = [p for _s, p in complete_checkpoints(directory) if _run_id(p) == state.run_id]
    for _step, old in complete_checkpoints(directory):
        if old not in mine[-KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _run_id(path: Path) -> str | None:
    try:
        return json.loads((path / TRAINER_FILE).read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def read_state(path: Path) -> TrainerState:
    """The trainer state of the checkpoint at ``path`` (no tensors are read)."""
    file = path / TRAINER_FILE
    try:
        return TrainerState.from_json(json.loads(file.read_text()), path)
    except FileNotFoundError:
        raise infinity.CheckpointError(
            f"{path} is not a complete checkpoint (no {TRAINER_FILE})"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise infinity.CheckpointError(f"{file} is damaged: {exc}") from None


def restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer states from the checkpoint at ``path`` (CRC-checked)."""
    infinity.load_checkpoint(path, model, optimizer)
