"""``infinity.load_checkpoint``: check the whole checkpoint, then stream it into the chunks.

All or nothing: the first pass checks ``meta.json`` (its checksum, every
field's type and range, every byte range inside its file), that it matches the
model and optimizer, and every data file's CRC-32 — without touching either.
Only then does the second pass read the tensors, found by name, straight into
their chunk regions (host homes, or staging slots written to NVMe), chunk by
chunk, so loading never holds the model in RAM and works across chunk layouts.
Both passes read the same open files, so a checkpoint replaced in between
(a new save renames over it) cannot mix in. Only JSON and raw bytes are read:
nothing is unpickled.

Optimizer parameter groups are saved (:func:`optimizer_groups`) as their
JSON-able hyper-parameters and the names of their parameters. On load every
saved value must have the type of the value it replaces (a number for ``lr``, a
pair of numbers for ``betas``, ...) and, for an infinity optimizer
(:class:`~infinity.optim.CPUOptimizer`), the range its constructor accepts, so
``lr: "fast"`` is refused at load rather than failing at the next step.
"""

from __future__ import annotations

import io
import os
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from infinity.checkpoint.format import (
    DATA_FILES,
    META,
    OPTIM_FILE,
    PARAM_FILE,
    CheckpointError,
    CheckpointMeta,
    SavedGroup,
    finite_number,
    parse_meta,
    read_meta,
)
from infinity.core.names import Kind
from infinity.offload import engine_of
from infinity.optim.front_end import CPUOptimizer
from infinity.optim.offloaded import param_slot
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.model_chunks import Window


def _read_into(f: io.BufferedReader, offset: int, dst: torch.Tensor) -> None:
    """Fill the uint8 tensor ``dst`` from byte ``offset`` of file ``f``."""
    f.seek(offset)
    view = dst.numpy()
    got = f.readinto(view.data)
    if got != view.nbytes:
        raise CheckpointError(
            f"{f.name}: short read at offset {offset} ({got} of {view.nbytes} bytes)"
        )


def _match(engine: OffloadEngine, meta: CheckpointMeta) -> None:
    if meta.dtype != engine.config.dtype:
        raise CheckpointError(
            f"checkpoint was written with dtype={meta.dtype!r} but the model is offloaded "
            f"with dtype={engine.config.dtype!r}; offload with the checkpoint's dtype"
        )
    stored = engine.chunk_optimizer.state_format.name
    if meta.optimizer_state_dtype != stored:
        raise CheckpointError(
            f"checkpoint stores optimizer states as {meta.optimizer_state_dtype!r} but the model "
            f"is offloaded with optimizer_state_dtype={stored!r}; offload with "
            f"optimizer_state_dtype={meta.optimizer_state_dtype!r} (to convert, load it so and "
            "move the states through the optimizer's state_dict() / load_state_dict())"
        )
    problems = []
    for entry in engine.registry.entries:
        rec = meta.tensors.get(entry.name)
        if rec is None:
            problems.append(f"{entry.name}: not in checkpoint")
        elif rec.shape != entry.shape:
            problems.append(
                f"{entry.name}: shape {rec.shape} in checkpoint, {entry.shape} in model"
            )
        elif entry.trainable and not rec.trainable:
            problems.append(f"{entry.name}: frozen in checkpoint, trainable in model")
    if problems:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(problems[:10]))


def _open_data(
    stack: ExitStack, target: Path, meta: CheckpointMeta, verify: bool
) -> dict[str, io.BufferedReader]:
    """Open the data files once for both passes; check sizes (and CRCs with ``verify``)."""
    files: dict[str, io.BufferedReader] = {}
    for name in DATA_FILES:
        path = target / name
        size, crc = meta.files[name]
        try:
            f = stack.enter_context(open(path, "rb"))
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise CheckpointError(f"{path} is truncated or padded: {actual} bytes, not {size}")
            if verify and stream_crc(f) != crc:
                raise CheckpointError(f"{path} is corrupt (CRC-32 mismatch)")
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
        files[name] = f
    return files


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
) -> dict:
    """Restore parameters, fp32 masters, moments and step counts (and optimizer
    hyper-parameters) from ``path``; returns the checkpoint's metadata.

    Everything is checked before the model or optimizer is changed, so a
    :class:`CheckpointError` leaves both exactly as they were. ``verify``
    checks every data file's CRC-32 as part of that (one sequential read);
    without it only the metadata and file sizes are checked.
    """
    engine = engine_of(model)
    if not engine.world.sharded:
        return _load(Path(path), engine, optimizer, verify)
    engine.collectives.align("load_checkpoint")
    # NOTE: sharded, every rank reads the checkpoint (on a filesystem they all
    # see) and keeps its shard: no collective inside, so they agree at the end.
    error: BaseException | None = None
    try:
        raw = _load(Path(path), engine, optimizer, verify)
    except BaseException as exc:  # reported to every rank, then re-raised
        error = exc
    if engine.collectives.any(error is not None, f"loading checkpoint {path}"):
        if error is not None:
            raise error
        raise CheckpointError(
            f"another rank could not load checkpoint {path} (its error says why); load it "
            "again on every rank before training on"
        )
    return raw


