"""Tier, kind and phase names, as enums whose values are the strings that
stats, the timeline, checkpoints and the plan output have always shown.

NOTE: the enums derive from ``str`` so a member equals its value, hashes like
it and serializes (JSON, ``str()``, f-strings) as it: values written before
these enums existed still compare equal.
"""

from __future__ import annotations

import enum


class _Name(str, enum.Enum):
    """A name whose ``str()`` and format are its value (as ``enum.StrEnum``, 3.11+)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Tier(_Name):
    """Where a home (the authoritative copy of a chunk) lives."""

    HOST = "host"
    NVME = "nvme"
    DEVICE = "device"  # a trainable chunk kept whole on the device and stepped there


HOST, NVME, DEVICE = Tier.HOST, Tier.NVME, Tier.DEVICE


class Kind(_Name):
    """Storage kinds. ``OPTIM`` is one unit: [master (16-bit runs only), exp_avg, exp_avg_sq]."""

    PARAM = "param"
    GRAD = "grad"
    OPTIM = "optim"


class Phase(_Name):
    """What an access (a moment of the trace and the timeline) was for."""

    FORWARD = "forward"
    BACKWARD = "backward"
    GRAD = "grad"
    OPTIMIZER = "optimizer"


Key = tuple[Kind, int]  # (kind, chunk): one home, one cached copy
