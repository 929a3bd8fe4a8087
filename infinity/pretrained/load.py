"""``infinity.load_pretrained``: stream a safetensors checkpoint into an offloaded model.

Everything is checked against the file headers before a byte is written (a
strict load that would fail leaves the model untouched). Values then go chunk
by chunk straight into the chunks' homes — host memory, or NVMe through a
staging slot — in pieces of one read block, converted to the compute dtype
(and to the fp32 master for 16-bit training), so peak memory is the budgets
plus one block, whatever the checkpoint's size.

Sharded over several ranks (data parallel), every rank reads the files itself
(they must be on a filesystem every rank sees) and keeps its shard of each
chunk, reading only the tensors that overlap it; nothing is exchanged but the
outcome, agreed after the checks and at the end
(:func:`infinity.distributed.agreement.agree`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from infinity.config import Config
from infinity.distributed import Collectives, resolve_world
from infinity.distributed.agreement import agree
from infinity.offload import engine_of, offload
from infinity.pretrained.names import StateNames, ignore_patterns, match_prefix, state_names
from infinity.pretrained.safetensors_io import (
    PretrainedError,
    RangeReader,
    TensorRecord,
    checkpoint_tensors,
)
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.materialize import InitFn
from infinity.runtime.params import is_placeholder
from infinity.runtime.state_access import stream_params_in


class LoadResult(NamedTuple):
    """Keys that did not match, as ``load_state_dict`` reports them (plus shapes)."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_keys: list[str]  # "name: checkpoint (a, b) vs model (c, d)"


@dataclass
class Matched:
    """Which checkpoint tensor goes where: parameters by ``id``, buffers by name."""

    names: StateNames
    params: dict[int, TensorRecord]
    buffers: dict[str, TensorRecord]
    result: LoadResult


def match_checkpoint(model: nn.Module, path: str | os.PathLike[str], strict: bool) -> Matched:
    """Match the checkpoint's tensors to ``model``'s keys, from the headers alone;
    with ``strict`` any mismatch raises before anything is read."""
    records = checkpoint_tensors(path)
    names = state_names(model)
    known = set(names.params) | set(names.buffers)
    in_file = match_prefix(model, set(records), known)  # model key -> file key
    missing, mismatched = [], []
    params: dict[int, TensorRecord] = {}
    for key, group in names.names_of().items():
        present = [n for n in group if n in in_file]
        if not present:
            missing.extend(group)
            continue
        record = records[in_file[present[0]]]
        shape = tuple(names.params[group[0]].shape)
        if record.shape != shape:
            mismatched.append(_mismatch(record, shape))
        else:
            params[key] = record
    buffers: dict[str, TensorRecord] = {}
    for name, (module, attr) in names.buffers.items():
        if name not in in_file:
            missing.append(name)
            continue
        record = records[in_file[name]]
        shape = tuple(_buffer(module, attr).shape)
        if record.shape != shape:
            mismatched.append(_mismatch(record, shape))
        else:
            buffers[name] = record
    used = set(in_file.values())
    unexpected = _drop_ignored(sorted(k for k in records if k not in used), model, "unexpected")
    result = LoadResult(_drop_ignored(missing, model, "missing"), unexpected, mismatched)
    if strict and (result.missing_keys or unexpected or mismatched):
        raise PretrainedError(_report(type(model).__name__, str(path), result))
    return Matched(names, params, buffers, result)


def load_pretrained(
    model: nn.Module, path: str | os.PathLike[str], strict: bool = True
) -> LoadResult:
    """Load a safetensors checkpoint (a file, an index, or a ``transformers`` model
    directory, sharded or not) into the offloaded ``model``.

    Keys are matched like ``model.load_state_dict``, except that a tied
    parameter is loaded when any of its names is in the file (``transformers``
    drops the tied ``lm_head.weight``). With ``strict`` a missing, unexpected or
    mis-shaped key raises :class:`PretrainedError` before anything is written;
    otherwise the matching tensors are loaded, the others keep their values,
    and the lists come back as a :class:`LoadResult`. (Unlike torch, a
    mis-shaped tensor is skipped, not an error, when ``strict=False``.)
    Persistent buffers in the file are loaded too. As in ``transformers``, keys
    may carry or lack the model's ``base_model_prefix``, and keys the model
    declares ignorable (``_keys_to_ignore_on_load_unexpected`` / ``_missing``)
    are not reported.

    Sharded (data parallel), every rank must call it with the same ``path``
    (a filesystem every rank sees); a rank that fails makes every rank raise,
    naming it.
    """
    engine = engine_of(model)
    if not engine.world.sharded:
        matched = match_checkpoint(model, path, strict)
        with RangeReader() as reader:
            _load_matched(engine, reader, matched, matched.params)
        return matched.result
    collectives, what = engine.collectives, f"load '{path}'"
    error: BaseException | None = None
    try:
        matched = match_checkpoint(model, path, strict)
    except BaseException as exc:  # reported to every rank, then re-raised
        error = exc
    agree(collectives, error, what, "nothing was loaded on any rank", PretrainedError)
    try:
        with RangeReader() as reader:
            _load_matched(engine, reader, matched, matched.params)
    except BaseException as exc:
        error = exc
    after = "the model is partly loaded: load it again on every rank"
    agree(collectives, error, what, after, PretrainedError)
    return matched.result


