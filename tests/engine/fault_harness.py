"""The fault-injection property: a short training run with states on NVMe in which
the n-th I/O fails must raise, or end bit-identical to the fault-free run.

One run: offload a tiny GPT (parameters, gradients and optimizer states partly
on NVMe), arm one fault in the native I/O engine, train two steps, save a
checkpoint, train a step, load the checkpoint back, train a step, read every
parameter and optimizer-state home, close. Used by ``test_io_faults.py`` (a
sample of n) and ``bench/fault_sweep.py`` (every n).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
from engine_helpers import batches, config, param_bytes, tiny_gpt, train

import infinity
from infinity.chunks.homes import Kind
from infinity.io import NVMeIOError
from infinity.io import swapfile as swapfile_module
from infinity.offload import engine_of
from infinity.optim import CPUAdam

# kind -> (what is counted, how the fault is armed)
KINDS = ("eio", "enospc", "eio-piece", "short", "submit", "submit-eagain")


@dataclass(frozen=True)
class Case:
    """One family of faults: a backend, a fault kind, and the run's variant."""

    backend: str
    kind: str
    buffered: bool = False  # the swap file falls back to buffered (O_DSYNC) I/O
    overlap: bool = False  # Config(overlap_optimizer=True): steps during backward
    # Half the chunks homed on the device (NOTE [chunks homed on the device]), the rest
    # on NVMe: a step updates some chunks there while others wait on the disk.
    homes: bool = False

    def __str__(self) -> str:
        extra = "".join(f"+{f}" for f in ("buffered", "overlap", "homes") if getattr(self, f))
        return f"{self.backend}/{self.kind}{extra}"


@dataclass
class Outcome:
    """What one run did: raised an error, or finished with these home bytes."""

    error: BaseException | None
    homes: dict | None
    reads: int  # read requests submitted
    writes: int  # write requests submitted
    pieces: int  # block_size pieces of all requests

    @property
    def requests(self) -> int:
        """Reads and writes submitted."""
        return self.reads + self.writes


def _arm(io, kind: str, nth: int) -> None:
    if kind == "eio":
        io.inject_fault(nth, errno.EIO, per="request")
    elif kind == "enospc":
        io.inject_fault(nth, errno.ENOSPC, per="request")
    elif kind == "eio-piece":
        io.inject_fault(nth, errno.EIO, per="piece")
    elif kind == "short":
        io.inject_short_transfer(nth)
    elif kind == "submit":
        io.inject_submit_error(nth, errno.EINVAL)
    elif kind == "submit-eagain":
        io.inject_submit_error(nth, errno.EAGAIN)
    else:
        raise ValueError(f"unknown fault kind {kind!r}")


@contextlib.contextmanager
def _refuse_o_direct() -> Iterator[None]:
    """Make the swap file's file system refuse O_DIRECT (the buffered fallback)."""
    real_open = os.open

    def open_without_direct(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, **kw)

    with mock.patch.object(swapfile_module.os, "open", open_without_direct):
        yield


def _offload(case: Case, workdir: str):
    model = tiny_gpt(layers=2)
    pbytes = param_bytes(model, 4)
    cfg = config(
        # 5x: half the chunks homed on the device (the rest on NVMe), as measured.
        device_memory=pbytes * 5 if case.homes else max(pbytes // 2, 80 << 10),
        host_memory=pbytes,
        chunk_size="16KiB",
        nvme_path=workdir,
        overlap_optimizer=case.overlap,
        # 8 KiB pieces: a 16 KiB chunk is two pieces (a fault can hit mid-request).
        aio={"backend": case.backend, "block_size": "8KiB", "queue_depth": 4},
    )
    if case.buffered:
        with _refuse_o_direct(), mock.patch("warnings.warn"):
            return infinity.offload(model, cfg)
    return infinity.offload(model, cfg)


def home_bytes(engine) -> dict:
    """Copies of every parameter and optimizer-state home (the whole training state)."""
    out = {}
    manager = engine.manager
    for key in manager.homes.keys():
        if key[0] is Kind.GRAD:
            continue
        region, copy = manager.open_host(key, writable=False)
        try:
            out[key] = region[: manager.homes.nbytes(key)].clone()
        finally:
            manager.close_host(copy, modified=False)
    return out


def run(case: Case, nth: int = 0, steps: int = 4) -> Outcome:
    """One training run with the ``nth`` fault of ``case`` armed (0: none)."""
    workdir = tempfile.mkdtemp(prefix="infinity-faults-")
    model = None
    try:
        model = _offload(case, workdir)
        engine = engine_of(model)
        io = engine.swap.engine
        counts = {"read": 0, "write": 0, "pieces": 0}
        submit = io._submit
        block = io.config.block_size

        def counting(write, tensor, *args):
            counts["write" if write else "read"] += 1
            counts["pieces"] += -(-tensor.numel() * tensor.element_size() // block)
            return submit(write, tensor, *args)

        io._submit = counting
        if nth:
            _arm(io, case.kind, nth)
        optimizer = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
        data = batches(steps)
        error, homes = None, None
        try:
            train(model, optimizer, data[:2])
            ckpt = os.path.join(workdir, "ckpt")
            infinity.save_checkpoint(ckpt, model, optimizer)
            train(model, optimizer, data[2:3])
            infinity.load_checkpoint(ckpt, model, optimizer)
            train(model, optimizer, data[3:])
            engine.synchronize()
            homes = home_bytes(engine)
            engine.close()
        except OSError as exc:
            error = exc
        return Outcome(error, homes, counts["read"], counts["write"], counts["pieces"])
    finally:
        if model is not None:
            with contextlib.suppress(OSError):
                engine_of(model).close()
        shutil.rmtree(workdir, ignore_errors=True)


def fired(case: Case, nth: int, outcome: Outcome) -> bool | None:
    """The armed fault met its n-th I/O in this run (None: cannot tell, for batch submissions)."""
    if case.kind in ("eio", "enospc"):
        return nth <= outcome.requests
    if case.kind in ("eio-piece", "short"):
        return nth <= outcome.pieces
    return None


def same(a: dict, b: dict) -> bool:
    """Bit-identical home bytes."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check(outcome: Outcome, reference: Outcome) -> str:
    """``"raised"`` or ``"identical"``; raises AssertionError if neither holds."""
    if outcome.error is not None:
        assert isinstance(outcome.error, NVMeIOError), repr(outcome.error)
        return "raised"
    assert same(outcome.homes, reference.homes), "no error raised, but the weights differ"
    return "identical"
