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


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports this checkout of infinity."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-c", code],
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
