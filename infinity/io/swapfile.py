"""``SwapFile``: one preallocated, private file of fixed size for the NVMe tier.

The file lives in a fresh ``0700`` sub-directory of the directory the user
names, named after the owner process (:mod:`infinity.io.directories`: the next
swap file made there removes those of dead processes), is created ``0600``,
preallocated with ``fallocate`` (so a full disk fails now, not in the middle
of training), opened with
``O_DIRECT`` and removed (file and sub-directory) on :meth:`SwapFile.close`,
on garbage collection, and at interpreter exit.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from infinity._native import native
from infinity._native.io import ALIGNMENT
from infinity.io.directories import make_owned_dir, prepare_directory, reclaim_stale
from infinity.io.engine import IOEngine
from infinity.io.request import IORequest
from infinity.utils.sizes import format_size, parse_size

_warned_buffered: set[str] = set()  # file systems already warned about (one warning each)


def _open_file(path: str) -> tuple[int, bool]:
    """Create ``path`` 0600 and open it O_DIRECT; fall back to buffered I/O if refused.

    NOTE: the buffered fallback is opened ``O_DSYNC``: each write returns only
    once its data is on the device, so a write-back error fails that very
    write (with its errno) instead of surfacing, if ever, at a later
    ``fsync`` nobody calls, while reads meanwhile return stale bytes.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
        direct = True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise OSError(exc.errno, f"cannot create swap file '{path}': {exc.strerror}") from None
        fd = os.open(path, flags | os.O_DSYNC, 0o600)
        direct = False
    # The umask can only remove permission bits, but be explicit anyway.
    os.fchmod(fd, 0o600)
    return fd, direct


def _wait_quietly(pending: deque[IORequest]) -> None:
    # Errors belong to whoever waits on the request; here we only need the
    # kernel to be done with the file before it is closed and removed.
    if pending:
        native().io.wait_all([r._handle for r in pending], None)
    pending.clear()


def _cleanup(
    fd: int, path: str, private_dir: str, pending: deque[IORequest], engine: Any, pid: int
) -> None:
    """Finalizer: wait for the file's transfers, then close and remove it (never raises)."""
    if os.getpid() != pid:
        # A forked child closes its copy of the descriptor, nothing more:
        # see NOTE [fork and native threads] (docs/NOTES.md).
        _quietly(lambda: os.close(fd))
        return
    try:
        _wait_quietly(pending)
    finally:
        if engine is not None:
            engine.close()
        _quietly(lambda: os.close(fd), lambda: os.unlink(path), lambda: os.rmdir(private_dir))


def _quietly(*steps: Callable[[], object]) -> None:
    """Run each step, ignoring ``OSError``: already gone, or nothing left to do at exit."""
    for step in steps:
        try:
            step()
        except OSError:
            pass


