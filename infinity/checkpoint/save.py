"""``infinity.save_checkpoint``: stream chunks to disk, then swap directories atomically.

Chunks are written one at a time straight from their homes (host memory or
NVMe through a staging slot), so saving never holds the model in RAM. Files go
to a temporary sibling directory, are fsync'ed, and replace the old checkpoint
by rename (:func:`~infinity.checkpoint.temporaries.replace_dir`): an
interrupted save leaves the previous checkpoint intact. The temporaries carry
the saving process's PID (``checkpoint/temporaries.py``); a save removes those
left by processes that died mid-save.
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.checkpoint import temporaries
from infinity.checkpoint.format import (
    FORMAT,
    META,
    OPTIM_FILE,
    PARAM_FILE,
    VERSION,
    CheckpointError,
    dump_meta,
    fsync_dir,
)
from infinity.checkpoint.load import optimizer_groups
from infinity.core.names import Kind
from infinity.distributed.agreement import rank_zero_writes
from infinity.io.request import NVMeIOError
from infinity.offload import engine_of
from infinity.runtime.engine import OffloadEngine

TailKey = tuple[int, str]  # (tensor index, per-tensor state name)


def _stream(
    engine: OffloadEngine,
    kind: Kind,
    chunks: list[int],
    file: Path | None,
    tail: list[tuple[TailKey, torch.Tensor]] | None = None,
) -> tuple[dict[Any, int], dict[str, int]]:
    """Write ``chunks`` of ``kind`` back to back, then the fp32 tensors of ``tail``
    (per-tensor optimizer states); returns the file offset per chunk and per tail
    key, and size/CRC.

    ``file=None``: a rank other than 0 of a sharded model, which only takes part
    in gathering each whole chunk (rank 0 writes it).

    NOTE: sharded, every rank must take part in every chunk's gather, so rank 0
    keeps gathering after a failed write (a full disk) and raises at the end;
    otherwise the other ranks would wait in a gather it never joins.
    """
    offsets: dict[Any, int] = {}
    crc = 0
    position = 0
    failed: OSError | None = None
    f = None
    try:
        if file is not None:
            try:
                f = open(file, "wb")  # closed below, also after a failed write
            except OSError as exc:
                if not engine.world.sharded:
                    raise
                failed = exc
        pieces: list[tuple[Any, Iterator[memoryview]]]
        pieces = [(chunk, _chunk_bytes(engine, kind, chunk)) for chunk in chunks]
        pieces += [(key, _tensor_bytes(value)) for key, value in tail or []]
        for key, datas in pieces:
            offsets[key] = position
            for data in datas:
                if f is None or failed is not None:
                    continue
                try:
                    f.write(data)
                except OSError as exc:
                    if not engine.world.sharded:
                        raise
                    failed = exc
                crc = zlib.crc32(data, crc)
                position += len(data)
        if failed is not None:
            raise failed
        if f is not None:
            f.flush()
            os.fsync(f.fileno())
    finally:
        if f is not None:
            f.close()
    return offsets, {"bytes": position, "crc32": crc}


def _tensor_bytes(value: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of an fp32 tensor, in C order."""
    yield memoryview(value.to(torch.float32).contiguous().view(-1).numpy().data).cast("B")


def _tensor_states(engine: OffloadEngine) -> list[tuple[TailKey, torch.Tensor]]:
    """Every trainable tensor's per-tensor optimizer states (none for most optimizers).

    See NOTE [per-tensor optimizer state]: they follow the units in ``optim.bin``.
    """
    out = []
    for entry in engine.registry.entries:
        if entry.trainable:
            for name, value in engine.chunks.tensor_state(entry.index).items():
                out.append(((entry.index, name), value))
    return out


def _chunk_bytes(engine: OffloadEngine, kind: Kind, chunk: int) -> Iterator[memoryview]:
    """The home bytes of ``(kind, chunk)`` in order: each piece of a unit (the master,
    each slot's values and int8 scales) whole, one after the other, a whole chunk's
    padding included (see :func:`infinity.chunks.pieces.home_bytes`)."""
    for data in engine.chunk_io.home_bytes(kind, chunk):
        yield memoryview(data.numpy().data)


