"""The on-disk checkpoint format: JSON metadata plus raw chunk files, no pickle.

A checkpoint directory holds:

- ``meta.json``: format version, dtype, the layout (every tensor's name, shape,
  chunk and offset), the optimizer whose state ``optim.bin`` holds
  (``chunk_optimizer``: its name, front-end and state slots; a checkpoint loads
  only into a model whose units are laid out for the same one), per-tensor
  optimizer step counts, optimizer hyper-parameters per group, loss-scaler
  state, a CRC-32 and size per data file, and a SHA-256 of its own canonical
  form (``meta_sha256``), so a damaged offset or count is refused instead of
  loading wrong weights;
- ``param.bin``: every parameter chunk in the compute dtype, in chunk order;
- ``optim.bin``: every trainable chunk's optimizer unit as it is stored (fp32
  master when the compute dtype is 16-bit, then the optimizer's state slots in
  order: ``exp_avg``, then ``exp_avg_sq`` for Adam, ``exp_avg`` for Lion,
  ``momentum_buffer`` for SGD, none for Adafactor, in the stored format that
  ``meta.json`` names as ``optimizer_state_dtype``: fp32, bf16, or int8 codes
  and their block scales; see
  :class:`infinity.optim.chunk_optimizer.ChunkOptimizer`). A checkpoint loads
  only into a model offloaded with the same ``optimizer_state_dtype`` (saved
  bytes are restored as they were, so a resumed run is bit-identical); to
  change the format, go through ``CPUAdam.state_dict()`` / ``load_state_dict()``,
  which carry fp32 values. After the units come the per-tensor states of an
  optimizer that keeps them (Adafactor's ``row_var`` and ``col_var``, or
  ``variance``: fp32, C order), each tensor's offsets in its ``tensor_state``
  record (see NOTE [per-tensor optimizer state]).

Loading reads only numbers and raw bytes, so a checkpoint cannot run code.
Tensors are located by name, so a checkpoint loads into a different chunk
layout (other budgets, other chunk size) of the same model.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Any, BinaryIO

FORMAT = "infinity-checkpoint"
VERSION = 4
# Version 1 has no meta_sha256; before version 3 there is no
# optimizer_state_dtype (the states are fp32), before version 4 no
# chunk_optimizer (the state is Adam's). Everything else is checked.
READABLE_VERSIONS = (1, 2, 3, 4)
META = "meta.json"
META_CHECKSUM = "meta_sha256"
PARAM_FILE = "param.bin"
OPTIM_FILE = "optim.bin"
DATA_FILES = (PARAM_FILE, OPTIM_FILE)
MAX_META_BYTES = 1 << 30  # a 70B model's meta.json is a few MB; more is not ours


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the model."""


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of ``meta`` without its checksum, in a canonical JSON form.

    Canonical (sorted keys, no spaces) rather than the file's bytes, so the
    checksum can live inside the file it protects; Python's float repr
    round-trips, so parsing and re-serialising gives the same text.
    """
    body = {k: v for k, v in meta.items() if k != META_CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def dump_meta(meta: dict[str, Any], file: Path) -> None:
    """Write ``meta`` with its checksum to ``file`` and fsync it."""
    with open(file, "w") as f:
        json.dump({**meta, META_CHECKSUM: meta_digest(meta)}, f)
        f.flush()
        os.fsync(f.fileno())


def read_meta(path: Path) -> dict[str, Any]:
    """Parse ``meta.json`` and check its format and checksum (not yet its contents).

    Raises :class:`CheckpointError` naming the problem for anything unusable.
    """
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not an infinity checkpoint (no {META})")
    try:
        with open(meta_path, "rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read {meta_path}: {exc.strerror}") from None
    if len(raw) > MAX_META_BYTES:
        raise CheckpointError(f"{meta_path} is larger than {MAX_META_BYTES} bytes: not ours")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{meta_path} is corrupt: {exc}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path} is corrupt: not a JSON object")
    fmt, version = meta.get("format"), meta.get("version")
    if fmt != FORMAT or type(version) is not int or version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{meta_path}: format {fmt!r} version {version!r} is not {FORMAT!r} "
            f"version {' or '.join(map(str, READABLE_VERSIONS))}"
        )
    if version >= 2 and meta.get(META_CHECKSUM) != meta_digest(meta):
        raise CheckpointError(
            f"{meta_path} is corrupt: its contents do not match its {META_CHECKSUM}"
        )
    return meta


def stream_crc(f: BinaryIO, block: int = 16 << 20) -> int:
    """CRC-32 of an open file from its start, read in blocks."""
    f.seek(0)
    crc = 0
    while chunk := f.read(block):
        crc = zlib.crc32(chunk, crc)
    return crc


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