class SwapFile:
    """A preallocated swap file of ``nbytes`` bytes in a private directory under ``directory``.

    Args:
        directory: where to put the private sub-directory. Created if missing
            (its parent must exist). Errors name the path: missing parent,
            not a directory, read-only or no permission, disk full.
        nbytes: size of the file, a positive multiple of 4096 (int or a size
            string like ``"64MiB"``).
        engine: the :class:`IOEngine` for :meth:`read`/:meth:`write`; None
            makes a private one (default :class:`~infinity.AioConfig`), closed
            with the file.
        name: stem of the file and sub-directory names (a plain file name).

    If the file system refuses ``O_DIRECT`` (``EINVAL``), the file is opened
    buffered and ``O_DSYNC`` (so every write reports its own write-back error)
    with a one-time warning and :attr:`direct` is False: the page cache then
    holds copies of swapped data and throughput numbers mean less.

    The file is removed on :meth:`close` (which first waits for the file's
    transfers), when the object is garbage collected, and at interpreter exit;
    after ``SIGKILL`` or ``os._exit``, the next swap file made in the same
    directory removes it (its directory names the owner process).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        nbytes: int | str,
        engine: IOEngine | None = None,
        *,
        name: str = "swap",
    ) -> None:
        try:
            size = parse_size(nbytes, name="nbytes")
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if size <= 0 or size % ALIGNMENT:
            raise ValueError(f"nbytes={nbytes!r} must be a positive multiple of {ALIGNMENT} bytes")
        bad_name = not isinstance(name, str) or name in ("", ".", "..")
        if bad_name or "/" in name or "\0" in name:
            raise ValueError(f"name={name!r} must be a plain file name (no '/')")
        if engine is not None and not isinstance(engine, IOEngine):
            raise TypeError(f"engine must be an IOEngine or None, got {type(engine).__name__}")
        if engine is not None and engine.closed:
            raise ValueError("engine is closed")

        root = Path(os.fspath(directory)).absolute()
        prepare_directory(root)
        reclaim_stale(root)
        try:
            private_dir = make_owned_dir(root, name)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot create a private directory in '{root}': {exc.strerror}"
            ) from None
        path = os.path.join(private_dir, f"{name}.bin")
        fd = -1
        try:
            fd, direct = _open_file(path)
            self._preallocate(fd, size, path, private_dir)
            own_engine = IOEngine() if engine is None else None
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _quietly(lambda: os.unlink(path), lambda: os.rmdir(private_dir))
            raise
        if not direct:
            fs_key = str(root)
            if fs_key not in _warned_buffered:
                _warned_buffered.add(fs_key)
                warnings.warn(
                    f"the file system of '{root}' does not support O_DIRECT; swap file I/O "
                    "goes through the page cache (slower, and uses host memory)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._fd = fd
        self._path = path
        self._private_dir = private_dir
        self._nbytes = size
        self._direct = direct
        self._engine: IOEngine = engine if engine is not None else cast(IOEngine, own_engine)
        self._pending: deque[IORequest] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _cleanup, fd, path, private_dir, self._pending, own_engine, os.getpid()
        )

    @staticmethod
    def _preallocate(fd: int, size: int, path: str, private_dir: str) -> None:
        # fallocate leaves unwritten extents, which ext4 converts on the
        # first write of each (measured: 1.7 GB/s against 3.9 GB/s overwriting a
        # written file). fio lays out its file the same way (fallocate(fd, 0, 0,
        # size)), and writing the file here would cost one full write of it at
        # offload, which the first write of each region pays anyway (issue 30).
        try:
            native().io.preallocate(fd, size, path)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                st = os.statvfs(private_dir)
                free = st.f_bavail * st.f_frsize
                raise OSError(
                    exc.errno,
                    f"cannot reserve {format_size(size)} ({size} bytes) for swap file '{path}': "
                    f"{os.strerror(exc.errno)}; {format_size(free)} ({free} bytes) free there",
                ) from None
            raise

    # --- properties -------------------------------------------------------------------
    @property
    def path(self) -> str:
        """Absolute path of the file (inside the private sub-directory)."""
        return self._path

    @property
    def directory(self) -> str:
        """The private sub-directory holding the file (removed with it)."""
        return self._private_dir

    @property
    def nbytes(self) -> int:
        """Size of the file in bytes."""
        return self._nbytes

    @property
    def direct(self) -> bool:
        """True if the file is opened with O_DIRECT (False: buffered fallback)."""
        return self._direct

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def engine(self) -> IOEngine:
        """The engine used by :meth:`read` and :meth:`write`."""
        return self._engine

    def fileno(self) -> int:
        """The file descriptor (ValueError once closed)."""
        self._check_open()
        return self._fd

    # --- I/O --------------------------------------------------------------------------
    def read(self, tensor: torch.Tensor, offset: int) -> IORequest:
        """Start reading ``tensor.nbytes`` bytes at ``offset`` into ``tensor``."""
        return self._engine.read(tensor, self, offset)

    def write(self, tensor: torch.Tensor, offset: int) -> IORequest:
        """Start writing ``tensor`` at ``offset``."""
        return self._engine.write(tensor, self, offset)

    def _io_target(self, offset: int, nbytes: int) -> tuple[int, str]:
        """Called by IOEngine before submitting: checks state and range, gives (fd, path)."""
        self._check_open()
        if offset + nbytes > self._nbytes:
            raise ValueError(
                f"region [{offset}, {offset + nbytes}) is outside swap file '{self._path}' "
                f"of {self._nbytes} bytes"
            )
        return self._fd, self._path

    def _io_track(self, request: IORequest) -> None:
        """Called by IOEngine after submitting: close() waits for tracked requests."""
        with self._lock:
            while self._pending and self._pending[0].done():
                self._pending.popleft()
            self._pending.append(request)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"swap file '{self._path}' is closed")

    # --- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Wait for this file's transfers, then close and remove it. Idempotent."""
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("O_DIRECT" if self._direct else "buffered")
        return f"<SwapFile {self._path!r} {format_size(self._nbytes)} {state}>"
