"""Optimizers: :class:`CPUAdam` and the fused CPU Adam kernel it runs on (:mod:`.kernels`)."""

from infinity.optim import kernels

__all__ = ["kernels"]
