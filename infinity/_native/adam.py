"""The native CPU-Adam contract: the integer codes of the kernel's dtypes and probes.

Defined once in ``cpp/simd/formats.hpp`` (``DType``) and
``cpp/simd/bandwidth.hpp`` and read here from ``infinity._C.adam``.
"""

from __future__ import annotations

import torch

from infinity._native import native

_adam = native().adam

GRAD_CODES: dict[torch.dtype, int] = {
    getattr(torch, name): int(code) for name, code in _adam.dtype_codes.items()
}
"""Code of each gradient dtype the kernel reads (fp32, bf16, fp16)."""
OUT16_CODES: dict[torch.dtype, int] = {
    getattr(torch, name): int(code) for name, code in _adam.out16_dtype_codes.items()
}
"""Code of each dtype the kernel's optional 16-bit parameter copy may have."""
BANDWIDTH_KERNELS: dict[str, int] = {
    str(name): int(code) for name, code in _adam.bandwidth_kernels.items()
}
"""Code of each memory-bandwidth probe of ``bandwidth_probe``, by name."""
STATE_FORMATS: dict[str, int] = {str(name): int(code) for name, code in _adam.state_formats.items()}
"""Code of each way the kernel stores the moments, by ``Config.optimizer_state_dtype``."""
STATE_ELEMENT_BYTES: dict[str, int] = {
    str(name): int(size) for name, size in _adam.state_element_bytes.items()
}
"""Bytes per element of one moment in each state format (int8: without block scales)."""
QBLOCK: int = int(_adam.QBLOCK)
"""Elements per int8 quantisation block (one fp32 scale each)."""
