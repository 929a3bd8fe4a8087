"""Which process owns a leftover file: a PID plus its start time, read from ``/proc``.

Swap directories, ``bench nvme`` files and checkpoint temporaries are named
after the process that made them, so the next run can remove those whose
owner died without cleaning up (``kill -9``, power loss). A PID alone is not
enough (PIDs are reused), so names carry the start time too: clock ticks after
boot, field 22 of ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import os

UNKNOWN_START = 0
"""Recorded when the start time could not be read; such an owner is never taken for gone."""


def has_procfs() -> bool:
    """Whether ``/proc`` tells processes apart here."""
    return os.path.exists("/proc/self/stat")


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks after boot; ``None`` if there is no such
    process, :data:`UNKNOWN_START` if it exists but cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return UNKNOWN_START
    # NOTE: the command name (field 2) may hold spaces and ')': fields follow its last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22; fields[0] is field 3
    except (IndexError, ValueError):
        return UNKNOWN_START


def own_start() -> int:
    """This process's start time, to put in a name (:data:`UNKNOWN_START` if unreadable)."""
    return process_start(os.getpid()) or UNKNOWN_START


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that recorded ``pid``/``start`` may still run.

    Errs towards "alive": an unknown start time on either side keeps the owner
    alive, and without ``/proc`` only a PID that no longer exists counts as gone.
    """
    if not has_procfs():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    actual = process_start(pid)
    if actual is None:
        return False
    return UNKNOWN_START in (actual, start) or actual == start
