"""Fixtures for the I/O layer tests: backends, engines, swap directories, timeouts, mounts.

NOTE: no ``__init__.py`` in this folder on purpose: a package named ``io``
under ``tests/`` could shadow the standard library's ``io`` module.
"""

from __future__ import annotations

import faulthandler
import signal
from collections.abc import Callable, Iterator

import pytest

from infinity.io import IOEngine, available_backends

BACKENDS = available_backends()


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