# Builds the model under ``init_empty`` and says how to initialise what the checkpoint lacks.
Builder = Callable[[], tuple[nn.Module, InitFn | None]]


def offload_pretrained(
    build: Builder, path: str | os.PathLike[str], config: Config | None, *, strict: bool = True
) -> tuple[nn.Module, LoadResult]:
    """``offload`` the model ``build()`` returns (built under ``init_empty``) with the
    checkpoint as its initialisation: each chunk is written once, straight from
    the file (its fp32 masters from the file's values), instead of initialised and
    then overwritten.

    ``init(module)`` (``build``'s second value), if given, runs first on each
    module, for parameters the checkpoint lacks (``strict=False``); otherwise
    those are zeros. Sharded, as :func:`load_pretrained` (every rank calls it;
    a failure, building the model included, makes all raise).
    """
    world = resolve_world((config or Config()).process_group)
    collectives = Collectives(world) if world.sharded else None
    what = f"load '{path}'"
    failures: list[BaseException] = []
    try:
        model, init = build()
        matched = match_checkpoint(model, path, strict)
    except BaseException as exc:
        if collectives is None:
            raise
        failures.append(exc)

    def settle(after: str) -> None:
        """Sharded, every rank learns whether any failed so far (``after``: what that leaves)."""
        if collectives is not None:
            agree(collectives, failures[0] if failures else None, what, after, PretrainedError)

    settle("nothing was offloaded")
    filled: set[int] = set()
    # NOTE [the layout is decided once, late]: the file is read when the model is laid
    # out (its optimizer's construction, or the first forward), so the homes are
    # planned for that optimizer; the reader (and its block) exists only then.
    readers: list[RangeReader] = []

    def fill(module: nn.Module) -> None:
        if init is not None:
            init(module)
        for param in module.parameters(recurse=False):
            record = matched.params.get(id(param))
            # Only parameters being initialised right now hold memory here;
            # others are placeholders (filled, or copied in from real values).
            if record is None or id(param) in filled or is_placeholder(param):
                continue
            filled.add(id(param))
            # NOTE: sharded, every rank starts from rank 0's initial values
            # (offload broadcasts them): only rank 0 reads. After a failed read
            # it keeps initialising without the file, so that no rank waits in a
            # broadcast it never joins, and every rank raises at the end.
            if world.rank != 0 or failures:
                continue
            try:
                readers[0].copy_into(record, [param.data.view(-1)])
            except BaseException as exc:
                if collectives is None:
                    raise
                failures.append(exc)

    model = offload(model, config, init=fill)
    engine = engine_of(model)
    write_initial = engine.fill
    assert write_initial is not None

    def fill_from_file(engine: OffloadEngine) -> None:
        with RangeReader() as reader:
            readers.append(reader)
            try:
                write_initial(engine)
                # Parameters that had values already were copied in, not initialised.
                rest = {k: r for k, r in matched.params.items() if k not in filled}
                _load_matched(engine, reader, matched, rest)
            except BaseException as exc:
                if collectives is None:
                    raise
                failures.append(exc)
            finally:
                readers.clear()
        settle("the offloaded model is not usable: offload it again on every rank")

    engine.fill = fill_from_file
    return model, matched.result


def _load_matched(
    engine: OffloadEngine, reader: RangeReader, matched: Matched, params: dict[int, TensorRecord]
) -> None:
    """Stream ``params`` (matched parameters) into the chunks and copy the matched buffers."""

    def writer(index: int, record: TensorRecord) -> Callable[[list[torch.Tensor]], None]:
        if not engine.chunk_io.in_shard(index):
            return lambda destinations: None  # all in other ranks' shards
        return lambda destinations: reader.copy_into(record, destinations)

    indices = {key: engine.registry.by_id[key].index for key in params}
    writers = {indices[key]: writer(indices[key], r) for key, r in params.items()}
    if writers:
        stream_params_in(engine, writers)
    with torch.no_grad():
        for name, record in matched.buffers.items():
            module, key = matched.names.buffers[name]
            _buffer(module, key).copy_(reader.read(record))


def _buffer(module: nn.Module, attr: str) -> torch.Tensor:
    buffer = module._buffers[attr]
    assert buffer is not None  # state_names lists only buffers that are set
    return buffer


def _drop_ignored(keys: list[str], model: nn.Module, kind: str) -> list[str]:
    patterns = ignore_patterns(model, kind)
    return [k for k in keys if not any(re.search(p, k) for p in patterns)]


def _mismatch(record: TensorRecord, shape: tuple[int, ...]) -> str:
    return f"{record.name}: checkpoint {tuple(record.shape)} vs model {shape}"


def _report(model_name: str, path: str, result: LoadResult) -> str:
    lines = [f"cannot load '{path}' into {model_name}:"]
    if result.missing_keys:
        lines.append(f"  missing from the checkpoint: {', '.join(result.missing_keys)}")
    if result.unexpected_keys:
        lines.append(f"  not in the model: {', '.join(result.unexpected_keys)}")
    if result.mismatched_keys:
        lines.append(f"  shapes differ: {'; '.join(result.mismatched_keys)}")
    lines.append(
        "Nothing was loaded. Pass strict=False to load the matching tensors and get "
        "this report back as the result."
    )
    return "\n".join(lines)
