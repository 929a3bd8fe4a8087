"""Replacing a directory atomically, and the temporaries that takes: named after
their owning process, reclaimed once it is gone.

A save writes into ``.NAME.partial-<host>-<pid>-<start>-<random>`` and
:func:`replace_dir` puts it at ``NAME``: one atomic exchange, or, on a
filesystem without one, by moving the old checkpoint aside to ``.NAME.old-...``
first. A process killed mid-save (``kill -9``, power loss) leaves them behind;
the next save into the same directory removes those whose owner is gone: same
host, same user, and no live process with that PID and start time (so a
recycled PID does not keep a temporary alive, and a live owner's temporary is
never touched). An ``.old-`` one whose checkpoint never made it into place is
renamed back instead of deleted.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import zlib
from pathlib import Path

from infinity.checkpoint.format import fsync_dir
from infinity.utils.processes import own_start, owner_alive

PARTIAL = "partial"
OLD = "old"
_NAME = re.compile(
    r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)"
    r"-[0-9a-f]+$"
)


def _host() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def temp_path(directory: Path, name: str, kind: str = PARTIAL) -> Path:
    """A fresh temporary path for ``name`` in ``directory``, tagged with this process."""
    tag = f"{_host()}-{os.getpid()}-{own_start()}-{secrets.token_hex(3)}"
    return directory / f".{name}.{kind}-{tag}"


def owner_gone(path: Path) -> bool:
    """Whether ``path`` is a temporary of this user on this host whose process has ended."""
    match = _NAME.match(path.name)
    if match is None or match["host"] != _host():
        return False
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    if st.st_uid != os.geteuid() or path.is_symlink():
        return False  # never another user's, and never follow a link out of the directory
    return not owner_alive(int(match["pid"]), int(match["start"]))


def reclaim(directory: Path) -> list[Path]:
    """Remove (or, for a stranded old checkpoint, restore) the dead owners' temporaries."""
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    reclaimed = []
    for path in entries:
        if not owner_gone(path):
            continue
        match = _NAME.match(path.name)
        assert match is not None
        target = directory / match["name"]
        try:
            if match["kind"] == OLD and not os.path.lexists(target):
                os.rename(path, target)  # the save died between its two renames
            elif path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue  # another process reclaimed it first, or it is not ours to remove
        reclaimed.append(path)
    return reclaimed


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            return False  # filesystem or kernel without exchange
        raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")
    return True


def replace_dir(new: Path, target: Path) -> None:
    """Put ``new`` at ``target``; an older checkpoint there is removed only afterwards.

    With an exchange the swap is one atomic step; without one, the old
    checkpoint moves aside first and is put back if anything (Ctrl-C included)
    stops the second rename, so ``target`` never ends up missing.
    """
    if not target.exists():
        os.rename(new, target)
        fsync_dir(target.parent)
        return
    if _exchange(new, target):
        fsync_dir(target.parent)
        shutil.rmtree(new, ignore_errors=True)  # now holds the old checkpoint
        return
    old = temp_path(target.parent, target.name, OLD)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
