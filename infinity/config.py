"""``infinity.Config``: one typed, validated description of budgets and policies.

Every field is checked at construction; an error names the field, the value and
what would work. Sizes accept ints (bytes) or strings (``"512MiB"``, ``"2GB"``)
and are stored as ints, so ``Config.from_file(c.to_file(p)) == c``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from infinity._native.adam import STATE_ELEMENT_BYTES
from infinity._native.io import ALIGNMENT, MAX_QUEUE_DEPTH, MAX_THREADS
from infinity.utils.sizes import align_up, parse_size, shown

AUTO = "auto"
DTYPES = ("fp32", "bf16", "fp16")  # what "auto" resolves to (infinity.devices.choice)
AIO_BACKENDS = ("auto", "io_uring", "aio", "threads")
OPTIMIZER_STATE_DTYPES = tuple(STATE_ELEMENT_BYTES)  # "fp32", "bf16", "int8": the kernel's formats
ACTIVATION_POLICIES = ("keep", "checkpoint", "offload", "auto")
MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes: more is the wrong file


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and a fix."""


def _size_or_auto(name: str, value: Any, *, minimum: int = 0) -> int | str:
    if value == AUTO:
        return AUTO
    try:
        size = parse_size(value, name=name)
    except ValueError as exc:
        raise ConfigError(f"{exc}, or 'auto'") from None
    if size < minimum:
        raise ConfigError(f"{name}={value!r} is below the minimum of {minimum} bytes")
    return size


def _positive_int(name: str, value: Any, *, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name}={value!r} is above the maximum of {maximum}")
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")
    return value


def _device(value: Any) -> str:
    if isinstance(value, torch.device):
        value = str(value)  # "cpu", "cuda", "cuda:1", "fence:0"
    if value == "fence:0":
        return "fence"  # the fence has one device
    if isinstance(value, str) and (
        value in (AUTO, "cpu", "cuda", "fence")
        or (value.startswith("cuda:") and value[5:].isdigit())
    ):
        return value
    raise ConfigError(
        f"device={shown(value)} must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'fence' (the test "
        "device that stands for a GPU on the CPU), or a torch.device of those"
    )


