"""Asynchronous NVMe I/O: O_DIRECT reads and writes of host tensors, swap files, buffers.

Example::

    from infinity.io import IOEngine, SwapFile, aligned_empty

    with IOEngine({"block_size": "1M", "queue_depth": 32}) as eng, \\
            SwapFile("/mnt/nvme", "256MiB", eng) as sf:
        buf = aligned_empty(64 << 20)
        sf.write(buf, 0).wait()        # IORequest.wait() -> bytes; raises NVMeIOError
        sf.read(buf, 0).wait()

Buffers, offsets and lengths are multiples of 4096 bytes (O_DIRECT); anything
else is rejected with a ``ValueError`` before it reaches the native engine.
"""

from infinity.io.buffers import aligned_empty
from infinity.io.engine import IOEngine, available_backends
from infinity.io.request import IORequest, NVMeIOError, wait_all
from infinity.io.swapfile import SwapFile

__all__ = [
    "IOEngine",
    "IORequest",
    "NVMeIOError",
    "SwapFile",
    "aligned_empty",
    "available_backends",
    "wait_all",
]
