"""Optimizers: :class:`CPUAdam`, :class:`CPULion`, :class:`CPUAdafactor` and :class:`CPUSGD`
on one generic front-end (:mod:`.front_end`), and the fused CPU-Adam kernel (:mod:`.kernels`)."""

from infinity.optim import kernels
from infinity.optim.adafactor import CPUAdafactor
from infinity.optim.cpu_adam import AdamHyperParams, CPUAdam
from infinity.optim.front_end import CPUOptimizer
from infinity.optim.lion import CPULion
from infinity.optim.sgd import CPUSGD

__all__ = [
    "CPUSGD",
    "AdamHyperParams",
    "CPUAdafactor",
    "CPUAdam",
    "CPULion",
    "CPUOptimizer",
    "kernels",
]