def _names(name: str, value: Any) -> tuple[str, ...] | None:
    """``None`` or a non-empty sequence of non-empty strings, stored as a tuple."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise ConfigError(
        f"{name}={shown(value)} must be None or a non-empty list of module names or class "
        "names, e.g. ['LlamaDecoderLayer'] or ['model.layers.0', 'model.layers.1']"
    )


def _check_keys(cls: type, data: dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known, key=repr)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in {where}; "
            f"valid keys: {', '.join(sorted(known))}"
        )


@dataclass
class AioConfig:
    """Asynchronous NVMe I/O settings (the ``aio`` block ``infinity bench nvme`` prints).

    ``backend``: ``"auto"`` picks the best kernel-async backend available
    (io_uring, then Linux native AIO), else the ``pread``/``pwrite`` thread pool.
    ``block_size``: each request is split into pieces of this many bytes
    (a multiple of 4 KiB). ``queue_depth``: pieces in flight per worker.
    ``threads``: workers, each with its own submission queue.

    The defaults are what ``infinity bench nvme`` recommends (the least CPU
    per GB within noise of the top throughput): io_uring with 4 MiB pieces at
    queue depth 32 moved 2.76 GB/s read + write at 24 CPU ms/GB, the fastest
    point measured and 2.8x cheaper in CPU than 1 MiB pieces (67 ms/GB at
    2.13 GB/s); CPU spent on I/O is taken from compute on the same cores.
    """

    backend: str = AUTO
    block_size: int | str = 4 << 20
    queue_depth: int = 32
    threads: int = 1

    def __post_init__(self) -> None:
        self.backend = _choice("aio.backend", self.backend, AIO_BACKENDS)
        try:
            self.block_size = parse_size(self.block_size, name="aio.block_size")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.block_size < ALIGNMENT or self.block_size % ALIGNMENT:
            raise ConfigError(
                f"aio.block_size={self.block_size} must be a positive multiple of "
                f"{ALIGNMENT} bytes (O_DIRECT alignment), e.g. '256K' or '1M'"
            )
        self.queue_depth = _positive_int(
            "aio.queue_depth", self.queue_depth, maximum=MAX_QUEUE_DEPTH
        )
        self.threads = _positive_int("aio.threads", self.threads, maximum=MAX_THREADS)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AioConfig:
        """Build from a JSON-like dict, rejecting unknown keys."""
        if not isinstance(data, dict):
            raise ConfigError(f"aio={data!r} must be a dict or AioConfig")
        _check_keys(cls, data, "aio")
        return cls(**data)


@dataclass
class Config:
    """Budgets per memory tier and the policies of the offload engine.

    Args:
        device_memory: bytes of chunk memory on the compute device. ``"auto"``:
            80% of free GPU memory on CUDA; on a CPU host (where the "device" is a
            budgeted pool in RAM) a quarter of the host budget. Room beyond a slot
            for every chunk copy homes whole trainable chunks there, stepped there
            (given explicitly, or on a CPU host; see NOTE [chunks homed on the device]).
        host_memory: bytes of (pinned) host memory for chunks. ``"auto"``: half of
            the available RAM reported by ``psutil``.
        nvme_path: directory for the NVMe tier (a private sub-directory is made in
            it and removed on exit); ``None`` disables the tier.
        nvme_memory: cap on bytes of swap files; ``"auto"``: 90% of the free space.
        dtype: compute dtype of parameters: ``"auto"`` (the default: bf16 where the
            device computes it natively, a GPU of compute capability 8.0 or later or
            a CPU with AVX512_BF16/AMX; else fp32, or fp16 on older GPUs),
            ``"fp32"``, ``"bf16"`` or ``"fp16"`` (fp16 uses dynamic loss scaling).
            The engine decides ``"auto"`` when the model is offloaded
            (``infinity.stats(model)["dtype"]`` says what it chose).
        chunk_size: bytes per chunk of the compute dtype; ``"auto"`` searches the
            size that wastes least and fits the budgets.
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``
            or ``"fence"``: a test device that stands for a GPU on the CPU, on which a
            host tensor meeting device compute fails as on CUDA (see
            ``infinity.devices.fence``). A ``torch.device`` is stored as its string.
        aio: NVMe I/O settings, an :class:`AioConfig` or its dict.
        prefetch_depth: chunks in flight ahead of compute (0 disables prefetch).
        prefetch_bytes: byte budget for prefetched-but-unused chunks; ``"auto"``:
            ``prefetch_depth`` chunks.
        overlap_optimizer: run the optimizer step of a chunk during backward as soon
            as its gradients are complete. ``True`` is a promise that every backward
            is followed by ``optimizer.step()`` with no gradient clipping in between
            and no gradient accumulation (checked: breaking it raises); not with
            fp16, whose overflow check needs every gradient first. Gradients on
            NVMe are then used from host memory and dropped, not written to disk,
            so ``infinity.gradients(model)`` after the step raises. ``"auto"``
            currently means ``False``: guessing the promise would need a rollback.
        initial_loss_scale, loss_scale_window, min_loss_scale: fp16 dynamic loss
            scaling (scale halves on overflow, doubles after ``loss_scale_window``
            good steps).
        optimizer_state_dtype: how the optimizer's moments are stored: ``"fp32"``
            (exact, the default), ``"bf16"`` (half the bytes; rounded
            stochastically, so small decays survive) or ``"int8"`` (about a
            quarter: 8-bit codes with one fp32 scale per 256 elements, as in 8-bit
            Adam). The update runs in fp32 and master
            weights stay fp32 either way; checkpoints keep the stored format.
        process_group: the ``torch.distributed`` group to shard chunks over.
            ``None``: the default group if one is initialised (under ``torchrun``),
            else a single process. Each rank keeps one equal shard of every chunk's
            parameters, gradients and optimizer states; budgets are per process.
            Not serialised (``to_dict`` leaves it out).
        activations: what happens to the tensors autograd saves for backward.
            ``"keep"`` (the default): they stay where they are, outside every
            budget. ``"checkpoint"``: each block (``activation_blocks``) keeps only
            its inputs and recomputes its forward in backward (as
            ``torch.utils.checkpoint``; same gradients). ``"offload"``: every saved
            tensor of at least ``activation_min_bytes`` leaves the device into host
            memory and, beyond it, into a swap file under ``nvme_path``; backward
            reads them back in reverse order, ahead of use. Same gradients: the data
            is only moved. With ``nvme_path`` an eighth of ``host_memory`` is kept for
            them (the states plan within the rest) and every byte they hold is in
            it, in three lines that ``stats()["activations"]`` reports.
            ``"auto"``: the first forward runs as ``"offload"`` and is measured;
            then each block, last first, is kept on the device while the room the
            chunk slots leave in ``device_memory`` holds it, offloaded while host
            memory (or an NVMe tier) holds it, else checkpointed; chosen again
            when a forward has more tokens. Under every policy a forward with
            more tokens than any before is checked before it runs: what it would
            save, at the bytes per token measured, must fit where the policy puts
            it, else ``ConfigError`` names the bytes.
        activation_blocks: the modules ``"checkpoint"`` recomputes, by name
            (``"model.layers.3"``) or class name (``"LlamaDecoderLayer"``);
            ``None``: a ``transformers`` model's decoder layers
            (``_no_split_modules``), else the longest ``nn.ModuleList`` of one class.
        activation_min_bytes: smaller saved tensors stay on the device under
            ``"offload"`` (moving them costs more than they hold).
    """

    device_memory: int | str = AUTO
    host_memory: int | str = AUTO
    nvme_path: str | None = None
    nvme_memory: int | str = AUTO
    dtype: str = AUTO
    chunk_size: int | str = AUTO
    device: str = AUTO
    aio: AioConfig = field(default_factory=AioConfig)
    prefetch_depth: int = 4
    prefetch_bytes: int | str = AUTO
    overlap_optimizer: bool | str = AUTO
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    optimizer_state_dtype: str = "fp32"
    process_group: Any = field(default=None, compare=False, repr=False)
    activations: str = "keep"
    activation_blocks: tuple[str, ...] | None = None
    activation_min_bytes: int | str = 64 << 10

    SIZE_FIELDS: ClassVar[tuple[str, ...]] = (
        "device_memory",
        "host_memory",
        "nvme_memory",
        "prefetch_bytes",
    )

    def __post_init__(self) -> None:
        for name in self.SIZE_FIELDS:
            setattr(self, name, _size_or_auto(name, getattr(self, name)))
        self.chunk_size = _size_or_auto("chunk_size", self.chunk_size, minimum=ALIGNMENT)
        if isinstance(self.chunk_size, int) and self.chunk_size % ALIGNMENT:
            raise ConfigError(
                f"chunk_size={self.chunk_size} must be a multiple of {ALIGNMENT} bytes "
                f"(O_DIRECT alignment), e.g. {align_up(self.chunk_size, ALIGNMENT)} or 'auto'"
            )
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)) or not os.fspath(self.nvme_path):
                raise ConfigError(f"nvme_path={self.nvme_path!r} must be a directory path or None")
            self.nvme_path = os.fsdecode(self.nvme_path)
            if "\0" in self.nvme_path:
                raise ConfigError(f"nvme_path={self.nvme_path!r} contains a NUL character")
        self.dtype = _choice("dtype", self.dtype, (AUTO, *DTYPES))
        self.device = _device(self.device)
        if isinstance(self.aio, dict):
            self.aio = AioConfig.from_dict(self.aio)
        elif not isinstance(self.aio, AioConfig):
            raise ConfigError(f"aio={self.aio!r} must be an AioConfig or a dict of its fields")
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int):
            raise ConfigError(f"prefetch_depth={self.prefetch_depth!r} must be an int >= 0")
        if not 0 <= self.prefetch_depth <= 64:
            raise ConfigError(f"prefetch_depth={self.prefetch_depth} must be in 0..64")
        if self.overlap_optimizer not in (AUTO, True, False):
            raise ConfigError(
                f"overlap_optimizer={self.overlap_optimizer!r} must be 'auto', True or False"
            )
        if self.overlap_optimizer is True and self.dtype == "fp16":
            raise ConfigError(
                "overlap_optimizer=True cannot be used with dtype='fp16' (which dtype='auto' "
                "picks on GPUs without bf16): the overflow check needs every gradient before "
                "any step; use dtype='bf16' or 'fp32', or overlap_optimizer=False"
            )
        for name in ("initial_loss_scale", "min_loss_scale"):
            value = getattr(self, name)
            number = math.nan
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    number = float(value)
                except OverflowError:  # an int beyond the float range
                    number = math.inf
            if not 0 < number < math.inf:
                raise ConfigError(f"{name}={shown(value)} must be a positive, finite number")
            setattr(self, name, number)
        self.loss_scale_window = _positive_int("loss_scale_window", self.loss_scale_window)
        self.optimizer_state_dtype = _choice(
            "optimizer_state_dtype", self.optimizer_state_dtype, OPTIMIZER_STATE_DTYPES
        )
        self.activations = _choice("activations", self.activations, ACTIVATION_POLICIES)
        self.activation_blocks = _names("activation_blocks", self.activation_blocks)
        try:
            self.activation_min_bytes = parse_size(
                self.activation_min_bytes, name="activation_min_bytes"
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    # --- (de)serialisation ------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``Config(**d)`` (or ``from_dict``) rebuilds an equal config
        (``process_group`` is a live object: left out)."""
        # NOTE: asdict deep-copies every value, and a process group cannot be copied.
        bare = dataclasses.replace(self, process_group=None)
        data = dataclasses.asdict(bare)
        del data["process_group"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build from a dict (e.g. parsed JSON), rejecting unknown keys."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, got {type(data).__name__}")
        _check_keys(cls, data, "the config")
        return cls(**data)

    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Write the config as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Config:
        """Read a config written by :meth:`to_file` (or by hand)."""
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"config file path={shown(path)} must be a str or os.PathLike")
        where = f"config file {os.fsdecode(path)!r}"
        hint = "pass a JSON file written by Config.to_file()"
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except FileNotFoundError:
            raise ConfigError(f"{where} does not exist; {hint}") from None
        except IsADirectoryError:
            raise ConfigError(f"{where} is a directory; {hint}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read {where}: {exc.strerror}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{where} is larger than {MAX_CONFIG_BYTES} bytes; {hint}")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"{where} is not UTF-8 text (a binary file?); {hint}") from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, too many digits, nesting
            raise ConfigError(f"{where} is not valid JSON: {exc}; {hint}") from None
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)
