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

Nothing in ``meta.json`` is trusted: :func:`read_meta` checks its format,
version and checksum, and :func:`parse_meta` turns it into typed records,
checking every field's type and range and that every byte range it names lies
inside its file, raising :class:`CheckpointError` naming the first bad field, so
a damaged or foreign ``meta.json`` can never surface as
``KeyError``/``AttributeError`` half-way through a load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.optim.cpu_adam import ADAM

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


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_T = TypeVar("_T")
_EXPECTED = {bool: "true or false", str: "a string", list: "a list", dict: "an object"}
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


def _of(kind: type[_T], value: Any, what: str) -> _T:
    """``value`` if it is a ``kind`` (bool, str, list or dict), else raise naming ``what``."""
    if not isinstance(value, kind):
        raise _bad(what, value, _EXPECTED[kind])
    return value


def _dict(value: Any, what: str, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    value = _of(dict, value, what)
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
        _int(d, f"{what}.shape[{k}]") for k, d in enumerate(_of(list, t["shape"], f"{what}.shape"))
    )
    trainable = _of(bool, t["trainable"], f"{what}.trainable")
    rec = TensorRecord(
        name=_of(str, t["name"], f"{what}.name"),
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
    aliases = [
        _of(str, a, f"{what}.aliases[{k}]") for k, a in enumerate(_of(list, t["aliases"], what))
    ]
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
    for g, group in enumerate(_of(list, value, "optimizer")):
        group = _dict(group, f"optimizer[{g}]", ("hyper", "params"))
        hyper = _dict(group["hyper"], f"optimizer[{g}].hyper")
        params = _of(list, group["params"], f"optimizer[{g}].params")
        names = [_of(str, p, f"optimizer[{g}].params[{k}]") for k, p in enumerate(params)]
        groups.append(SavedGroup(hyper=dict(hyper), params=names))
    return groups


def _check_optimizer(saved: Any, optimizer: ChunkOptimizer[Any]) -> None:
    """Raise unless the checkpoint holds ``optimizer``'s state (``None``: written before
    version 4, by Adam)."""
    if saved is None:
        slots = list(ADAM.state_slots)
        saved = {"name": ADAM.name, "front_end": ADAM.front_end, "state_slots": slots}
    record = _dict(saved, "chunk_optimizer", ("name", "front_end", "state_slots"))
    name = _of(str, record["name"], "chunk_optimizer.name")
    front_end = _of(str, record["front_end"], "chunk_optimizer.front_end")
    listed = _of(list, record["state_slots"], "chunk_optimizer.state_slots")
    slots = [_of(str, x, f"chunk_optimizer.state_slots[{k}]") for k, x in enumerate(listed)]
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
    has_master = _of(bool, meta["has_master"], "has_master")
    if has_master != (dtype != "fp32"):
        raise _bad("has_master", has_master, f"{dtype != 'fp32'} for dtype {dtype!r}")
    files = _files(meta["files"])
    _check_optimizer(meta.get("chunk_optimizer"), optimizer)
    state_dtype = meta.get("optimizer_state_dtype", "fp32")
    if state_dtype not in optimizer.state_dtypes:
        raise _bad("optimizer_state_dtype", state_dtype, f"one of {list(optimizer.state_dtypes)}")
    stored = optimizer.with_state_dtype(state_dtype)
    tensors: dict[str, TensorRecord] = {}
    for k, t in enumerate(_of(list, meta["tensors"], "tensors")):
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
