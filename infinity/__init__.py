"""infinity: train PyTorch models beyond GPU and host memory.

Parameters, gradients and optimizer states live in equal-size chunks spread over
the compute device, pinned host memory and NVMe, within byte budgets per tier.
See ``docs/ARCHITECTURE.md`` for the layers and the data flow of one step.
"""

from infinity.config import AioConfig, Config, ConfigError

__all__ = ["AioConfig", "Config", "ConfigError"]
__version__ = "0.1.0"
