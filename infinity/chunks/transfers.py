"""Two-stage transfers: NVMe -> host staging, then host -> device.

The second stage may start only when the first has landed. Rather than a
thread per transfer, the chain advances whenever anyone looks at it (a
``done()`` poll from the prefetcher or an eviction check) or waits on it.
"""

from __future__ import annotations

from collections.abc import Callable

from infinity.chunks.cache import Pending


class ChainedTransfer:
    """``first`` (an NVMe read, or ``None`` if the data is already on the host),
    then ``start()`` (the host -> device copy)."""

    __slots__ = ("_first", "_second", "_start")

    def __init__(self, first: Pending | None, start: Callable[[], Pending]) -> None:
        self._first = first
        self._start = start
        self._second: Pending | None = None
        if first is None:
            self._second = start()
        else:
            self._advance()

    def _advance(self) -> None:
        if self._second is None and self._first is not None and self._first.done():
            self._first.wait()  # surfaces a failed read here, with its path and errno
            self._second = self._start()

    @property
    def started(self) -> bool:
        """The second stage has been issued."""
        self._advance()
        return self._second is not None

    def done(self) -> bool:
        """Both stages complete (advances the chain if the first just finished)."""
        self._advance()
        return self._second is not None and self._second.done()

    def wait(self) -> None:
        """Wait for the read, issue the copy if needed, wait for the copy."""
        if self._second is None:
            assert self._first is not None
            self._first.wait()
            self._second = self._start()
        self._second.wait()

    def wait_for_compute(self) -> None:
        """Like :meth:`wait`, but on CUDA only orders the compute stream after the copy."""
        if self._second is None:
            assert self._first is not None
            self._first.wait()
            self._second = self._start()
        self._second.wait_for_compute()  # type: ignore[attr-defined]
