"""The on-disk checkpoint format: JSON metadata plus raw chunk files, no pickle.

A checkpoint directory holds:

- ``meta.json``: format version, dtype, the layout (every tensor's name, shape,
  chunk and offset), per-tensor optimizer step counts, optimizer hyper-parameters
  per group, loss-scaler state, and a CRC-32 and size per data file;
- ``param.bin``: every parameter chunk in the compute dtype, in chunk order;
- ``optim.bin``: every trainable chunk's optimizer unit (fp32 master when the
  compute dtype is 16-bit, then ``exp_avg``, then ``exp_avg_sq``).

Loading reads only numbers and raw bytes, so a checkpoint cannot run code.
Tensors are located by name, so a checkpoint loads into a different chunk
layout (other budgets, other chunk size) of the same model.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "infinity-checkpoint"
VERSION = 1
META = "meta.json"
PARAM_FILE = "param.bin"
OPTIM_FILE = "optim.bin"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the model."""


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's values sit in the checkpoint files."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    param_offset: int  # byte offset of the tensor in param.bin
    optim_offset: int | None  # byte offset of the chunk's unit in optim.bin
    chunk_capacity: int  # elements of the chunk (parts of a unit are this long)
    element_offset: int  # offset of the tensor inside its chunk (elements)
    step: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def read_meta(path: Path) -> dict[str, Any]:
    """Parse and check ``meta.json``; raise :class:`CheckpointError` if unusable."""
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not an infinity checkpoint (no {META})")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path} is corrupt: {exc}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(
            f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r} "
            f"is not {FORMAT!r} version {VERSION}"
        )
    for name, info in meta["files"].items():
        file = path / name
        if not file.is_file() or file.stat().st_size != info["bytes"]:
            raise CheckpointError(
                f"{file} is missing or truncated (expected {info['bytes']} bytes)"
            )
    return meta


def records(meta: dict[str, Any]) -> dict[str, TensorRecord]:
    """Tensor records by name (aliases of tied parameters included)."""
    out: dict[str, TensorRecord] = {}
    for t in meta["tensors"]:
        record = TensorRecord(
            name=t["name"],
            shape=tuple(t["shape"]),
            trainable=t["trainable"],
            param_offset=t["param_offset"],
            optim_offset=t["optim_offset"],
            chunk_capacity=t["chunk_capacity"],
            element_offset=t["element_offset"],
            step=t["step"],
        )
        for name in [t["name"], *t["aliases"]]:
            out[name] = record
    return out


def file_crc(file: Path, block: int = 16 << 20) -> int:
    """CRC-32 of a whole file, read in blocks."""
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify_files(path: Path, meta: dict[str, Any]) -> None:
    """Check every data file's CRC-32 against ``meta.json``."""
    for name, info in meta["files"].items():
        if file_crc(path / name) != info["crc32"]:
            raise CheckpointError(f"{path / name} is corrupt (CRC-32 mismatch)")


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
