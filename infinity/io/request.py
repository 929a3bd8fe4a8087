"""One transfer: its arguments checked (``check_tensor``, ``check_offset``,
``resolve_file``), its completion handle (``IORequest``, ``wait_all``) and its
failure (``NVMeIOError``: an ``OSError`` with the errno and the file).

The checks run in Python before anything reaches the native engine: everything
that could make a pointer wrong (device, layout, contiguity, lazy conj/neg
views) or break the O_DIRECT contract (alignment of address, length and offset)
is rejected with a message that names the value and what would work.

See NOTE [raw pointers into native code] and NOTE [O_DIRECT alignment] (docs/NOTES.md).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from typing import Any

import torch

from infinity._native import native
from infinity._native.io import ALIGNMENT


class NVMeIOError(OSError):
    """A read or write of the I/O engine failed.

    An ``OSError`` subclass, so ``except OSError`` catches it and ``.errno``
    compares with the :mod:`errno` constants (``errno.ENOSPC``, ``errno.EIO``,
    ``errno.ENODATA`` for a read past the end of the file). ``.filename`` is
    the file's path; ``.offset`` and ``.nbytes`` locate the request; the
    message (``.strerror`` and ``str()``) names the operation, path, offset,
    length, the failing piece and ``strerror(errno)``.
    """

    errno: int  # never None here, unlike a bare OSError's

    def __init__(
        self,
        errno: int,
        message: str,
        filename: str | None = None,
        *,
        op: str | None = None,
        offset: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        super().__init__(errno, message, filename)
        self.op = op
        self.offset = offset
        self.nbytes = nbytes

    def __str__(self) -> str:
        # OSError's own __str__ appends ": '<filename>'", but the message
        # already names the path (in context), so it would repeat it.
        return f"[Errno {self.errno}] {self.strerror}"


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


def check_tensor(tensor: Any, what: str = "tensor") -> tuple[int, int]:
    """Return ``(data_ptr, nbytes)`` of a tensor the engine may transfer, else raise.

    Raises TypeError for a non-tensor and ValueError for anything the engine
    cannot use directly (no bounce buffers are made: see :class:`IOEngine`).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{what} is on {tensor.device}; the I/O engine moves host memory only: "
            "copy through a CPU tensor from infinity.io.aligned_empty()"
        )
    if tensor.layout != torch.strided:
        raise ValueError(f"{what} has layout {tensor.layout}; only dense (strided) tensors")
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"{what} is a lazy conj/neg view; call .resolve_conj()/.resolve_neg()")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous; the engine needs one contiguous byte range")
    nbytes = tensor.numel() * tensor.element_size()
    ptr = tensor.data_ptr()
    if ptr % ALIGNMENT:
        raise ValueError(
            f"{what}.data_ptr()=0x{ptr:x} is not {ALIGNMENT}-byte aligned (O_DIRECT needs aligned "
            "buffers); allocate it with infinity.io.aligned_empty()"
        )
    if nbytes % ALIGNMENT:
        raise ValueError(
            f"{what} has {nbytes} bytes, not a multiple of {ALIGNMENT} (O_DIRECT needs whole "
            f"{ALIGNMENT // 1024} KiB blocks); pad the buffer"
        )
    return ptr, nbytes


def check_offset(offset: Any) -> int:
    """Return ``offset`` if it is a non-negative multiple of ``ALIGNMENT``, else raise."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"offset={offset} is negative")
    if offset % ALIGNMENT:
        raise ValueError(
            f"offset={offset} is not a multiple of {ALIGNMENT} (O_DIRECT alignment); "
            f"e.g. {offset // ALIGNMENT * ALIGNMENT} or {(offset // ALIGNMENT + 1) * ALIGNMENT}"
        )
    return offset


def resolve_file(target: Any) -> tuple[int, str]:
    """``(fd, path)`` of an int fd or an object with ``.fileno()`` (and ``.path`` or ``.name``)."""
    if isinstance(target, bool):
        raise TypeError("fd_or_file must be a file descriptor or a file object, got a bool")
    if isinstance(target, int):
        fd = target
        path = None
    elif callable(getattr(target, "fileno", None)):
        fd = target.fileno()
        path = getattr(target, "path", None) or getattr(target, "name", None)
    else:
        raise TypeError(
            "fd_or_file must be a SwapFile, an object with .fileno() and .path, or an int fd; "
            f"got {type(target).__name__}"
        )
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise ValueError(f"fileno()={fd!r} is not an open file descriptor")
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        raise ValueError(f"file descriptor {fd} is not open ({exc.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
        raise ValueError(f"file descriptor {fd} is not a regular file or block device")
    if not isinstance(path, (str, os.PathLike)):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = f"<fd {fd}>"
    return fd, os.fspath(path)
