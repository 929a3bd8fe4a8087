"""The safetensors format, read and written in bounded pieces.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``name -> {dtype, shape, data_offsets}`` plus optional ``__metadata__``) and
the tensors' bytes back to back. The ``safetensors`` package is the authority
on what a valid file is: every file is opened with ``safe_open`` (which checks
the header against the file) before its byte ranges are used. Values are then
read with ``os.pread`` into one reused buffer rather than through a memory map,
because touched mapped pages count as resident memory: loading a checkpoint
bigger than RAM must not pull it into the process.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from infinity.utils.process_memory import PRETRAINED_READS

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
READ_BLOCK = PRETRAINED_READS.limit  # bytes per pread: the loader's whole working memory
HEADER_ALIGN = 8

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
CODES = {dtype: code for code, dtype in DTYPES.items()}


class PretrainedError(ValueError):
    """A checkpoint that cannot be read or does not fit the model."""


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes are: file, absolute byte range, dtype and shape."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(file: Path) -> dict[str, TensorRecord]:
    """The tensors of one safetensors file, validated by the ``safetensors`` package."""
    try:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
    except (SafetensorError, OSError) as exc:
        raise PretrainedError(f"'{file}' is not a readable safetensors file: {exc}") from None
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    records = {}
    for name in names:
        info = header[name]
        if info["dtype"] not in DTYPES:
            raise PretrainedError(
                f"'{file}': tensor {name} has dtype {info['dtype']}, which infinity cannot "
                f"convert; supported: {', '.join(DTYPES)}"
            )
        begin, end = info["data_offsets"]
        records[name] = TensorRecord(
            name, file, DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, base + end
        )
    return records


def checkpoint_tensors(path: str | os.PathLike[str]) -> dict[str, TensorRecord]:
    """Every tensor of a checkpoint: one ``.safetensors`` file, an index file, or a
    directory holding ``model.safetensors.index.json`` (shards) or ``model.safetensors``."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        elif (path / SINGLE_FILE).is_file():
            path = path / SINGLE_FILE
        else:
            hint = (
                "; it has PyTorch .bin weights: convert them once with transformers, "
                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir)"
                if any(path.glob("pytorch_model*.bin"))
                else ""
            )
            raise PretrainedError(
                f"'{path}' holds neither {INDEX_FILE} nor {SINGLE_FILE}; point at a "
                f"transformers-style model directory or a .safetensors file{hint}"
            )
    if not path.is_file():
        raise PretrainedError(f"no checkpoint at '{path}'")
    if not path.name.endswith(".json"):
        return read_header(path)
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise PretrainedError(
            f"'{path}' is not a safetensors index (no weight_map): {exc}"
        ) from None
    records: dict[str, TensorRecord] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = path.parent / shard
        if not shard_path.is_file():
            raise PretrainedError(f"'{path}' names shard '{shard}', which is missing")
        found = read_header(shard_path)
        records.update({n: r for n, r in found.items() if weight_map.get(n) == shard})
    absent = sorted(n for n in weight_map if n not in records)
    if absent:
        raise PretrainedError(
            f"'{path}' maps {len(absent)} tensors to shards that do not hold them, e.g. {absent[0]}"
        )
    return records


class RangeReader:
    """Reads tensors' bytes with ``os.pread`` through one reused block buffer (counted
    in ``PRETRAINED_READS``: the memory report shows it beside the host budget)."""

    def __init__(self, block: int = READ_BLOCK) -> None:
        self._buffer = bytearray(block)
        self._fds: dict[Path, int] = {}
        PRETRAINED_READS.take(block)

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def copy_into(self, record: TensorRecord, destinations: list[torch.Tensor]) -> None:
        """Write ``record``'s values into each flat destination (converting dtypes)."""
        fd = self._fd(record.file)
        size = torch.empty((), dtype=record.dtype).element_size()
        step = len(self._buffer) // size * size
        view = memoryview(self._buffer)
        position, element = record.start, 0
        while position < record.end:
            want = min(step, record.end - position)
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:want]], position + got)
                if n == 0:
                    raise PretrainedError(
                        f"'{record.file}' ends inside tensor {record.name} (at byte "
                        f"{position + got}); the file is truncated"
                    )
                got += n
            values = torch.frombuffer(self._buffer, dtype=record.dtype, count=want // size)
            for dst in destinations:
                dst[element : element + values.numel()].copy_(values)
            element += values.numel()
            position += want
        # The page cache is not our memory, but a checkpoint larger than RAM
        # would still crowd out everything else; these pages are not read again.
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, record.start, record.end - record.start, os.POSIX_FADV_DONTNEED)

    def read(self, record: TensorRecord) -> torch.Tensor:
        """A whole tensor (for buffers, which are small)."""
        out = torch.empty(record.shape, dtype=record.dtype)
        self.copy_into(record, [out.view(-1)])
        return out

    def close(self) -> None:
        """Close every file opened and free the buffer."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        PRETRAINED_READS.give_back(len(self._buffer))
        self._buffer = bytearray()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: name, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of its values."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class ShardWriter:
    """Writes one safetensors file: the header first (offsets are known from the
    specs), then each tensor's bytes in the order of ``specs``."""

    def __init__(self, file: Path, specs: list[TensorSpec]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in specs:
            if spec.dtype not in CODES:
                raise PretrainedError(f"{spec.name}: dtype {spec.dtype} has no safetensors code")
            header[spec.name] = {
                "dtype": CODES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % HEADER_ALIGN)
        self.file = file
        self._expected = [(s.name, s.nbytes) for s in specs]
        self._next = 0
        self._handle = open(file, "wb")
        self._handle.write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, data: memoryview | bytes) -> None:
        """The bytes of the next tensor (must be ``name``, exactly its size)."""
        want_name, want_bytes = self._expected[self._next]
        if name != want_name or len(data) != want_bytes:
            raise AssertionError(f"{self.file}: expected {want_name} ({want_bytes} bytes)")
        self._handle.write(data)
        self._next += 1

    def close(self) -> None:
        """Flush and fsync; every tensor must have been written."""
        if self._next != len(self._expected):
            raise AssertionError(f"{self.file}: {len(self._expected) - self._next} not written")
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()

    def abort(self) -> None:
        """Close without checks (the file is being thrown away)."""
        self._handle.close()