def _load(
    target: Path, engine: OffloadEngine, optimizer: torch.optim.Optimizer | None, verify: bool
) -> dict:
    """:func:`load_checkpoint` in one process (every rank of a sharded model alike)."""
    raw = read_meta(target)
    meta = parse_meta(raw, engine.chunk_optimizer)
    _match(engine, meta)
    updates: list[tuple[dict[str, Any], dict[str, Any]]] = []
    if optimizer is not None and meta.optimizer is not None:
        updates = hyper_updates(engine, optimizer, meta.optimizer)
    with ExitStack() as stack:
        files = _open_data(stack, target, meta, verify)
        # --- everything is checked: from here on the model changes ---
        engine.synchronize()
        _write_chunks(engine, meta, files[PARAM_FILE], files[OPTIM_FILE])
        _write_tensor_states(engine, meta, files[OPTIM_FILE])
    engine.chunks.mark_set(e.index for e in engine.registry.entries)
    for entry in engine.registry.entries:
        if entry.trainable:
            engine.chunks.tensor_steps[entry.index] = meta.tensors[entry.name].step
    engine.ledger.reset()
    engine.pipeline.step_count = meta.step_count
    if engine.scaler is not None and meta.loss_scaler is not None:
        engine.scaler.load_state_dict(meta.loss_scaler)
    for group, values in updates:
        group.update(values)
    return raw


def _write_chunks(
    engine: OffloadEngine, meta: CheckpointMeta, fp: io.BufferedReader, fo: io.BufferedReader
) -> None:
    """Second pass: read every tensor into its chunk, window by window (the whole chunk,
    or an oversize chunk's spans: staging stays chunk-sized)."""
    chunk_io = engine.chunk_io
    optimizer, has_master = engine.chunk_optimizer, chunk_io.has_master
    esize = chunk_io.element_size
    for spec in chunk_io.chunk_specs:
        chunk = spec.index
        kinds = [Kind.PARAM, Kind.OPTIM] if spec.trainable else [Kind.PARAM]
        for kind in kinds:
            for window in _windows(engine, kind, chunk):
                at, parts = window.start, window.parts
                for entry in engine.chunks.chunk_members[chunk]:
                    slot = chunk_io.slot(entry.index)
                    where = window.overlap(slot.offset, slot.numel)
                    if where is None:
                        continue
                    rec = meta.tensors[entry.name]
                    into, here, n = where[0].start, where[1].start, where[1].stop - where[1].start
                    if kind is Kind.PARAM:
                        dst = parts[0][here * esize : (here + n) * esize]
                        _read_into(fp, rec.param_offset + into * esize, dst)
                        continue
                    assert rec.optim_offset is not None  # _match: trainable in the checkpoint too
                    # The same pieces (master, each slot's values and int8
                    # scales) in the checkpoint's layout and in this window's: the
                    # stored bytes are copied.
                    saved = optimizer.tensor_ranges(
                        rec.chunk_capacity, has_master, rec.element_offset + into, n
                    )
                    width = window.end - at
                    inside = optimizer.tensor_ranges(width, has_master, here, n)
                    whole = optimizer.tensor_ranges(width, has_master, 0, width)
                    for part, (src, size), (offset, _n), (base, _w) in zip(
                        parts, saved, inside, whole, strict=True
                    ):
                        dst = part[offset - base : offset - base + size]
                        _read_into(fo, rec.optim_offset + src, dst)
            if kind is Kind.PARAM:
                chunk_io.params_written(chunk)


def _windows(engine: OffloadEngine, kind: Kind, chunk: int) -> Iterator[Window]:
    """Each window of ``(kind, chunk)`` opened for writing (not
    read first; see :func:`infinity.chunks.pieces.windows`), zeroed (padding too, so
    the stored bytes never depend on what a staging slot held). A window is stored
    when the next one is drawn."""
    for window in engine.chunk_io.windows(kind, chunk, load=False, write=True):
        for part in window.parts:
            part.zero_()
        yield window


