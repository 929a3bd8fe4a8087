"""An independent NumPy model of the int8 moment storage (``optimizer_state_dtype="int8"``).

Written from the format's definition, not from the kernel's bit tricks: every
code's value is tabulated in float64 (``sign * 2^(e - bias) * (1 + f/8)``,
subnormals ``2^(1 - bias) * f/8``), and encoding picks the nearest table entry
(ties to the even code) by search.
"""

from __future__ import annotations

import numpy as np

QBLOCK = 256
QMAX = np.float32(1.875)
FLT_MIN = np.float32(np.finfo(np.float32).tiny)


def magnitudes(bias: int, codes: int) -> np.ndarray:
    """float64 value of every magnitude code 0..codes-1 (3 fraction bits)."""
    c = np.arange(codes)
    e, f = c >> 3, c & 7
    return np.where(e == 0, f / 8 * 2.0 ** (1 - bias), (1 + f / 8) * 2.0 ** (e - bias))


SIGNED = magnitudes(15, 128)  # exp_avg: sign + 7-bit magnitude
UNSIGNED = magnitudes(31, 256)  # exp_avg_sq


def _nearest(y: np.ndarray, table: np.ndarray) -> np.ndarray:
    idx = np.clip(np.searchsorted(table, y), 1, len(table) - 1)
    lo, hi = table[idx - 1], table[idx]
    d_lo, d_hi = y - lo, hi - y
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (idx % 2 == 0))
    code = np.where(pick_hi, idx, idx - 1)
    return np.where(y >= table[-1], len(table) - 1, code)


def encode_block(
    m: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.float32, np.ndarray, np.float32]:
    """Codes and scales of one block of fp32 moments."""
    m = m.astype(np.float32)
    v = v.astype(np.float32)
    m_max = np.float32(np.abs(m).max(initial=0))
    v_max = np.float32(v.max(initial=0))
    out = []
    for x, amax, table in ((np.abs(m), m_max, SIGNED), (v, v_max, UNSIGNED)):
        inv = np.float32(QMAX / amax) if amax >= FLT_MIN else np.float32(0)
        y = (x * inv).astype(np.float32)  # one fp32 rounding, as the kernel
        out.append(_nearest(y.astype(np.float64), table))
    m_code = out[0] | (np.signbit(m).astype(np.int64) << 7)
    m_code = np.where(out[1] == 0, 0, m_code)  # docs/NOTES.md: int8 second moment zero
    return m_code.astype(np.uint8), m_max, out[1].astype(np.uint8), v_max


def encode(m: np.ndarray, v: np.ndarray):
    """Codes and scales of flat moments, blocks from element 0."""
    parts = [encode_block(m[i : i + QBLOCK], v[i : i + QBLOCK]) for i in range(0, len(m), QBLOCK)]
    return (
        np.concatenate([p[0] for p in parts]),
        np.array([p[1] for p in parts], np.float32),
        np.concatenate([p[2] for p in parts]),
        np.array([p[3] for p in parts], np.float32),
    )


def decode(code: np.ndarray, scale: np.ndarray, signed: bool) -> np.ndarray:
    """fp32 values of codes: table value times (scale / 1.875), rounded once."""
    code = code.astype(np.int64)
    if signed:
        mag = SIGNED[code & 0x7F] * np.where(code & 0x80, -1.0, 1.0)
    else:
        mag = UNSIGNED[code]
    step = (np.repeat(scale, QBLOCK)[: len(code)] / QMAX).astype(np.float32)
    return (mag.astype(np.float32) * step).astype(np.float32)


def encode_signed(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of one flat signed tensor alone (Lion's momentum: no second
    moment, so no zeroing rule), blocks from element 0."""
    codes, scales = [], []
    for i in range(0, len(m), QBLOCK):
        block = m[i : i + QBLOCK].astype(np.float32)
        amax = np.float32(np.abs(block).max(initial=0))
        inv = np.float32(QMAX / amax) if amax >= FLT_MIN else np.float32(0)
        y = (np.abs(block) * inv).astype(np.float32)  # one fp32 rounding, as the kernel
        code = _nearest(y.astype(np.float64), SIGNED) | (np.signbit(block).astype(np.int64) << 7)
        codes.append(code.astype(np.uint8))
        scales.append(amax)
    return np.concatenate(codes), np.array(scales, np.float32)