def write_checkpoint(
    directory: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Write the checkpoint files into the existing empty ``directory`` and fsync them.

    No rename: the caller makes the directory visible once it is complete.
    Sharded, this is collective: rank 0 writes and passes the ``directory``, the
    other ranks pass ``None`` and only take part in gathering each chunk.
    """
    engine = engine_of(model)
    engine.synchronize()
    specs = engine.chunk_io.chunk_specs
    all_chunks = list(range(len(specs)))
    trainable = [spec.index for spec in specs if spec.trainable]
    if directory is None:
        _stream(engine, Kind.PARAM, all_chunks, None)
        _stream(engine, Kind.OPTIM, trainable, None)
        return
    groups = optimizer_groups(engine, optimizer) if optimizer is not None else None
    param_at, param_info = _stream(engine, Kind.PARAM, all_chunks, directory / PARAM_FILE)
    optim_at, optim_info = _stream(
        engine, Kind.OPTIM, trainable, directory / OPTIM_FILE, _tensor_states(engine)
    )
    io = engine.chunk_io
    tensors = []
    for entry in engine.registry.entries:
        slot = io.slot(entry.index)
        tensors.append(
            {
                "name": entry.name,
                "aliases": entry.aliases,
                "shape": list(slot.shape),
                "trainable": entry.trainable,
                "param_offset": param_at[slot.chunk] + slot.offset * io.element_size,
                "optim_offset": optim_at.get(slot.chunk),
                "chunk_capacity": io.chunk_specs[slot.chunk].capacity,
                "element_offset": slot.offset,
                "step": engine.chunks.tensor_steps[entry.index],
            }
        )
        # The per-tensor states' offsets (keyed by (tensor index, name), chunks by int).
        states = {
            key[1]: at
            for key, at in optim_at.items()
            if isinstance(key, tuple) and key[0] == entry.index
        }
        if states:
            tensors[-1]["tensor_state"] = states
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": engine.config.dtype,
        "has_master": io.has_master,
        "optimizer_state_dtype": engine.chunk_optimizer.state_format.name,
        "chunk_optimizer": {
            "name": engine.chunk_optimizer.name,
            "front_end": engine.chunk_optimizer.front_end,
            "state_slots": list(engine.chunk_optimizer.state_slots),
        },
        "step_count": engine.pipeline.step_count,
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
    engine = engine_of(model)
    engine.chunks.require_set(engine.registry.entries, "saving a checkpoint")
    if engine.world.sharded:
        engine.collectives.align("save_checkpoint")
        return _save_sharded(target, model, optimizer, engine)
    _write_or_remove(_prepare(target), target, model, optimizer)
    return target


def _save_sharded(
    target: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, engine: OffloadEngine
) -> Path:
    """Collective: every rank gathers each whole chunk, rank 0 writes the checkpoint, and
    every rank returns only once it is complete, or raises if a rank failed.

    The checkpoint holds whole chunks, as a single process's does: it
    loads at any world size (each rank keeps its shard of what it reads).
    """

    def write(tmp: Path | None) -> None:
        if tmp is None:
            write_checkpoint(None, model, optimizer)  # this rank only gathers
        else:
            _write_or_remove(tmp, target, model, optimizer)

    rank_zero_writes(
        engine.collectives,
        f"save checkpoint {target}",
        lambda: _prepare(target),
        write,
        before="nothing was written",
        after="the previous checkpoint there, if any, is unchanged",
        error_type=CheckpointError,
    )
    return target


def _prepare(target: Path) -> Path:
    """The empty temporary directory a checkpoint at ``target`` is written into."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporaries.reclaim(target.parent)
    tmp = temporaries.temp_path(target.parent, target.name)
    tmp.mkdir()
    return tmp


def _write_or_remove(
    tmp: Path, target: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Write the checkpoint into ``tmp`` and swap it in at ``target``, or remove ``tmp``."""
    try:
        write_checkpoint(tmp, model, optimizer)
        temporaries.replace_dir(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # An OSError is raised again with the checkpoint named (the same errno). An
        # NVMeIOError from the engine already names chunk, file and offset, and
        # callers catch it by type: it passes through unchanged.
        if not isinstance(exc, OSError) or exc.errno is None or isinstance(exc, NVMeIOError):
            raise
        message = f"cannot save checkpoint {target}: {exc.strerror or exc}"
        raise OSError(exc.errno, message) from exc
