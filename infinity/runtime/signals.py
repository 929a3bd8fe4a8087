"""Remove swap files when a process that uses the library is ended by SIGTERM or SIGHUP.

By default these signals end the process at once: no ``close()``, finalizer or
``atexit`` runs, and the swap files (as large as the NVMe state) would stay
until the next run in the same place reclaims them. So while an engine with a
swap file lives, a handler is installed for each of them (from the main thread
only, and only over the default action or a Python handler: an ignored signal
stays ignored). It unlinks every swap file of this process, then chains: it
calls the handler installed before it, or restores the default action and
raises the signal again, so the process still dies by it (exit status -15, or
143 in a shell). The signal is never swallowed.

NOTE: unlinking is safe even if the chained handler lets the process go on:
a file stays usable through its open descriptor until it is closed, and only
then is its space freed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_files: dict[str, tuple[int, str]] = {}  # swap file -> (owner pid, its directory)
_previous: dict[int, Any] = {}  # signal -> the handler ours replaced (kept for stale chains)
_installed: set[int] = set()


def guard(path: str, directory: str) -> None:
    """Remove ``path`` and its (then empty) ``directory`` if SIGTERM/SIGHUP ends the process."""
    _files[path] = (os.getpid(), directory)
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works only there; an engine made there later installs it
    for signum in SIGNALS:
        if signum in _installed:
            continue
        current = signal.getsignal(signum)
        if current is signal.SIG_IGN or current is None:
            continue  # ignored, or a handler from C that Python cannot chain to
        _previous[signum] = current
        signal.signal(signum, _on_signal)
        _installed.add(signum)


def unguard(path: str) -> None:
    """``path`` was removed normally; the last one restores the handlers (if still ours)."""
    _files.pop(path, None)
    if _files or threading.current_thread() is not threading.main_thread():
        return
    for signum in list(_installed):
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, _previous[signum])
        # NOTE: if another handler replaced ours it may chain to ours later;
        # ours then only chains on, as _previous is kept.
        _installed.discard(signum)


def _on_signal(signum: int, frame: FrameType | None) -> Any:
    pid = os.getpid()
    for path, (owner, directory) in list(_files.items()):
        if owner != pid:
            continue  # a forked child must not remove its parent's files
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(directory)
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        return previous(signum, frame)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)  # dies here: the default action of SIGTERM/SIGHUP
    return None
