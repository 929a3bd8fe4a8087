"""Which file system holds a path: refuse kernel pseudo file systems for swap files.

``/proc``, ``/sys`` and their kind have no storage: creating a file there fails
with a misleading errno (ENOENT, EPERM) and their free space reads as 0 bytes.
"""

from __future__ import annotations

import os

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
