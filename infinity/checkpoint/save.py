"""``infinity.save_checkpoint``: stream chunks to disk, then swap directories atomically.

Chunks are written one at a time straight from their homes (host memory or
NVMe through a staging slot), so saving never holds the model in RAM. Files go
to a temporary sibling directory, are fsync'ed, and replace the old checkpoint
by rename: an interrupted save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

from torch import nn

from infinity.checkpoint.format import FORMAT, META, OPTIM_FILE, PARAM_FILE, VERSION, fsync_dir
from infinity.chunks.homes import Kind
from infinity.offload import engine_of, engine_of_param
from infinity.runtime.engine import OffloadEngine


def _stream(
    engine: OffloadEngine, kind: Kind, chunks: list[int], file: Path
) -> tuple[dict[int, int], dict[str, int]]:
    """Write ``chunks`` of ``kind`` back to back; returns file offset per chunk and size/CRC."""
    offsets: dict[int, int] = {}
    crc = 0
    position = 0
    with open(file, "wb") as f:
        for chunk in chunks:
            region, copy = engine.manager.open_host((kind, chunk), writable=False)
            try:
                data = memoryview(region.numpy())
                f.write(data)
                crc = zlib.crc32(data, crc)
            finally:
                engine.manager.close_host(copy, modified=False)
            offsets[chunk] = position
            position += len(data)
        f.flush()
        os.fsync(f.fileno())
    return offsets, {"bytes": position, "crc32": crc}


def optimizer_groups(engine: OffloadEngine, optimizer) -> list[dict[str, Any]]:
    """Each group's JSON-able hyper-parameters and the names of its parameters."""
    groups = []
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            if engine_of_param(p) is not engine:
                raise ValueError("the optimizer holds parameters that are not in this model")
            names.append(engine.registry.entries[p._infinity_index].name)
        hyper = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))
        }
        groups.append({"hyper": hyper, "params": names})
    return groups


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer=None) -> Path:
    """Write ``model`` (and ``optimizer``'s state) to the directory ``path``, atomically."""
    engine = engine_of(model)
    engine.synchronize()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        layout = engine.layout
        all_chunks = list(range(layout.num_chunks))
        trainable = [i for i in all_chunks if layout.chunks[i].trainable]
        param_at, param_info = _stream(engine, Kind.PARAM, all_chunks, tmp / PARAM_FILE)
        optim_at, optim_info = _stream(engine, Kind.OPTIM, trainable, tmp / OPTIM_FILE)
        tensors = []
        for entry in engine.registry.entries:
            slot = layout.slots[entry.index]
            tensors.append(
                {
                    "name": entry.name,
                    "aliases": entry.aliases,
                    "shape": list(slot.shape),
                    "trainable": entry.trainable,
                    "param_offset": param_at[slot.chunk] + slot.offset * engine.plan.element_size,
                    "optim_offset": optim_at.get(slot.chunk),
                    "chunk_capacity": layout.chunks[slot.chunk].capacity,
                    "element_offset": slot.offset,
                    "step": engine.tensor_steps[entry.index],
                }
            )
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": engine.config.dtype,
            "has_master": engine.plan.has_master,
            "step_count": engine.step_count,
            "tensors": tensors,
            "files": {PARAM_FILE: param_info, OPTIM_FILE: optim_info},
            "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
            "optimizer": optimizer_groups(engine, optimizer) if optimizer is not None else None,
        }
        with open(tmp / META, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        _replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            return False  # filesystem or kernel without exchange
        raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")
    return True


def _replace(new: Path, target: Path) -> None:
    """Put ``new`` at ``target``; an older checkpoint there is removed only afterwards.

    NOTE: with an exchange the swap is one atomic step; without one, the old
    checkpoint moves aside first and is put back if anything (Ctrl-C included)
    stops the second rename, so ``target`` never ends up missing.
    """
    if not target.exists():
        os.rename(new, target)
        fsync_dir(target.parent)
        return
    if _exchange(new, target):
        fsync_dir(target.parent)
        shutil.rmtree(new, ignore_errors=True)  # now holds the old checkpoint
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
