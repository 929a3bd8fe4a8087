"""``infinity.save_pretrained``: write an offloaded model as a ``transformers`` checkpoint.

Parameters (in the compute dtype, as ``model.state_dict()`` shows them) and
persistent buffers are streamed chunk by chunk into safetensors shards —
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` — in a temporary directory next to the
target, fsync'ed, and swapped in by rename: an interrupted save leaves what
was there before. No more than one chunk is held in memory.

Sharded over several ranks (data parallel), the save is collective: every rank
takes part in gathering each chunk and rank 0 alone writes; a failed write
keeps gathering (no rank waits in a gather rank 0 never joins), and every rank
returns once the files are in place, or raises if rank 0 failed.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.checkpoint.format import fsync_dir
from infinity.checkpoint.temporaries import replace_dir
from infinity.distributed.agreement import rank_zero_writes
from infinity.offload import engine_of
from infinity.pretrained.adapters import LoraDelta, merged_names, peft_base
from infinity.pretrained.names import saved_names, state_names
from infinity.pretrained.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    PretrainedError,
    ShardWriter,
    TensorSpec,
)
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.params import ParamEntry
from infinity.runtime.state_access import param_bytes_by_chunk
from infinity.utils.sizes import parse_size

# Files of an earlier save that a new one may drop (fewer shards, no index).
WEIGHT_FILES = (INDEX_FILE, SINGLE_FILE)


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    max_shard_size: int | str = "2GiB",
    tokenizer: Any = None,
) -> Path:
    """Write ``model``'s weights to the directory ``path`` in the ``transformers`` layout.

    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads them back
    bit for bit (``config.json`` is written when the model has a ``transformers``
    config). A tied parameter is saved once, under the name ``transformers``
    keeps. Shards hold at most ``max_shard_size`` bytes (a larger tensor gets a
    shard of its own). ``tokenizer``, if given, is saved alongside
    (``tokenizer.save_pretrained``). An existing ``path`` is replaced
    atomically, but only if it holds nothing this save would not write again
    (an earlier save of the same kind): other files are never deleted.
    Sharded (data parallel), every rank must call it; rank 0 writes.

    A ``peft`` LoRA model is saved as its base model with the adapters merged in,
    as ``merge_and_unload().save_pretrained(path)`` would save it
    (:mod:`infinity.pretrained.adapters`); its adapter alone is peft's own
    ``model.save_pretrained(path)``.
    """
    engine = engine_of(model)
    files = _plan_files(model, engine, parse_size(max_shard_size, name="max_shard_size"))
    target = Path(path)
    if engine.world.sharded:
        return _save_sharded(model, engine, target, files, tokenizer)
    tmp = _prepare(target, tokenizer)
    values = param_bytes_by_chunk(engine, files.entries)
    try:
        _write_or_remove(model, engine, tmp, target, files, values, tokenizer)
    finally:
        values.close()
    return target


@dataclass
class _Files:
    """What a save writes: the parameters in chunk order, their names, the buffers,
    and the tensors of each file."""

    entries: list[ParamEntry]
    chosen: dict[int, str]  # tensor index -> saved name
    buffers: dict[str, torch.Tensor]
    names: list[str]
    shards: list[list[TensorSpec]]
    owner: nn.Module  # whose configs are saved (a peft model's base)
    deltas: dict[int, LoraDelta]  # tensor index -> the LoRA delta merged into it


def _plan_files(model: nn.Module, engine: OffloadEngine, limit: int) -> _Files:
    base = peft_base(model)
    merged = merged_names(model, base, engine) if base is not None else None
    owner = base if base is not None else model
    names = merged.names if merged is not None else state_names(model)
    chosen = {
        engine.registry.by_id[key].index: name for key, name in saved_names(owner, names).items()
    }
    slot = engine.chunk_io.slot
    entries = sorted(
        (engine.registry.entries[i] for i in chosen),
        key=lambda e: (slot(e.index).chunk, slot(e.index).offset),
    )
    buffers = {
        name: buffer
        for name, (m, key) in names.buffers.items()
        if (buffer := m._buffers[key]) is not None
    }
    specs = [TensorSpec(chosen[e.index], engine.dtype, e.shape) for e in entries]
    specs += [TensorSpec(name, b.dtype, tuple(b.shape)) for name, b in buffers.items()]
    shards = _split(specs, limit)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    deltas = merged.deltas if merged is not None else {}
    return _Files(entries, chosen, buffers, files, shards, owner, deltas)


def _prepare(target: Path, tokenizer: Any) -> Path:
    """The temporary directory next to ``target`` the save is written into."""
    if tokenizer is None:  # fail before writing anything when the outcome is known
        _refuse_foreign(target, {"config.json", "generation_config.json"})
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


def _write_or_remove(
    model: nn.Module,
    engine: OffloadEngine,
    tmp: Path,
    target: Path,
    files: _Files,
    values: Iterator[tuple[ParamEntry, memoryview]],
    tokenizer: Any,
) -> None:
    """Write everything into ``tmp``, fsync it and swap it in at ``target``; or, if
    anything fails, remove ``tmp``."""
    try:
        _write_shards(tmp, files, values)
        if len(files.shards) > 1:
            placed = zip(files.names, files.shards, strict=True)
            index = {
                "metadata": {"total_size": sum(s.nbytes for shard in files.shards for s in shard)},
                "weight_map": {s.name: f for f, shard in placed for s in shard},
            }
            with open(tmp / INDEX_FILE, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.write("\n")
        _save_configs(files.owner, tmp, engine.dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _refuse_foreign(target, {p.name for p in tmp.iterdir()})
        for file in tmp.iterdir():
            _fsync_file(file)
        fsync_dir(tmp)
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_sharded(
    model: nn.Module, engine: OffloadEngine, target: Path, files: _Files, tokenizer: Any
) -> Path:
    """:func:`save_pretrained` of a sharded model: collective, rank 0 writes."""
    engine.collectives.align("save_pretrained")

    def write(tmp: Path | None) -> None:
        values = param_bytes_by_chunk(engine, files.entries)
        try:
            if tmp is not None:
                _write_or_remove(model, engine, tmp, target, files, values, tokenizer)
        finally:
            # NOTE: every rank takes part in every chunk's gather, whatever rank 0's
            # writes did (a generator that raised is finished: nothing left to drain).
            for _item in values:
                pass

    rank_zero_writes(
        engine.collectives,
        f"save '{target}'",
        lambda: _prepare(target, tokenizer),
        write,
        before="nothing was written",
        after=f"what was at '{target}' before, if anything, is unchanged",
        error_type=PretrainedError,
    )
    return target


def _save_configs(model: nn.Module, directory: Path, dtype: torch.dtype) -> None:
    """``config.json`` (and ``generation_config.json``) of a ``transformers`` model."""
    for attr in ("config", "generation_config"):
        extra = getattr(model, attr, None)
        if extra is None or not callable(getattr(extra, "save_pretrained", None)):
            continue
        if attr == "config":
            # transformers loads weights in the dtype config.json names; name
            # the dtype the files hold, as its own save_pretrained does.
            extra = copy.deepcopy(extra)
            extra.dtype = dtype
        extra.save_pretrained(directory)


def _refuse_foreign(target: Path, written: set[str]) -> None:
    """Raise if replacing ``target`` would delete what this save does not write again."""
    if not target.exists():
        return
    foreign = (
        sorted(
            name
            for name in (p.name for p in target.iterdir())
            if name not in written
            and name not in WEIGHT_FILES
            and not (name.startswith("model-") and name.endswith(".safetensors"))
        )
        if target.is_dir()
        else [target.name]
    )
    if foreign:
        raise PretrainedError(
            f"'{target}' already holds {', '.join(foreign[:5])}, which replacing it would "
            "delete; save to a new directory (pass tokenizer= to save a tokenizer with it)"
        )


def _split(specs: list[TensorSpec], limit: int) -> list[list[TensorSpec]]:
    """Consecutive runs of tensors of at most ``limit`` bytes each (never empty)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _write_shards(
    tmp: Path, files: _Files, values: Iterator[tuple[ParamEntry, memoryview]]
) -> None:
    """Stream every shard's tensors in order: parameters from the chunks (``values``,
    in chunk order), then buffers."""
    for file, shard in zip(files.names, files.shards, strict=True):
        writer = ShardWriter(tmp / file, shard)
        try:
            for spec in shard:
                if spec.name in files.buffers:
                    tensor = files.buffers[spec.name].detach().cpu().contiguous().view(-1)
                    writer.write(spec.name, tensor.view(torch.uint8).numpy().data)
                    continue
                entry, data = next(values)
                assert files.chosen[entry.index] == spec.name
                delta = files.deltas.get(entry.index)
                if delta is not None:  # peft's merge: W += delta (fp32), rounded once
                    weight = torch.frombuffer(data, dtype=spec.dtype).view(spec.shape)
                    merged = (weight.float() + delta.value()).to(spec.dtype)
                    data = merged.view(-1).view(torch.uint8).numpy().data
                writer.write(spec.name, data)
        except BaseException:
            writer.abort()
            raise
        writer.close()


def _fsync_file(file: Path) -> None:
    if file.is_dir():
        for inner in file.iterdir():
            _fsync_file(inner)
        fsync_dir(file)
        return
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
