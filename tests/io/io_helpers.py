"""Plain helpers of the I/O tests (imported by name; fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import infinity
from infinity._native import native
from infinity.io import aligned_empty

REPO_ROOT = Path(__file__).resolve().parents[2]


def random_tensor(nbytes: int, seed: int) -> tuple[torch.Tensor, bytes]:
    """An aligned uint8 tensor of random bytes, and an independent copy of them."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    t = aligned_empty(nbytes)
    t.copy_(data)
    return t, bytes(data.numpy().tobytes())


def file_bytes(path: str, offset: int, nbytes: int) -> bytes:
    """Bytes of a file read with plain Python (an independent path from the engine)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def python_child(code: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a fresh interpreter that runs ``code``
    against the very ``infinity`` (and native module) this process imported.

    NOTE: `make test-native` and `make test-native-tsan` run these tests against an
    instrumented copy of the package in build/sanitize/<name>/lib, with the
    sanitizer's runtime preloaded into every child. A child pointed at the checkout
    instead (``PYTHONPATH`` = the repository, or the working directory that
    ``python -c`` puts first on ``sys.path``) loads the plain module under that
    runtime: the sanitizer then sees the calls it intercepts (a mutex lock, a
    delete) but none of the module's own atomics, and ThreadSanitizer reported a
    race between a request's last ``shared_ptr`` release and an earlier lock that
    the reference count orders. ``-P`` keeps the working directory off
    ``sys.path``, and the child first checks that it loaded the same native module.
    """
    package_root = Path(infinity.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(package_root))
    check = (
        "import infinity._C as _c, sys\n"
        f"if _c.__file__ != {native().__file__!r}:\n"
        "    sys.exit('the child imported another native module: ' + _c.__file__)\n"
    )
    return [sys.executable, "-P", "-c", check + code], env


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports the same infinity as this one."""
    args, env = python_child(code)
    return subprocess.run(
        args,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def mounted_tmpfs(where: Path, options: str) -> Iterator[Path]:
    """Mount a tmpfs at ``where`` (skips the test, with the reason, if mounting is not allowed)."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("cannot mount a tmpfs here (no mount command)")
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or 'not permitted'})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
