"""What ``Config``'s ``"auto"`` device and compute dtype mean on the machine at hand,
and which backend runs a ``Config.device`` (:func:`make_backend`: the one place
that knows every backend).

See NOTE [dtype auto]: bf16 where the device computes it natively, else fp32 (fp16
with loss scaling on GPUs without bf16); the fence device follows the CPU's rule.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from dataclasses import dataclass

import torch

from infinity.config import AUTO, Config, ConfigError
from infinity.devices.base import DeviceBackend


def resolve_device(device: str) -> str:
    """A ``Config.device`` value with ``"auto"`` replaced (CUDA when available; never
    the fence, which is only ever asked for by name)."""
    if device == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_computes_bf16() -> bool:
    """Whether torch's CPU kernels compute bf16 natively here: the CPU has AVX512_BF16
    or AMX-BF16, and neither torch (``ATEN_CPU_CAPABILITY``) nor oneDNN
    (``ONEDNN_MAX_CPU_ISA``) is held below the instructions that have it."""
    flags = _cpu_flags()
    if not flags & {"avx512_bf16", "amx_bf16"}:
        return False
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "DEFAULT"))
    return onednn.upper() in ("", "DEFAULT", "ALL") or any(
        part in onednn.upper() for part in ("BF16", "AMX", "AVX10", "FP16")
    )


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype ``"auto"`` picked, and why (printed in run headers)."""

    dtype: str
    reason: str


def choose_dtype(device: str) -> DtypeChoice:
    """The compute dtype for ``device`` (a resolved ``Config.device``): see NOTE [dtype auto]."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():  # `infinity plan --device cuda` on a host without one
            return DtypeChoice("bf16", "no GPU here to ask: planned for one that computes bf16")
        index = torch.device(device).index
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        if major >= 8:
            return DtypeChoice("bf16", f"{name} (compute capability {major}.{minor}) computes bf16")
        return DtypeChoice(
            "fp16",
            f"{name} (compute capability {major}.{minor}) has no bf16 units: fp16 with "
            "dynamic loss scaling (call optimizer.scale_loss(loss).backward())",
        )
    where = "this CPU" if device == "cpu" else f"the {device} device computes on this CPU, which"
    if cpu_computes_bf16():
        return DtypeChoice("bf16", f"{where} has AVX512_BF16/AMX: bf16 is native")
    return DtypeChoice("fp32", f"{where} has no AVX512_BF16 or AMX: bf16 would be emulated")


def resolve_dtype(dtype: str, device: str) -> str:
    """A ``Config.dtype`` value with ``"auto"`` replaced; an explicit bf16 on a CPU that
    emulates it warns once, with its measured cost."""
    if dtype == AUTO:
        return choose_dtype(device).dtype
    if dtype == "bf16" and not device.startswith("cuda") and not cpu_computes_bf16():
        _warn_emulated_bf16()
    return dtype


@functools.cache
def emulated_bf16_slowdown() -> float:
    """How many times slower a bf16 matmul is than fp32 here (a 512 x 256 x 512
    product, best of three)."""

    def best(dtype: torch.dtype) -> float:
        a = torch.ones(512, 256, dtype=dtype)
        b = torch.ones(256, 512, dtype=dtype)
        a @ b
        times = []
        for _ in range(3):
            started = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - started)
        return min(times)

    return best(torch.bfloat16) / max(best(torch.float32), 1e-9)


@functools.cache
def _warn_emulated_bf16() -> None:
    warnings.warn(
        f"dtype='bf16' on a CPU without AVX512_BF16 or AMX: a bf16 matmul is "
        f"{emulated_bf16_slowdown():.0f}x slower than fp32 here (measured). dtype='auto' "
        "picks fp32 on this machine",
        RuntimeWarning,
        stacklevel=3,
    )


def autocast_casts_weights(device: torch.device, dtype: torch.dtype) -> str | None:
    """What is wrong with the autocast around a training forward of a model offloaded on
    ``device`` as ``dtype``, or ``None`` (no autocast, or one to ``dtype`` itself).

    NOTE: autocast casts each weight to its dtype at each use and autograd saves the cast
    for backward: a copy of every weight, held from its forward to its backward as a saved
    activation, in no budget (on a GPU, up to a whole copy of the model in device memory).
    The engine's own mixed precision keeps no such copy: bf16 or fp16 chunks computed on
    directly, the fp32 masters beside the optimizer states.
    """
    if not torch.is_grad_enabled():
        return None  # nothing is saved
    try:
        if not torch.is_autocast_enabled(device.type):
            return None
        cast_to = torch.get_autocast_dtype(device.type)
    except RuntimeError:  # a device type autocast does not know
        return None
    if cast_to == dtype:
        return None
    name = str(cast_to).removeprefix("torch.")
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(cast_to, name)
    return (
        f"torch.autocast({device.type!r}, dtype=torch.{name}) is on around a forward of a "
        f"model offloaded as {str(dtype).removeprefix('torch.')}: autocast casts each weight "
        f"to {name} and autograd saves every cast for backward, a {name} copy of the weights "
        "held until backward beside the chunks (saved activations: on a GPU up to a whole "
        "copy of the model in device memory, whatever device_memory says). Offload "
        f"with infinity.Config(dtype={short!r}) "
        "instead (the chunks compute in it, fp32 masters beside the optimizer states) and "
        "leave autocast out of the training loop"
    )


def resolved(config: Config) -> Config:
    """``config`` with its device and compute dtype decided for this machine (what an
    engine runs with; the user's ``Config`` keeps its ``"auto"``)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if (device, dtype) == (config.device, config.dtype):
        return config
    return dataclasses.replace(config, device=device, dtype=dtype)


def make_backend(device: str) -> DeviceBackend:
    """The backend for a ``Config.device`` value (``"auto"`` picks CUDA when available)."""
    device = resolve_device(device)
    # NOTE: imported here, not at the top: the CPU backend loads the native
    # module and the CUDA one is useless without a GPU; `infinity plan` needs neither.
    if device == "cpu":
        from infinity.devices.cpu import CpuBackend

        return CpuBackend()
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={device!r} but torch.cuda.is_available() is False; "
                "use device='cpu' (or 'auto') on a host without a GPU"
            )
        from infinity.devices.cuda import CudaBackend

        return CudaBackend(torch.device(device))
    if device == "fence":
        from infinity.devices.fence import FenceBackend

        return FenceBackend()
    raise ConfigError(f"device={device!r} must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'fence'")
