"""The native I/O contract: the O_DIRECT alignment and the engine's limits.

Defined once in ``cpp/io/limits.hpp`` and read here from ``infinity._C.io``,
so Python validation (``Config``, ``infinity.io``, the chunk layout, ``infinity
bench nvme``) checks exactly what the native engine enforces.

See NOTE [O_DIRECT alignment] (docs/NOTES.md).
"""

from __future__ import annotations

from infinity._native import native

_io = native().io

ALIGNMENT: int = int(_io.ALIGNMENT)
"""Bytes that buffer addresses, file offsets and lengths must be multiples of."""
MAX_BLOCK_SIZE: int = int(_io.MAX_BLOCK_SIZE)
"""Largest ``aio.block_size`` (the smallest is :data:`ALIGNMENT`)."""
MAX_QUEUE_DEPTH: int = int(_io.MAX_QUEUE_DEPTH)
"""Largest ``aio.queue_depth`` (pieces in flight per worker; the smallest is 1)."""
MAX_THREADS: int = int(_io.MAX_THREADS)
"""Largest ``aio.threads`` (the smallest is 1)."""
MAX_REGISTERED_BYTES: int = int(_io.MAX_REGISTERED_BYTES)
"""Largest span registered with io_uring at once (see NOTE [registered buffers])."""
