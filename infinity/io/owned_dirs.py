"""Private directories named after their owner process, and reclaiming them once it is gone.

A swap file (or a ``bench nvme`` file) lives in a ``0700`` directory named
``infinity-<name>-<pid>-<start>-<random>``: ``<start>`` is the owner's start
time (clock ticks after boot, field 22 of ``/proc/<pid>/stat``), so a process
that later reuses the PID is not taken for the owner. A process that dies
without cleaning up (``SIGKILL``, power loss) leaves its directory;
:func:`reclaim_stale` removes such directories when the next one is made in
the same place, and never one whose owner still runs.

A mistake would cost space, not data: a process in another PID namespace
sharing the directory could take a live owner for gone, but an unlinked file
stays usable through its owner's descriptor until that closes it.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile

from infinity.utils.processes import has_procfs, own_start, owner_alive
from infinity.utils.sizes import format_size

log = logging.getLogger("infinity")

# mkdtemp's random suffix is 8 characters of [a-z0-9_].
_OWNED = re.compile(r"^infinity-(?P<name>.+)-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-[a-z0-9_]{8}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def make_owned_dir(root: str | os.PathLike[str], name: str) -> str:
    """Create a fresh ``0700`` directory in ``root`` named after this process; its path."""
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"infinity-{name}-{pid}-{own_start()}-", dir=root)


def reclaim_stale(root: str | os.PathLike[str]) -> list[str]:
    """Remove the owned directories in ``root`` whose owner is gone; the paths removed.

    Only directories named by :func:`make_owned_dir`, owned by this user and
    holding only files are removed (symbolic links are not followed). Errors
    are ignored: a directory that cannot be removed now is tried next time.
    """
    if not has_procfs():
        return []  # no /proc: no way to tell a live owner from a dead one
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return []
    removed = []
    try:
        for entry in os.listdir(root_fd):
            match = _OWNED.match(entry)
            if match is None or owner_alive(int(match["pid"]), int(match["start"])):
                continue
            freed = _empty_dir(root_fd, entry)
            if freed is None:
                continue
            try:
                os.rmdir(entry, dir_fd=root_fd)
            except OSError:
                continue
            path = os.path.join(os.fspath(root), entry)
            removed.append(path)
            log.info(
                "removed %s (%s) left by process %s, which is no longer running",
                path,
                format_size(freed),
                match["pid"],
            )
    finally:
        os.close(root_fd)
    return removed


def _empty_dir(root_fd: int, entry: str) -> int | None:
    """Unlink the files in ``root_fd/entry`` if it is our directory; bytes freed, or None."""
    try:
        fd = os.open(entry, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=root_fd)
    except OSError:
        return None  # gone, a symlink, not a directory, or not ours to read
    freed = 0
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return None
        for name in os.listdir(fd):
            try:
                freed += os.stat(name, dir_fd=fd, follow_symlinks=False).st_blocks * 512
                os.unlink(name, dir_fd=fd)
            except OSError:
                pass  # a sub-directory or a concurrent removal: rmdir decides
    finally:
        os.close(fd)
    return freed
