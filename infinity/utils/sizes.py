"""Byte sizes: parse ``"512MiB"`` / ``"2GB"`` / ``"4K"`` and format them back.

Suffixes: ``KiB MiB GiB TiB`` are powers of 1024; ``KB MB GB TB`` are powers of
1000; the bare letters ``K M G T`` (as in ``--block-sizes 256K,1M``) are powers
of 1024, as fio and dd read them.
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MAX_SIZE = (1 << 63) - 1  # the largest file offset: more than any memory or disk


def shown(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for error messages."""
    if isinstance(value, int) and value.bit_length() > 4 * limit:
        return f"<an integer of {value.bit_length()} bits>"  # NOTE: repr() may refuse it
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Return ``value`` in bytes; raise ``ValueError`` naming ``name`` if it is not a size."""
    if isinstance(value, bool):
        raise ValueError(
            f"{name}={value!r} is not a size; use bytes (int) or a string like '512MiB'"
        )
    size = None
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}={shown(value)} is negative; sizes are >= 0 bytes")
        size = value
    elif isinstance(value, float) and value.is_integer() and value >= 0:
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            number, unit = match.groups()
            # NOTE: exact arithmetic: float() rounds big sizes and overflows to inf.
            try:
                size = int(Fraction(number) * _UNITS[unit.lower()])
            except ValueError:  # more digits than int() accepts
                size = MAX_SIZE + 1
    if size is None:
        raise ValueError(
            f"{name}={shown(value)} is not a size; use bytes (int) or a string like "
            "'4096', '256K', '512MiB', '2GB' (KiB/MiB/GiB or K/M/G = 1024-based, KB/MB/GB = "
            "1000-based)"
        )
    if size > MAX_SIZE:
        raise ValueError(
            f"{name}={shown(value)} is too large: sizes stop at 2**63-1 bytes (8 EiB), more "
            "than any memory or disk; use a size like '512GiB'"
        )
    return size


def format_size(nbytes: float) -> str:
    """Human-readable binary size: ``1536 -> '1.50 KiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def align_up(nbytes: int, alignment: int) -> int:
    """Round ``nbytes`` up to a multiple of ``alignment``."""
    return (nbytes + alignment - 1) // alignment * alignment
