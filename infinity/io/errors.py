"""``NVMeIOError``: a failed transfer, as an ``OSError`` with the errno and the file."""

from __future__ import annotations


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
