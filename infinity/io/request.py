"""``IORequest`` (one transfer's completion handle) and ``wait_all``."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from infinity._native import native
from infinity.io.errors import NVMeIOError


class IORequest:
    """The completion handle of one :meth:`IOEngine.read` or :meth:`IOEngine.write`.

    It keeps the tensor (and the file object) alive until the transfer is seen to
    have finished (``done()`` true, or ``wait()`` returned), so the memory under a
    transfer cannot be freed; the engine also keeps every unfinished request, so
    dropping this handle early is safe too.

    NOTE: not until the handle is dropped: the engine and the swap file keep their
    last requests until their next submission, and a finished write's buffer then
    stayed alive beside the one its owner counted (the activation store's write
    window: found by counting the allocator against the budget's lines).

    NOTE: do not resize or ``set_()`` the tensor while the transfer runs: that
    would move its memory under the kernel.
    """

    __slots__ = ("_file", "_handle", "_pid", "_tensor", "nbytes", "offset", "op", "path")

    def __init__(
        self,
        handle: Any,
        tensor: torch.Tensor,
        file: Any,
        op: str,
        offset: int,
        path: str,
        pid: int,
    ) -> None:
        self._handle = handle
        self._pid = pid
        self._tensor: torch.Tensor | None = tensor
        self._file: Any = file
        self.op = op
        self.offset = offset
        self.nbytes: int = handle.nbytes
        self.path = path

    @property
    def tensor(self) -> torch.Tensor | None:
        """The tensor being read into or written from (``None`` once it is seen finished)."""
        return self._tensor

    def _finished(self) -> None:
        """The transfer is over: the memory under it is the caller's again."""
        self._tensor = None
        self._file = None

    @property
    def bytes_done(self) -> int:
        """Bytes transferred so far (for progress; the final count is ``wait()``'s)."""
        return int(self._handle.bytes_done)

    def done(self) -> bool:
        """True once the transfer has finished, successfully or not (never blocks)."""
        if not self._handle.done():
            return False
        self._finished()
        return True

    def exception(self) -> NVMeIOError | None:
        """The error of a finished, failed transfer; None if it succeeded or is still running."""
        err = self._handle.error()
        if err is None:
            return None
        code, message = err
        return NVMeIOError(
            code, message, self.path, op=self.op, offset=self.offset, nbytes=self.nbytes
        )

    def wait(self, timeout: float | None = None) -> int:
        """Block until the transfer finishes; return the bytes transferred (``nbytes``).

        The GIL is released while waiting, and Ctrl-C interrupts the wait
        (the transfer itself carries on). Raises :class:`NVMeIOError` if the
        transfer failed, ``TimeoutError`` if ``timeout`` seconds pass first.
        """
        self._check_process()
        if not self._handle.wait(timeout):
            raise TimeoutError(
                f"{self.op} of {self.nbytes} bytes at offset {self.offset} of '{self.path}' "
                f"did not finish within {timeout} s"
            )
        self._finished()
        error = self.exception()
        if error is not None:
            raise error
        return self.nbytes

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            # See NOTE [fork and native threads] (docs/NOTES.md).
            raise RuntimeError(
                "this IORequest was started before fork(); wait for it in the parent"
            )

    def __repr__(self) -> str:
        state = "done" if self.done() else f"{self.bytes_done}/{self.nbytes} bytes"
        return f"<IORequest {self.op} {self.path!r} offset={self.offset} {state}>"


def wait_all(requests: Iterable[IORequest], timeout: float | None = None) -> int:
    """Wait for every request, even if some fail, then raise the first failure.

    "First" is in the order given. Returns the total bytes transferred. The
    GIL is released for the whole wait. Raises ``TimeoutError`` if
    ``timeout`` seconds pass before all are done.
    """
    reqs = list(requests)
    for r in reqs:
        if not isinstance(r, IORequest):
            raise TypeError(f"wait_all takes IORequest objects, got {type(r).__name__}")
        r._check_process()
    if not native().io.wait_all([r._handle for r in reqs], timeout):
        pending = sum(not r.done() for r in reqs)
        raise TimeoutError(f"{pending} of {len(reqs)} requests did not finish within {timeout} s")
    for r in reqs:
        r._finished()
    for r in reqs:
        error = r.exception()
        if error is not None:
            raise error
    return sum(r.nbytes for r in reqs)
