"""``IOEngine``: asynchronous O_DIRECT reads and writes of host tensors.

A thin, validating front of the native engine ``infinity._C.io.Engine``: each
request is split into ``block_size`` pieces kept ``queue_depth`` deep in the
kernel by each of ``threads`` workers. Every completion is checked; a failure
surfaces from :meth:`IORequest.wait` as :class:`NVMeIOError`.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from typing import Any

import torch

from infinity._native import native
from infinity._native.io import MAX_REGISTERED_BYTES
from infinity.config import AioConfig, ConfigError
from infinity.io.request import IORequest, check_offset, check_tensor, resolve_file


def available_backends() -> list[str]:
    """Backends that work on this machine, best first (e.g. ``["io_uring", "aio", "threads"]``).

    Each is probed once per process by a real write and read-back on an
    in-memory file, so a backend the kernel has but a sandbox forbids (for
    instance io_uring under a seccomp filter) is not listed.
    """
    return list(native().io.available_backends())


def _resolve_config(aio: AioConfig | dict[str, Any] | None) -> AioConfig:
    if aio is None:
        return AioConfig()
    if isinstance(aio, AioConfig):
        # Re-validate: a dataclass can be mutated after construction.
        return AioConfig(aio.backend, aio.block_size, aio.queue_depth, aio.threads)
    if isinstance(aio, dict):
        return AioConfig.from_dict(aio)
    raise ConfigError(f"aio={aio!r} must be an AioConfig, a dict of its fields, or None")


def _resolve_backend(name: str) -> str:
    probes = native().io.probe_results()
    if name == "auto":
        working = available_backends()
        if not working:  # the thread pool needs only pread/pwrite: should not happen
            reasons = "; ".join(f"{k}: {v}" for k, v in probes.items())
            raise RuntimeError(f"no I/O backend works on this machine ({reasons})")
        return working[0]
    if probes[name]:
        raise RuntimeError(
            f"aio.backend={name!r} does not work on this machine ({probes[name]}); "
            f"available: {', '.join(available_backends())} (or use 'auto')"
        )
    return name


_MAX_ERRNO = 4095  # Linux's largest errno (MAX_ERRNO), unrelated to the I/O alignment


def _close_native(handle: Any, _registered: list[torch.Tensor]) -> None:
    handle.close()


class IOEngine:
    """Asynchronous reads and writes between host tensors and files.

    Args:
        aio: an :class:`infinity.AioConfig`, a dict of its fields, or None for
            the defaults. ``backend="auto"`` resolves to the first of
            :func:`available_backends` (see :attr:`backend`).

    Buffers, offsets and lengths must be multiples of 4096 bytes (the
    O_DIRECT alignment); a request that is not is **rejected** with a
    ``ValueError`` naming the value: the engine never copies through a bounce
    buffer, whose hidden cost (an extra memcpy and pinned memory per request)
    is what callers should see and avoid. Allocate buffers with
    :func:`aligned_empty`.

    Closing (``close()``, the end of a ``with`` block, garbage collection or
    interpreter exit) waits for every request still queued or in flight.
    Methods may be called from several threads. An engine cannot be used in
    a child created by ``fork()`` after it (its worker threads exist only in
    the parent): that raises ``RuntimeError``; make a new engine there.

    Fault injection for tests: :meth:`inject_fault`, :meth:`inject_short_transfer`,
    :meth:`inject_submit_error`, :meth:`inject_worker_failure` and :meth:`inject_delay`.
    """

    def __init__(self, aio: AioConfig | dict[str, Any] | None = None) -> None:
        self.config = _resolve_config(aio)
        self._backend = _resolve_backend(self.config.backend)
        self._native = native().io.Engine(
            self._backend, self.config.block_size, self.config.queue_depth, self.config.threads
        )
        # Unfinished requests, oldest first: they hold the tensors under
        # transfer. See NOTE [raw pointers into native code] (docs/NOTES.md).
        self._inflight: deque[IORequest] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self.requests_submitted = 0  # reads and writes handed to the native engine so far
        self._pid = os.getpid()
        # The finalizer holds registered buffers until the native engine has
        # closed. See NOTE [registered buffers] (docs/NOTES.md).
        self._registered: list[torch.Tensor] = []
        self._finalizer = weakref.finalize(self, _close_native, self._native, self._registered)

    @property
    def backend(self) -> str:
        """The backend in use: ``"io_uring"``, ``"aio"`` or ``"threads"`` (never ``"auto"``)."""
        return self._backend

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def read(self, tensor: torch.Tensor, fd_or_file: Any, offset: int) -> IORequest:
        """Start reading ``tensor.nbytes`` bytes at ``offset`` of the file into ``tensor``.

        ``fd_or_file``: a :class:`SwapFile` (the range is checked against its
        size), an object with ``.fileno()`` and ``.path``, or an int fd (the
        caller keeps it open until the request is done). Reading past the end
        of the file fails the request with ``errno.ENODATA``.
        """
        return self._submit(False, tensor, fd_or_file, offset)

    def write(self, tensor: torch.Tensor, fd_or_file: Any, offset: int) -> IORequest:
        """Start writing ``tensor`` to the file at ``offset`` (see :meth:`read`)."""
        return self._submit(True, tensor, fd_or_file, offset)

    def _submit(self, write: bool, tensor: torch.Tensor, target: Any, offset: int) -> IORequest:
        self._check_open()
        ptr, nbytes = check_tensor(tensor)
        offset = check_offset(offset)
        io_target = getattr(target, "_io_target", None)
        if io_target is not None:  # a SwapFile: checks closed state and range
            fd, path = io_target(offset, nbytes)
        else:
            fd, path = resolve_file(target)
        op = "write" if write else "read"
        with self._lock:
            if self._closed:
                raise RuntimeError("this IOEngine is closed; create a new one")
            handle = self._native.submit(write, ptr, nbytes, fd, offset, path)
            self.requests_submitted += 1
            request = IORequest(handle, tensor, target, op, offset, path, self._pid)
            while self._inflight and self._inflight[0].done():
                self._inflight.popleft()
            self._inflight.append(request)
        track = getattr(target, "_io_track", None)
        if track is not None:
            track(request)
        return request

    def register_buffers(self, tensors: list[torch.Tensor]) -> str | None:
        """Hand long-lived buffers to the kernel once (io_uring fixed buffers).

        Transfers that fall inside one of them then skip pinning their pages
        on every request, which is most of the kernel's CPU time per byte.
        Optional and only once per engine: returns ``None`` when registered,
        else the reason it was not (another backend, ``RLIMIT_MEMLOCK``, ...);
        every transfer works either way. The engine keeps the tensors alive.
        Buffers from :func:`aligned_empty` of 16 MiB or more are huge-page backed,
        which the kernel needs to keep large transfers in one request: see
        NOTE [huge I/O buffers] (docs/NOTES.md).
        """
        self._check_open()
        spans = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"tensors[{i}] must be a contiguous CPU tensor")
            nbytes = t.numel() * t.element_size()
            # Spans of at most MAX_REGISTERED_BYTES: see NOTE [registered buffers].
            for start in range(0, nbytes, MAX_REGISTERED_BYTES):
                spans.append((t.data_ptr() + start, min(MAX_REGISTERED_BYTES, nbytes - start)))
        if not spans:
            return None
        if self._backend != "io_uring":
            return f"the {self._backend} backend has no registered buffers"
        if self._registered:
            return "buffers are already registered (once per engine)"
        err = self._native.register_buffers(spans)
        if err:
            return f"io_uring_register(IORING_REGISTER_BUFFERS): {os.strerror(err)} (errno {err})"
        self._registered.extend(tensors)
        return None

    @property
    def fixed_transfers(self) -> int:
        """Pieces moved through registered buffers so far (see :meth:`register_buffers`)."""
        return int(self._native.fixed_transfers)

    @property
    def busy_seconds(self) -> float:
        """Seconds so far during which this engine had at least one piece of a
        request in flight (handed to a worker, not yet finished): the time the
        disk had work from it. Against a wall-clock interval it says how much of
        that interval the disk was idle, as far as this engine is concerned.
        """
        return float(self._native.busy_seconds)

    def inject_fault(self, nth: int, errno: int, *, per: str = "piece") -> None:
        """Make the ``nth`` submission from now on fail with ``errno`` (one shot; 0 disarms).

        ``per="piece"`` counts ``block_size`` pieces across all requests (the
        ``nth`` piece handed to the kernel fails; pieces of the same request
        already in flight finish); ``per="request"`` counts requests and fails
        the first piece of the ``nth``. The failed request raises
        :class:`NVMeIOError` with that errno from ``wait()``. For tests.
        """
        if isinstance(nth, bool) or not isinstance(nth, int) or nth < 0:
            raise ValueError(f"nth={nth!r} must be an int >= 0 (1 = the next one, 0 = disarm)")
        if isinstance(errno, bool) or not isinstance(errno, int) or not 0 < errno <= _MAX_ERRNO:
            raise ValueError(f"errno={errno!r} must be a positive errno value, e.g. errno.EIO")
        if per not in ("piece", "request"):
            raise ValueError(f"per={per!r} must be 'piece' or 'request'")
        self._check_open()
        self._native.inject_fault(nth, errno, per == "request")

    def inject_short_transfer(self, nth: int) -> None:
        """Submit the ``nth`` piece from now on with about half its length (one shot; 0 disarms).

        The kernel then returns a short transfer, which the engine must
        continue from where it stopped; the request still succeeds with the
        right bytes. Only pieces longer than 4 KiB can be shortened. For tests.
        """
        if isinstance(nth, bool) or not isinstance(nth, int) or nth < 0:
            raise ValueError(f"nth={nth!r} must be an int >= 0 (1 = the next one, 0 = disarm)")
        self._check_open()
        self._native.inject_short_transfer(nth)

    def inject_submit_error(self, nth: int, errno: int) -> None:
        """Make the ``nth`` batch submission to the kernel from now on fail with ``errno``
        (one shot; 0 disarms), as if ``io_uring_enter``/``io_submit`` had returned it.

        Goes through the backend's real error path: a transient ``EAGAIN`` is
        retried, any other errno fails every piece of that batch. The
        ``threads`` backend submits no batches and never fails this way. For tests.
        """
        if isinstance(nth, bool) or not isinstance(nth, int) or nth < 0:
            raise ValueError(f"nth={nth!r} must be an int >= 0 (1 = the next one, 0 = disarm)")
        if isinstance(errno, bool) or not isinstance(errno, int) or not 0 < errno <= _MAX_ERRNO:
            raise ValueError(f"errno={errno!r} must be a positive errno value, e.g. errno.EIO")
        self._check_open()
        self._native.inject_submit_error(nth, errno)

    def inject_worker_failure(self, count: int = 1) -> None:
        """Make the workers fail internally ``count`` times from now on (0 disarms).

        The first failure breaks a worker (as a bug or an exhausted memory
        would): it fails what it holds and everything it is handed with
        ``EIO`` until the engine closes. A second one hits it while it does
        so; it must still fail requests, never leave a waiter hanging. For tests.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count={count!r} must be an int >= 0")
        self._check_open()
        self._native.inject_worker_failure(count)

    def inject_delay(self, us: int) -> None:
        """Delay the start of every request submitted from now on by ``us`` microseconds.

        Simulates a slow disk: results are unchanged, only timing moves. 0 disables. For tests.
        """
        if isinstance(us, bool) or not isinstance(us, int) or us < 0:
            raise ValueError(f"us={us!r} must be an int >= 0 (microseconds)")
        self._check_open()
        self._native.inject_delay(us)

    def close(self) -> None:
        """Wait for every queued and in-flight request, then stop the workers. Idempotent."""
        with self._lock:
            self._closed = True
        self._finalizer()  # runs _close_native once (GIL released while draining)
        self._inflight.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this IOEngine is closed; create a new one")
        if os.getpid() != self._pid:
            # See NOTE [fork and native threads] (docs/NOTES.md).
            raise RuntimeError(
                "this IOEngine was created before fork(); create a new one in the child process"
            )

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        state = "closed" if self._closed else f"{len(self._inflight)} tracked"
        return (
            f"<IOEngine backend={self._backend} block_size={c.block_size} "
            f"queue_depth={c.queue_depth} threads={c.threads} {state}>"
        )
