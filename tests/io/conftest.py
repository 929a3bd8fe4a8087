"""Fixtures for the I/O layer tests: backends, engines, swap directories, timeouts, mounts.

NOTE: no ``__init__.py`` in this folder on purpose: a package named ``io``
under ``tests/`` could shadow the standard library's ``io`` module.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from infinity.io import IOEngine, aligned_empty, available_backends

BACKENDS = available_backends()
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _time_limit() -> Iterator[None]:
    """Fail a test that hangs instead of hanging the suite.

    The engine's waits release the GIL and check for signals every 50 ms, so
    an alarm interrupts them with TimeoutError; faulthandler is the hard
    backstop (dumps every thread's stack and exits) for a hang in native code.
    """

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError("test took longer than 30 s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(30)
    faulthandler.dump_traceback_later(90, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Every backend that works on this machine."""
    return request.param


@pytest.fixture
def make_engine(backend: str) -> Iterator[Callable[..., IOEngine]]:
    """Factory of engines on the parametrized backend; all closed after the test."""
    engines: list[IOEngine] = []

    def make(block_size: int = 64 << 10, queue_depth: int = 8, threads: int = 1) -> IOEngine:
        eng = IOEngine(
            {
                "backend": backend,
                "block_size": block_size,
                "queue_depth": queue_depth,
                "threads": threads,
            }
        )
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


@pytest.fixture
def engine(make_engine: Callable[..., IOEngine]) -> IOEngine:
    """A small-block engine on the parametrized backend (many pieces per request)."""
    return make_engine(block_size=16 << 10, queue_depth=4, threads=2)


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
