"""Every field of ``meta.json`` checked for type and range before anything is loaded.

:func:`parse_meta` turns the parsed JSON into typed records and raises
:class:`CheckpointError` naming the first bad field, so a damaged or foreign
``meta.json`` can never surface as ``KeyError``/``AttributeError`` half-way
through a load, and every byte range it names lies inside its file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from infinity.checkpoint.format import DATA_FILES, META, OPTIM_FILE, PARAM_FILE, CheckpointError
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.optim.cpu_adam import ADAM

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MAX_INT = (1 << 62) - 1  # offsets, sizes and counts must stay int64 (torch, file offsets)


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
    # Per-tensor optimizer states (Adafactor's factors): name -> byte offset of its
    # fp32 values in optim.bin, after the units. See NOTE [per-tensor optimizer state].
    tensor_state: dict[str, int] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class SavedGroup:
    """One optimizer parameter group as saved: hyper-parameters and parameter names."""

    hyper: dict[str, Any]
    params: list[str]


@dataclass(frozen=True)
class CheckpointMeta:
    """``meta.json`` with every field checked."""

    dtype: str
    has_master: bool
    step_count: int
    tensors: dict[str, TensorRecord]  # by name, aliases of tied parameters included
    files: dict[str, tuple[int, int]]  # file name -> (bytes, CRC-32)
    loss_scaler: dict[str, float | int] | None
    optimizer: list[SavedGroup] | None
    optimizer_state_dtype: str = "fp32"  # how optim.bin stores the state slots
    chunk_optimizer: str = "adam"  # whose state slots optim.bin holds (ChunkOptimizer.name)


def _bad(what: str, value: Any, expected: str) -> CheckpointError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return CheckpointError(f"{META} is invalid: {what} is {shown}, expected {expected}")


def _int(value: Any, what: str, low: int = 0, high: int = MAX_INT) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _bad(what, value, f"an integer in [{low}, {high}]")
    return value


def _bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise _bad(what, value, "true or false")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _bad(what, value, "a string")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(what, value, "a list")
    return value


def _dict(value: Any, what: str, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(what, value, "an object")
    missing = [k for k in keys if k not in value]
    if missing:
        raise CheckpointError(f"{META} is invalid: {what} has no {missing[0]!r}")
    return value


def finite_number(value: Any) -> bool:
    """Whether ``value`` is a JSON number (not a bool) with a finite value."""
    return type(value) in (int, float) and math.isfinite(value)


def _files(value: Any) -> dict[str, tuple[int, int]]:
    files = _dict(value, "files", DATA_FILES)
    if set(files) != set(DATA_FILES):
        raise _bad("files", sorted(files), f"exactly {list(DATA_FILES)}")
    out = {}
    for name in DATA_FILES:
        info = _dict(files[name], f"files[{name!r}]", ("bytes", "crc32"))
        out[name] = (
            _int(info["bytes"], f"files[{name!r}].bytes"),
            _int(info["crc32"], f"files[{name!r}].crc32", high=0xFFFFFFFF),
        )
    return out


def _tensor(
    t: Any,
    what: str,
    esize: int,
    optimizer: ChunkOptimizer[Any],
    has_master: bool,
    files: dict[str, tuple[int, int]],
) -> tuple[TensorRecord, list[str]]:
    required = [k for k in TensorRecord.__dataclass_fields__ if k != "tensor_state"]
    t = _dict(t, what, (*required, "aliases"))
    shape = tuple(
        _int(d, f"{what}.shape[{k}]") for k, d in enumerate(_list(t["shape"], f"{what}.shape"))
    )
    trainable = _bool(t["trainable"], f"{what}.trainable")
    rec = TensorRecord(
        name=_str(t["name"], f"{what}.name"),
        shape=shape,
        trainable=trainable,
        param_offset=_int(t["param_offset"], f"{what}.param_offset"),
        optim_offset=(
            _int(t["optim_offset"], f"{what}.optim_offset")
            if trainable
            else _none(t["optim_offset"], f"{what}.optim_offset")
        ),
        chunk_capacity=_int(t["chunk_capacity"], f"{what}.chunk_capacity", low=1),
        element_offset=_int(t["element_offset"], f"{what}.element_offset"),
        step=_int(t["step"], f"{what}.step"),
        tensor_state=_tensor_state(t.get("tensor_state"), f"{what}.tensor_state", shape, optimizer)
        if trainable
        else {},
    )
    if rec.element_offset + rec.numel > rec.chunk_capacity:
        raise CheckpointError(
            f"{META} is invalid: {rec.name} ({rec.numel} elements at {rec.element_offset}) "
            f"does not fit its chunk of {rec.chunk_capacity} elements"
        )
    _within(rec.name, PARAM_FILE, rec.param_offset, rec.numel * esize, files)
    if rec.optim_offset is not None:
        unit = optimizer.unit_bytes(rec.chunk_capacity, has_master)
        _within(rec.name, OPTIM_FILE, rec.optim_offset, unit, files)
        try:
            optimizer.tensor_ranges(rec.chunk_capacity, has_master, rec.element_offset, rec.numel)
        except ValueError as exc:  # int8: the tensor must start on a quantisation block
            raise CheckpointError(f"{META} is invalid: {rec.name}: {exc}") from None
    for name, at in rec.tensor_state.items():
        size = math.prod(optimizer.tensor_state_shapes(shape)[name]) * 4  # fp32
        _within(f"{rec.name}.{name}", OPTIM_FILE, at, size, files)
    aliases = [_str(a, f"{what}.aliases[{k}]") for k, a in enumerate(_list(t["aliases"], what))]
    return rec, [rec.name, *aliases]


def _tensor_state(
    value: Any, what: str, shape: tuple[int, ...], optimizer: ChunkOptimizer[Any]
) -> dict[str, int]:
    """The offsets of a trainable tensor's per-tensor states: exactly the ones
    ``optimizer`` keeps for ``shape`` (none for most optimizers)."""
    names = sorted(optimizer.tensor_state_shapes(shape))
    if not names and value is None:
        return {}
    record = _dict(value, what)
    if sorted(record) != names:
        raise _bad(what, sorted(record), f"offsets of exactly {names}")
    return {name: _int(record[name], f"{what}.{name}") for name in names}


def _none(value: Any, what: str) -> int | None:
    """``None`` (an offset a frozen tensor does not have); raise on anything else."""
    if value is not None:
        raise _bad(what, value, "null (the tensor is frozen)")
    return None


def _within(
    name: str, file: str, offset: int, size: int, files: dict[str, tuple[int, int]]
) -> None:
    if offset + size > files[file][0]:
        raise CheckpointError(
            f"{META} is invalid: {name} needs bytes {offset}..{offset + size} of {file}, "
            f"which has {files[file][0]}"
        )


def _scaler(value: Any) -> dict[str, float | int] | None:
    if value is None:
        return None
    state = _dict(value, "loss_scaler", ("scale", "good_steps", "skipped_steps"))
    if not finite_number(state["scale"]) or state["scale"] <= 0:
        raise _bad("loss_scaler.scale", state["scale"], "a finite number > 0")
    return {
        "scale": float(state["scale"]),
        "good_steps": _int(state["good_steps"], "loss_scaler.good_steps"),
        "skipped_steps": _int(state["skipped_steps"], "loss_scaler.skipped_steps"),
    }


def _groups(value: Any) -> list[SavedGroup] | None:
    if value is None:
        return None
    groups = []
    for g, group in enumerate(_list(value, "optimizer")):
        group = _dict(group, f"optimizer[{g}]", ("hyper", "params"))
        hyper = _dict(group["hyper"], f"optimizer[{g}].hyper")
        params = _list(group["params"], f"optimizer[{g}].params")
        names = [_str(p, f"optimizer[{g}].params[{k}]") for k, p in enumerate(params)]
        groups.append(SavedGroup(hyper=dict(hyper), params=names))
    return groups


def _check_optimizer(saved: Any, optimizer: ChunkOptimizer[Any]) -> None:
    """Raise unless the checkpoint holds ``optimizer``'s state (``None``: written before
    version 4, by Adam)."""
    if saved is None:
        slots = list(ADAM.state_slots)
        saved = {"name": ADAM.name, "front_end": ADAM.front_end, "state_slots": slots}
    record = _dict(saved, "chunk_optimizer", ("name", "front_end", "state_slots"))
    name = _str(record["name"], "chunk_optimizer.name")
    front_end = _str(record["front_end"], "chunk_optimizer.front_end")
    listed = _list(record["state_slots"], "chunk_optimizer.state_slots")
    slots = [_str(x, f"chunk_optimizer.state_slots[{k}]") for k, x in enumerate(listed)]
    if name == optimizer.name and tuple(slots) == optimizer.state_slots:
        return
    raise CheckpointError(
        f"checkpoint holds the optimizer state of {front_end or name!r} (slots "
        f"{', '.join(slots) or 'none'}), but this model's optimizer units are laid out for "
        f"{optimizer.front_end or optimizer.name} (slots "
        f"{', '.join(optimizer.state_slots) or 'none'}): "
        f"construct a {front_end or name} over the model and pass it to load_checkpoint, "
        "or load the weights alone (infinity.load_pretrained)"
    )


def parse_meta(meta: dict[str, Any], optimizer: ChunkOptimizer[Any] = ADAM) -> CheckpointMeta:
    """Check every field of a parsed ``meta.json``; raise :class:`CheckpointError` if any is bad.

    ``optimizer`` is the chunk optimizer of the model loading it: the checkpoint
    must hold its state (``chunk_optimizer``; Adam's before version 4). Units are
    ``optimizer.unit_bytes(capacity, has_master)`` long, with the state slots in
    the checkpoint's ``optimizer_state_dtype`` (``"fp32"`` before version 3).
    """
    meta = _dict(meta, "the file", ("dtype", "has_master", "step_count", "tensors", "files"))
    dtype = meta["dtype"]
    if dtype not in ELEMENT_BYTES:
        raise _bad("dtype", dtype, f"one of {list(ELEMENT_BYTES)}")
    has_master = _bool(meta["has_master"], "has_master")
    if has_master != (dtype != "fp32"):
        raise _bad("has_master", has_master, f"{dtype != 'fp32'} for dtype {dtype!r}")
    files = _files(meta["files"])
    _check_optimizer(meta.get("chunk_optimizer"), optimizer)
    state_dtype = meta.get("optimizer_state_dtype", "fp32")
    if state_dtype not in optimizer.state_dtypes:
        raise _bad("optimizer_state_dtype", state_dtype, f"one of {list(optimizer.state_dtypes)}")
    stored = optimizer.with_state_dtype(state_dtype)
    tensors: dict[str, TensorRecord] = {}
    for k, t in enumerate(_list(meta["tensors"], "tensors")):
        rec, names = _tensor(t, f"tensors[{k}]", ELEMENT_BYTES[dtype], stored, has_master, files)
        for name in names:
            if name in tensors:
                raise CheckpointError(f"{META} is invalid: tensor {name!r} appears twice")
            tensors[name] = rec
    return CheckpointMeta(
        dtype=dtype,
        has_master=has_master,
        step_count=_int(meta["step_count"], "step_count"),
        tensors=tensors,
        files=files,
        loss_scaler=_scaler(meta.get("loss_scaler")),
        optimizer=_groups(meta.get("optimizer")),
        optimizer_state_dtype=state_dtype,
        chunk_optimizer=optimizer.name,
    )
