"""Optimizers: :class:`CPUAdam` and the fused CPU Adam kernel it runs on (:mod:`.kernels`)."""

from infinity.optim import kernels
from infinity.optim.cpu_adam import AdamHyperParams, CPUAdam

__all__ = ["AdamHyperParams", "CPUAdam", "kernels"]