def _write_tensor_states(
    engine: OffloadEngine, meta: CheckpointMeta, fo: io.BufferedReader
) -> None:
    """Read every trainable tensor's per-tensor optimizer states (``parse_meta``
    checked they are exactly the optimizer's; see NOTE [per-tensor optimizer state])."""
    for entry in engine.registry.entries:
        if not entry.trainable:
            continue
        offsets = meta.tensors[entry.name].tensor_state
        for name, value in engine.chunks.tensor_state(entry.index).items():
            _read_into(fo, offsets[name], value.view(-1).view(torch.uint8))


def stream_crc(f: BinaryIO, block: int = 16 << 20) -> int:
    """CRC-32 of an open file from its start, read in blocks."""
    f.seek(0)
    crc = 0
    while chunk := f.read(block):
        crc = zlib.crc32(chunk, crc)
    return crc


_ABSENT = object()


def _param_names(engine: OffloadEngine, group: dict[str, Any], error: type[Exception]) -> list[str]:
    """The names of a param group's parameters; ``error`` if one is not in this model."""
    names = []
    for p in group["params"]:
        slot = param_slot(p)
        if slot is None or slot.engine is not engine:
            raise error("the optimizer holds parameters that are not in this model")
        names.append(engine.registry.entries[slot.tensor_index].name)
    return names


def optimizer_groups(
    engine: OffloadEngine, optimizer: torch.optim.Optimizer
) -> list[dict[str, Any]]:
    """Each group's JSON-able hyper-parameters and the names of its parameters."""
    groups = []
    for group in optimizer.param_groups:
        names = _param_names(engine, group, ValueError)
        hyper = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))
        }
        groups.append({"hyper": hyper, "params": names})
    return groups


def _value(what: str, saved: Any, current: Any) -> Any:
    """``saved`` converted to the kind of ``current``; CheckpointError if it is not one."""
    if isinstance(current, bool):
        ok = type(saved) is bool
    elif isinstance(current, (int, float)) or torch.is_tensor(current):
        ok = finite_number(saved)
    elif isinstance(current, tuple):
        # An item may be null (Adafactor's eps=(None, 1e-3)); the optimizer's
        # own check (hyper_of, below) says whether it may be.
        ok = (
            isinstance(saved, list)
            and len(saved) == len(current)
            and all(x is None or finite_number(x) for x in saved)
        )
        saved = tuple(saved) if ok else saved
    elif isinstance(current, str):
        ok = isinstance(saved, str)
    elif current is None:
        ok = saved is None or type(saved) is bool
    else:  # a key the group lacks (e.g. a scheduler's initial_lr): plain JSON only
        ok = (
            saved is None
            or isinstance(saved, (bool, str))
            or finite_number(saved)
            or (isinstance(saved, list) and all(finite_number(x) for x in saved))
        )
        saved = tuple(saved) if isinstance(saved, list) else saved
    if not ok:
        kind = "absent" if current is _ABSENT else f"{type(current).__name__} {current!r}"
        raise CheckpointError(
            f"{META} is invalid: optimizer {what} is {saved!r}; the optimizer's value is {kind}"
        )
    return saved


def hyper_updates(
    engine: OffloadEngine, optimizer: torch.optim.Optimizer, saved: list[SavedGroup]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(group, new values)`` for each of ``optimizer``'s groups, all checked; nothing is set."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(saved)} optimizer parameter groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    updates = []
    for g, (entry, group) in enumerate(zip(saved, optimizer.param_groups, strict=True)):
        names = _param_names(engine, group, CheckpointError)
        if names != entry.params:
            missing = [n for n in entry.params if n not in set(names)]
            extra = [n for n in names if n not in set(entry.params)]
            differ = (
                f"; only the checkpoint's holds {', '.join(map(repr, missing[:3]))}"
                if missing
                else ""
            ) + (
                f"; only the optimizer's holds {', '.join(map(repr, extra[:3]))}" if extra else ""
            ) or "; the same parameters in another order"
            raise CheckpointError(
                f"optimizer parameter group {g} holds other parameters than in the checkpoint "
                f"({len(names)} against {len(entry.params)}{differ}): construct the optimizer "
                "over the parameters it was saved with (a parameter frozen or unfrozen since "
                "changes them)"
            )
        values = {
            key: _value(f"group {g} {key!r}", value, group.get(key, _ABSENT))
            for key, value in entry.hyper.items()
            if key != "params"
        }
        if isinstance(optimizer, CPUOptimizer):
            try:
                optimizer.hyper_of({**group, **values})
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{META}: optimizer group {g}: {exc}") from None
        updates.append((group, values))
    return updates
