"""Which backend runs a ``Config.device``: the one place that knows every backend."""

from __future__ import annotations

import torch

from infinity.config import ConfigError
from infinity.devices.base import DeviceBackend
from infinity.devices.choice import resolve_device


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
