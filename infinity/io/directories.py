"""Where swap files live: the directory the user names, checked and created; the
private directories inside it, named after their owner process; and reclaiming
those whose owner is gone.

Kernel pseudo file systems (``/proc``, ``/sys`` and their kind) have no storage:
creating a file there fails with a misleading errno (ENOENT, EPERM) and their
free space reads as 0 bytes, so a swap directory on one is refused
(:func:`pseudo_filesystem`).

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

import errno
import logging
import os
import re
import tempfile
from pathlib import Path

from infinity.utils.processes import has_procfs, own_start, owner_alive
from infinity.utils.sizes import format_size

log = logging.getLogger("infinity")

# Kernel interfaces that hold no file data.
PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
        "configfs", "devpts", "pstore", "bpf", "mqueue", "fusectl", "efivarfs",
        "binfmt_misc", "autofs", "nsfs", "rpc_pipefs", "selinuxfs",
    }
)  # fmt: skip


def nearest_existing(path: str | os.PathLike[str]) -> str:
    """``path`` made absolute, or its nearest ancestor that exists."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def filesystem_type(path: str | os.PathLike[str]) -> str | None:
    """Type of the file system holding ``path`` (``"ext4"``, ``"proc"``...), None if unknown."""
    target = os.path.realpath(nearest_existing(path))
    best, best_type = "", None
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        fields, _, after = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not after:
            continue
        # mountinfo escapes spaces and the like in octal (\040).
        point = parts[4].encode().decode("unicode_escape")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        # A later mount on the same point hides the earlier one: >= keeps the last.
        if inside and len(point) >= len(best):
            best, best_type = point, after.split()[0]
    return best_type


def pseudo_filesystem(path: str | os.PathLike[str]) -> str | None:
    """The type of the kernel pseudo file system holding ``path`` (no storage), else None."""
    fs_type = filesystem_type(path)
    return fs_type if fs_type in PSEUDO_FILESYSTEMS else None


def prepare_directory(directory: Path) -> None:
    """Make sure ``directory`` exists (creating only its last component), or explain why not."""
    if directory.exists():
        if not directory.is_dir():
            raise NotADirectoryError(
                errno.ENOTDIR, f"swap directory '{directory}' exists and is not a directory"
            )
        return
    parent = directory.parent
    if not parent.exists():
        raise FileNotFoundError(
            errno.ENOENT,
            f"cannot create swap directory '{directory}': its parent '{parent}' does not exist",
        )
    if not parent.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"cannot create swap directory '{directory}': '{parent}' is not a directory",
        )
    try:
        os.mkdir(directory)
    except FileExistsError:
        pass  # created concurrently: fine as long as it is a directory (checked by mkdtemp)
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot create swap directory '{directory}': {exc.strerror}"
        ) from None


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
