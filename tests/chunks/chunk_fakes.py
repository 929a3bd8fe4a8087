"""Fakes for driving a ``ChunkManager`` deterministically, and small hand-made plans.

``HeldBackend`` is a device backend whose copies happen only when the test
releases them (or when someone waits on them, which is what a real wait
blocks for); it records every wait that would block and every copy that would have touched
memory another unfinished copy is still writing or reading. ``GatedSwap``
wraps a real :class:`~infinity.io.SwapFile` and holds every read and write until
the test releases it, in any order it likes, or fails it with an errno.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from infinity.core.names import HOST, Tier
from infinity.core.plan import Budgets, ChunkLayout, ChunkSpec, Plan, TensorSlot
from infinity.devices.base import DeviceBackend, TransferHandle
from infinity.devices.cpu import CpuBackend
from infinity.io import IOEngine, NVMeIOError, SwapFile, aligned_empty
from infinity.utils.sizes import align_up

CHUNK_ELEMS = 1024  # fp32: 4 KiB chunks, the I/O alignment
CHUNK_BYTES = CHUNK_ELEMS * 4


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


class HeldCopy(TransferHandle):
    """A device copy that lands only on :meth:`release` (or a wait)."""

    def __init__(self, backend: HeldBackend, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.backend, self.dst, self.src = backend, dst, src
        self.finished = False

    def release(self) -> None:
        """Let the copy land now."""
        if not self.finished:
            self.dst.copy_(self.src)
            self.finished = True

    def wait(self) -> None:
        if not self.finished:  # a wait that would block
            self.backend.waited.append(self)
        self.release()

    def done(self) -> bool:
        return self.finished


class HeldBackend(DeviceBackend):
    """Device and host memory in RAM; copies complete only when released."""

    name = "held"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.copies: list[HeldCopy] = []
        self.waited: list[HeldCopy] = []
        self.violations: list[str] = []  # copies racing with an unfinished one

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pinned=False).zero_()

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pinned=False).zero_()

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> TransferHandle:
        for other in self.unfinished():
            if _overlap(dst, other.dst) or _overlap(dst, other.src) or _overlap(src, other.dst):
                self.violations.append(f"copy into {_span(dst)} races an unfinished copy")
        handle = HeldCopy(self, dst, src)
        self.copies.append(handle)
        return handle

    def alias(self, region: torch.Tensor) -> torch.Tensor:
        return CpuBackend.alias(self, region)  # type: ignore[arg-type]

    def unfinished(self) -> list[HeldCopy]:
        """Copies submitted and not landed yet."""
        return [c for c in self.copies if not c.finished]

    def release_all(self) -> None:
        """Let every copy land."""
        for copy in self.unfinished():
            copy.release()

    def synchronize(self) -> None:
        self.release_all()


class GatedRequest:
    """One held swap-file transfer, with the ``IORequest`` surface the chunk layer uses."""

    def __init__(self, gate: GatedSwap, op: str, tensor: torch.Tensor, offset: int) -> None:
        self.gate, self.op, self.tensor, self.offset = gate, op, tensor, offset
        self.nbytes = tensor.numel()
        self.released = False
        self.error: NVMeIOError | None = None

    def release(self, fail_errno: int | None = None) -> None:
        """Run the real transfer now, or fail it with ``fail_errno`` without touching the file."""
        if self.released:
            return
        self.released = True
        if fail_errno is not None:
            self.error = NVMeIOError(
                fail_errno,
                os.strerror(fail_errno),
                self.gate.swap.path,
                op=self.op,
                offset=self.offset,
                nbytes=self.nbytes,
            )
            return
        run = self.gate.swap.read if self.op == "read" else self.gate.swap.write
        run(self.tensor, self.offset).wait()

    def done(self) -> bool:
        return self.released

    def exception(self) -> NVMeIOError | None:
        return self.error

    def wait(self) -> int:
        if not self.released:  # a wait that would block
            self.gate.waited.append(self)
        self.release()
        if self.error is not None:
            raise self.error
        return self.nbytes


class GatedSwap:
    """A real swap file whose transfers start only when the test releases them."""

    def __init__(self, swap: SwapFile) -> None:
        self.swap = swap
        self.requests: list[GatedRequest] = []
        self.waited: list[GatedRequest] = []

    @property
    def nbytes(self) -> int:
        """Size of the wrapped file."""
        return self.swap.nbytes

    @property
    def engine(self) -> IOEngine:
        """The wrapped file's I/O engine (the manager registers staging slabs with it)."""
        return self.swap.engine

    def read(self, tensor: torch.Tensor, offset: int) -> GatedRequest:
        """Hold a read of ``tensor``'s bytes from ``offset``."""
        request = GatedRequest(self, "read", tensor, offset)
        self.requests.append(request)
        return request

    def write(self, tensor: torch.Tensor, offset: int) -> GatedRequest:
        """Hold a write of ``tensor`` at ``offset`` (its bytes are taken on release)."""
        request = GatedRequest(self, "write", tensor, offset)
        self.requests.append(request)
        return request

    def held(self, op: str | None = None) -> list[GatedRequest]:
        """Transfers not yet released (of ``op`` only, if given)."""
        return [r for r in self.requests if not r.released and op in (None, r.op)]

    def read_back(self, offset: int, nbytes: int) -> torch.Tensor:
        """The file's bytes at ``offset`` now (a direct, ungated read)."""
        buf = aligned_empty(nbytes, pinned=False)
        self.swap.read(buf, offset).wait()
        return buf


def small_plan(
    numels: Sequence[Sequence[int]],
    *,
    param_home: Sequence[Tier] | None = None,
    grad_home: Sequence[Tier | None] | None = None,
    device_slots: int = 2,
    staging: dict[str, int] | None = None,
    device_budget: int | None = None,
) -> Plan:
    """A plan of one 4 KiB fp32 chunk per entry of ``numels`` (the sizes of the tensors
    packed into it, in order), homes on the host unless given; optimizer units live
    with the gradients; ``staging`` gives host staging slots per kind."""
    chunks, slots = [], []
    for c, sizes in enumerate(numels):
        specs, offset = [], 0
        for n in sizes:
            specs.append(TensorSlot(index=len(slots), chunk=c, offset=offset, numel=n, shape=(n,)))
            slots.append(specs[-1])
            offset = align_up(offset + n, 16)  # tensors start 64 bytes apart, as build_layout does
        assert offset <= CHUNK_ELEMS, f"chunk {c}'s tensors do not fit in {CHUNK_ELEMS} elements"
        chunks.append(ChunkSpec(c, CHUNK_ELEMS, tuple(specs), trainable=True, oversize=False))
    layout = ChunkLayout(CHUNK_ELEMS, 4, tuple(chunks), tuple(slots))
    n = layout.num_chunks
    params = tuple(param_home or [HOST] * n)
    grads = tuple(grad_home or [HOST] * n)
    return Plan(
        layout=layout,
        element_size=4,
        has_master=False,
        state_slots=("exp_avg", "exp_avg_sq"),
        param_home=params,
        grad_home=grads,
        optim_home=grads,
        device_slots={CHUNK_BYTES: device_slots},
        host_staging={kind: {CHUNK_BYTES: count} for kind, count in (staging or {}).items()},
        budgets=Budgets(
            device=device_budget or device_slots * CHUNK_BYTES, host=1 << 30, nvme=1 << 30
        ),
    )
