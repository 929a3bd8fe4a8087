"""``infinity.save_checkpoint``: stream chunks to disk, then swap directories atomically.

Chunks are written one at a time straight from their homes (host memory or
NVMe through a staging slot), so saving never holds the model in RAM. Files go
to a temporary sibling directory, are fsync'ed, and replace the old checkpoint
by rename: an interrupted save leaves the previous checkpoint intact. The
temporaries carry the saving process's PID (``checkpoint/temporaries.py``); a
save removes those left by processes that died mid-save.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from infinity.checkpoint import temporaries
from infinity.checkpoint.format import (
    FORMAT,
    META,
    OPTIM_FILE,
    PARAM_FILE,
    VERSION,
    dump_meta,
    fsync_dir,
)
from infinity.checkpoint.optimizer_groups import optimizer_groups
from infinity.chunks.homes import Kind
from infinity.chunks.span_access import each_span
from infinity.chunks.spans import SpanKey, is_split, part_ranges, span_ranges
from infinity.io.errors import NVMeIOError
from infinity.offload import engine_of
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
            offsets[chunk] = position
            for data in _chunk_bytes(engine, kind, chunk):
                f.write(data)
                crc = zlib.crc32(data, crc)
                position += len(data)
        f.flush()
        os.fsync(f.fileno())
    return offsets, {"bytes": position, "crc32": crc}


def _chunk_bytes(engine: OffloadEngine, kind: Kind, chunk: int) -> Iterator[memoryview]:
    """The home bytes of ``(kind, chunk)`` in order, whole or (oversize) span by span."""
    if not is_split(engine.plan, chunk):
        region, copy = engine.manager.open_whole((kind, chunk), writable=False)
        try:
            yield memoryview(region.numpy().data)
        finally:
            engine.manager.close_whole(copy, modified=False)
        return
    # NOTE: the file holds the home's bytes in order: each piece of a unit (the
    # master, each slot's values and int8 scales) whole, one after the other;
    # a span holds a slice of every piece, so a unit's spans are read once per
    # piece. Oversize capacities are multiples of the span granule, so the home
    # has no padding between its pieces.
    capacity = engine.layout.chunks[chunk].capacity
    first = span_ranges(engine.plan, chunk)[0]
    pieces = len(part_ranges(engine.plan, SpanKey(kind, chunk, *first)))
    for piece in range(pieces):
        for _at, views in each_span(engine.manager, kind, chunk, 0, capacity):
            yield memoryview(views[piece].numpy().data)


def write_checkpoint(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Write the checkpoint files into the existing empty ``directory`` and fsync them.

    No rename: the caller makes the directory visible once it is complete.
    """
    engine = engine_of(model)
    engine.synchronize()
    layout = engine.layout
    all_chunks = list(range(layout.num_chunks))
    trainable = [i for i in all_chunks if layout.chunks[i].trainable]
    groups = optimizer_groups(engine, optimizer) if optimizer is not None else None
    param_at, param_info = _stream(engine, Kind.PARAM, all_chunks, directory / PARAM_FILE)
    optim_at, optim_info = _stream(engine, Kind.OPTIM, trainable, directory / OPTIM_FILE)
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
        "optimizer_state_dtype": engine.chunk_optimizer.state_format.name,
        "step_count": engine.step_count,
        "tensors": tensors,
        "files": {PARAM_FILE: param_info, OPTIM_FILE: optim_info},
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "optimizer": groups,
    }
    dump_meta(meta, directory / META)
    fsync_dir(directory)


def save_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> Path:
    """Write ``model`` (and ``optimizer``'s state) to the directory ``path``, atomically.

    On any error (a full disk included) the temporary is removed and the
    previous checkpoint at ``path``, if any, is left as it was.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporaries.reclaim(target.parent)
    tmp = temporaries.temp_path(target.parent, target.name)
    tmp.mkdir()
    try:
        write_checkpoint(tmp, model, optimizer)
        _replace(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # NOTE: an NVMeIOError from the engine already names chunk, file and offset, and
        # callers catch it by type: it passes through unchanged.
        if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, NVMeIOError):
            # NOTE: same errno (so the same OSError subclass), with the checkpoint named.
            raise OSError(
                exc.errno, f"cannot save checkpoint {target}: {exc.strerror or exc}"
            ) from exc
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
    old = temporaries.temp_path(target.parent, target.name, temporaries.OLD)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
