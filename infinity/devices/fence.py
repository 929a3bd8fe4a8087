"""The fence device: a GPU stand-in on the CPU, so CI sees host/device mistakes.

``Config(device="fence")`` computes on a device that is not host memory to
torch: tensors there report ``fence:0``, and every kernel refuses a host tensor
beside a device one with CUDA's own error ("Expected all tensors to be on the
same device ..."), while host code that takes CPU tensors only (the C++
kernels, the I/O engine) refuses fence tensors as it refuses CUDA ones. The
arithmetic is the CPU's, bit for bit, so results compare with plain PyTorch on
the CPU.

See NOTE [the fence device]. Why a backend: the device is PyTorch's open
registration backend (``PrivateUse1``, renamed ``"fence"``) in ``infinity._fence``
(cpp/fence/), not a tensor subclass. A wrapper
subclass has no storage of its own, so chunk slot views, storage identity
(the pack hook, slot liveness through storage weak references), ``param.data``
swaps and autograd's device threads would all differ from CUDA's; a backend
gives real storages, real views and the autograd engine's per-device thread,
exactly where CUDA has them.

Loading the device is process-wide and permanent (PyTorch allows one
``PrivateUse1`` backend): afterwards ``torch.accelerator`` reports ``fence``
as a GPU machine reports ``cuda``. ``make test`` therefore runs the fence tests
in a pytest process of their own.
"""

from __future__ import annotations

import ctypes
import threading
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from infinity.config import ConfigError
from infinity.devices.base import TransferHandle
from infinity.devices.cpu import CpuBackend

if TYPE_CHECKING:
    from infinity.io import IORequest, SwapFile

NAME = "fence"
_lock = threading.Lock()
_native: types.ModuleType | None = None


def _device_module(native: types.ModuleType) -> types.ModuleType:
    """``torch.fence``: what torch asks of a device's module (``torch.accelerator``,
    checkpointing's RNG capture, ``torch.manual_seed``)."""
    module = types.ModuleType("torch.fence", "The fence test device (infinity.devices.fence).")

    # Kernels draw from the CPU generator (cpp/fence/device.cpp), so the
    # device's RNG state is the CPU's: checkpointing saves and restores it twice,
    # the same state both times.
    def get_rng_state(device: object = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, device: object = None) -> None:
        torch.set_rng_state(state)

    functions: dict[str, Callable[..., object]] = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "_is_in_bad_fork": lambda: False,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "memory_allocated": lambda device=None: native.memory_allocated(),
        "max_memory_allocated": lambda device=None: native.max_memory_allocated(),
        "reset_peak_memory_stats": lambda device=None: native.reset_peak_memory_stats(),
    }
    for name, function in functions.items():
        setattr(module, name, function)
    return module


def load() -> types.ModuleType:
    """Register the fence device with torch (once per process) and return its native module."""
    global _native
    with _lock:
        if _native is not None:
            return _native
        try:
            from infinity import _fence  # type: ignore[attr-defined]
        except ImportError as exc:
            raise ConfigError(
                "device='fence' needs infinity._fence, which is built against the installed "
                "torch: reinstall with `pip install --no-build-isolation -e .` (or `make setup`) "
                f"in an environment where torch is importable ({exc})"
            ) from None
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            raise ConfigError(
                f"device='fence' needs PyTorch's PrivateUse1 backend, but this process already "
                f"registered it as {current!r}; run the fence in a process without that backend"
            )
        if current != NAME:
            torch.utils.rename_privateuse1_backend(NAME)
            torch._register_device_module(NAME, _device_module(_fence))
            torch.utils.generate_methods_for_privateuse1_backend()
            _fence.register_hooks()
        _check_autograd_threads()
        _native = _fence
        return _fence


def _check_autograd_threads() -> None:
    """Refuse a process whose autograd engine started before the device existed.

    NOTE: autograd starts one thread per device of every backend at the first
    backward of the process, and never again: a device registered later has no
    thread, and its first backward fails an internal assert of torch's.
    """
    probe = torch.ones(1, device=NAME, requires_grad=True)
    try:
        probe.sum().backward()
    except RuntimeError as exc:
        if "device_ready_queues_" not in str(exc):
            raise
        raise RuntimeError(
            "device='fence' must be loaded before the process's first backward pass: call "
            "infinity.devices.fence.load() at start, or run in a fresh process"
        ) from None


def loaded() -> bool:
    """Whether this process has registered the fence device."""
    return _native is not None


class FenceBackend(CpuBackend):
    """Device slots on the fence device; copies on the CPU backend's copy thread.

    The fence's memory is host memory underneath, so the copy thread moves the
    bytes by address as it does for the CPU backend; what differs is that torch
    sees the slots, and every view of them, on a device of their own.
    """

    name = NAME
    shares_host_memory = False  # it stands for a GPU: its bytes are not host_memory's

    def __init__(self, copy_delay_s: float = 0.0, *, nvme_direct: bool = False) -> None:
        load()
        super().__init__(copy_delay_s, nvme_direct=nvme_direct)
        self.device = torch.device(NAME, 0)

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        # NOTE: the fence allocator aligns every block to 4 KiB (O_DIRECT), as the
        # direct route's reads into device slots need.
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        if (dst.device.type == NAME) == (src.device.type == NAME):
            raise ValueError(
                f"a fence transfer copies between host and device, got {src.device} -> {dst.device}"
            )
        return self._submit(dst, src)

    def alias(self, region: torch.Tensor) -> torch.Tensor:
        return torch.ops.infinity_fence.alias(region)

    def nvme_reader(self, swap_file: SwapFile) -> Callable[[torch.Tensor, int], IORequest] | None:
        # GPU-direct storage writes device memory from the disk. The I/O
        # engine takes host tensors only, and the fence's memory is host memory
        # underneath: the reader hands it a host view of the slot, the one place
        # the fence is crossed on purpose.
        if not self.nvme_direct:
            return None

        def read(dst: torch.Tensor, offset: int) -> IORequest:
            self.direct_reads += 1
            nbytes = dst.numel() * dst.element_size()
            view = (ctypes.c_uint8 * nbytes).from_address(dst.data_ptr())
            return swap_file.read(torch.frombuffer(view, dtype=torch.uint8), offset)

        return read
