"""The first failed NVMe transfer of a chunk home, kept until someone acts on it.

Every read and write of a chunk's NVMe home is a :class:`WatchedTransfer`. A
failure is recorded the first time anyone sees it (``done()`` polls included)
and, through :meth:`IOFailures.sweep`, even when nobody looks at that request
again: the engine checks at each of its entry points. The first failure is
*sticky*: once recorded, the engine refuses to go on, because the bytes of at
least one chunk can no longer be trusted (a read that did not land, or a home
that does not hold what was written).
"""

from __future__ import annotations

from infinity.core.names import Key
from infinity.io import IORequest, NVMeIOError

FIX = (
    "the model's weights and optimizer states are no longer reliable: load the last "
    "checkpoint into a freshly offloaded model (infinity.load_checkpoint) and continue "
    "from there"
)


def _describe(key: Key) -> str:
    kind, index = key[0], key[1]  # NOTE: a span key carries its element range after these
    return f"{getattr(kind, 'value', kind)} chunk {index}"


class IOFailures:
    """The sticky first I/O error of one chunk manager, and its unchecked transfers."""

    def __init__(self) -> None:
        self.first: NVMeIOError | None = None
        self.reported = False  # the first error was raised at a caller at least once
        self._watched: list[WatchedTransfer] = []

    def watch(self, request: IORequest, key: Key) -> WatchedTransfer:
        """Wrap a just-submitted transfer of ``key``'s home so its outcome is never lost."""
        if len(self._watched) > 64:
            self.sweep()
        watched = WatchedTransfer(request, key, self)
        self._watched.append(watched)
        return watched

    def record(self, error: NVMeIOError, key: Key, *, raised: bool) -> NVMeIOError:
        """Note a failed transfer of ``key``; returns the error to raise (the first one).
        ``raised``: the caller raises it now (else it waits for the next check)."""
        if self.first is None:
            what = _describe(key)
            first = NVMeIOError(
                error.errno,
                f"{what}: {error.strerror}. {FIX[0].upper()}{FIX[1:]}",
                error.filename,
                op=error.op,
                offset=error.offset,
                nbytes=error.nbytes,
            )
            first.chunk = what  # type: ignore[attr-defined]
            self.first = first
        self.reported = self.reported or raised
        # NOTE: raised again and again: a fresh traceback each time, not an ever longer one.
        return self.first.with_traceback(None)

    def sweep(self) -> None:
        """Look at every finished transfer: record a failure, forget the successes."""
        running = []
        for watched in self._watched:
            if not watched.request.done():
                running.append(watched)
            else:
                watched.done()  # records a failure
        self._watched = running

    def check(self) -> None:
        """Raise if a transfer has failed: the first error, or (once that was raised)
        a refusal naming it."""
        self.sweep()
        first = self.first
        if first is None:
            return
        if not self.reported:
            self.reported = True
            raise first.with_traceback(None)
        raise NVMeIOError(
            first.errno,
            f"this offloaded model stopped after an earlier I/O error and refuses to run: "
            f"{first.strerror}",
            first.filename,
            op=first.op,
            offset=first.offset,
            nbytes=first.nbytes,
        )

    def raise_unreported(self) -> None:
        """Raise the first error if it was never raised at a caller (``close``)."""
        self.sweep()
        if self.first is not None and not self.reported:
            self.reported = True
            raise self.first.with_traceback(None)


class WatchedTransfer:
    """An NVMe transfer of one chunk home whose failure is recorded when first seen.

    ``wait()`` raises the manager's first error (naming the chunk, the file,
    the offset and the errno) whenever this transfer failed, every time it is
    called: a failed read is never taken for landed data, a failed write
    never for a clean home.
    """

    __slots__ = ("_failures", "key", "request")

    def __init__(self, request: IORequest, key: Key, failures: IOFailures) -> None:
        self.request = request
        self.key = key
        self._failures = failures

    def done(self) -> bool:
        """Finished, successfully or not (a failure is recorded, not raised)."""
        if not self.request.done():
            return False
        error = self.request.exception()
        if error is not None:
            self._failures.record(error, self.key, raised=False)
        return True

    def wait(self) -> int:
        """Block until finished; raise the first I/O error if this transfer failed."""
        try:
            return self.request.wait()
        except NVMeIOError as exc:
            first = self._failures.record(exc, self.key, raised=True)
        raise first
