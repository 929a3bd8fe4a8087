"""The run directories of ``infinity train``: ``DIR/run-<id>/``, one per run, owned and locked.

Every run saves only into its own ``run-<id>`` directory, created exclusively
(a name that is taken is never reused) and held under an exclusive ``flock``
for as long as the process lives, so two runs never write or prune the same
checkpoints, and a second process resuming a run that is still training forks
a new run instead. ``--checkpoint-dir`` is checked when the command starts:
it must be a directory this user may write and that nobody else can tamper
with (owned by this user, or sticky like ``/tmp``; never world-writable
without the sticky bit).
"""

from __future__ import annotations

import fcntl
import os
import stat
import uuid
from pathlib import Path

from infinity.checkpoint import temporaries
from infinity.cli.main import CommandError

RUN_PREFIX = "run-"


def _who(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def owned_safely(st: os.stat_result) -> bool:
    """Whether a directory with this ``stat`` is this user's and only this user's to change."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWOTH | stat.S_IWGRP)


def check_directory(directory: Path) -> list[Path]:
    """Create ``--checkpoint-dir`` if missing and refuse one this run cannot own.

    Returns the directories it created (removed again if the run saves nothing).
    """
    flag = f"--checkpoint-dir: '{directory}'"
    created = []
    for parent in [*reversed(directory.absolute().parents), directory.absolute()]:
        if parent.exists():
            continue
        try:
            parent.mkdir()
        except FileExistsError:
            continue  # a run started at the same time made it first (not ours to remove)
        except OSError as exc:
            raise CommandError(f"{flag}: cannot create '{parent}': {exc.strerror}") from None
        created.append(parent)
    if not directory.is_dir():
        raise CommandError(f"{flag} is not a directory; pass a directory (or 'none')")
    st = directory.stat()
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & stat.S_IWOTH and not sticky:
        raise CommandError(
            f"{flag} is writable by everyone without the sticky bit, so anyone could replace "
            f"or delete its checkpoints; use a directory of your own (or chmod +t '{directory}')"
        )
    if st.st_uid != os.geteuid() and not sticky:
        raise CommandError(
            f"{flag} belongs to {_who(st.st_uid)}, not to you; use a directory of your own"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CommandError(f"{flag} is not writable by you; use a directory of your own")
    return created


class RunDirectory:
    """This run's ``DIR/run-<id>``: created or continued, and locked until :meth:`close`."""

    def __init__(self, path: Path, fd: int, created: list[Path], fresh: bool) -> None:
        self.path = path
        self.run_id = path.name.removeprefix(RUN_PREFIX)
        self._fd = fd
        self._created = created  # dirs made for this run, removed by close() if still empty
        self.fresh = fresh  # a new run (not continuing one)

    @classmethod
    def new(cls, directory: Path, created: list[Path]) -> RunDirectory:
        """A new run in ``directory`` (already checked) under a fresh id.

        Temporaries that dead processes left in ``directory`` and in this user's
        run directories there are reclaimed first (their checkpoints are not touched).
        """
        for path in [directory, *directory.glob(f"{RUN_PREFIX}*")]:
            temporaries.reclaim(path)
        for _attempt in range(100):
            path = directory / f"{RUN_PREFIX}{uuid.uuid4().hex[:12]}"
            try:
                path.mkdir(mode=0o755)
            except FileExistsError:
                continue  # taken (even planted by someone else): never reuse a name
            except OSError as exc:
                raise CommandError(
                    f"--checkpoint-dir: cannot create '{path}': {exc.strerror}"
                ) from None
            fd = _lock(path)
            assert fd is not None  # a directory we just created exclusively
            return cls(path, fd, [*created, path], fresh=True)
        raise CommandError(f"--checkpoint-dir: no free run name in '{directory}'")

    @classmethod
    def resume(cls, run_dir: Path) -> RunDirectory | None:
        """Continue the run in ``run_dir``; None if it is not ours or another process holds it."""
        try:
            st = run_dir.lstat()
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode) or not owned_safely(st):
            return None
        fd = _lock(run_dir)
        if fd is None:
            return None
        temporaries.reclaim(run_dir)
        return cls(run_dir, fd, [], fresh=False)

    def close(self) -> None:
        """Release the lock; remove what was created for this run if nothing was saved in it."""
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        for directory in reversed(self._created):
            try:
                directory.rmdir()  # only when empty: never removes a checkpoint
            except OSError:
                break


def _lock(path: Path) -> int | None:
    """An open descriptor of ``path`` holding an exclusive flock; None if another holds it.

    The kernel drops the lock when the process dies, however it dies, so a
    crashed run never blocks its resumption.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd
