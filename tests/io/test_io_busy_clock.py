"""``IOEngine.busy_seconds``: the time the engine had a piece in flight, against wall clocks.

The reference is ``time.perf_counter`` around the caller's own submissions and
waits: the clock must run while transfers are in flight (and only then), count
concurrent pieces once, and stop after failed pieces too.
"""

from __future__ import annotations

import errno
import time

import pytest
from io_helpers import random_tensor

from infinity.io import IOEngine, NVMeIOError, SwapFile, aligned_empty, wait_all

PAGE = 4096


def test_idle_engine_is_not_busy(make_engine):
    eng = make_engine()
    time.sleep(0.05)
    assert eng.busy_seconds == 0.0


def test_busy_while_transfers_run_and_only_then(make_engine, tmp_path):
    """Busy time grows by at most the wall time of the transfers, and not while idle."""
    eng = make_engine(block_size=16 * PAGE, queue_depth=4, threads=1)
    with SwapFile(tmp_path, 8 << 20, eng) as sf:
        t, _ = random_tensor(8 << 20, seed=5)
        start = time.perf_counter()
        sf.write(t, 0).wait()
        sf.read(t, 0).wait()
        wall = time.perf_counter() - start
        busy = eng.busy_seconds
        assert 0 < busy <= wall
        time.sleep(0.1)  # nothing in flight: the clock stands still
        assert eng.busy_seconds == busy


def test_concurrent_pieces_count_once(make_engine, tmp_path):
    """Many pieces over two workers in flight at once: busy is at most the wall time
    from the first submission to the last completion (a sum over pieces is far more)."""
    eng = make_engine(block_size=PAGE, queue_depth=8, threads=2)
    with SwapFile(tmp_path, 4 << 20, eng) as sf:
        bufs = [random_tensor(64 * PAGE, seed=i)[0] for i in range(16)]
        start = time.perf_counter()
        requests = [sf.write(b, i * 64 * PAGE) for i, b in enumerate(bufs)]
        wait_all(requests)
        wall = time.perf_counter() - start
        assert 0 < eng.busy_seconds <= wall


def test_delayed_requests_are_not_busy_before_they_start(make_engine, tmp_path):
    """A request held back (inject_delay) gives the disk no work until it starts."""
    eng = make_engine(block_size=PAGE, queue_depth=2)
    with SwapFile(tmp_path, 16 * PAGE, eng) as sf:
        eng.inject_delay(300_000)
        start = time.perf_counter()
        sf.write(aligned_empty(4 * PAGE), 0).wait()
        wall = time.perf_counter() - start
        assert wall >= 0.3
        assert 0 < eng.busy_seconds < wall - 0.2


def test_clock_stops_after_a_failed_piece(make_engine, tmp_path):
    """A failed piece ends its part of the busy time like a finished one."""
    eng = make_engine(block_size=PAGE, queue_depth=2)
    with SwapFile(tmp_path, 64 * PAGE, eng) as sf:
        eng.inject_fault(2, errno.EIO)
        with pytest.raises(NVMeIOError):
            sf.write(aligned_empty(8 * PAGE), 0).wait()
        busy = eng.busy_seconds
        time.sleep(0.1)
        assert eng.busy_seconds == busy


@pytest.mark.parametrize("failures", [1, 2])
def test_clock_stops_after_a_worker_fails(make_engine, tmp_path, failures):
    """A worker broken internally fails its pieces (drain paths): the clock stops too."""
    eng = make_engine(block_size=PAGE, queue_depth=2, threads=1)
    with SwapFile(tmp_path, 16 * PAGE, eng) as sf:
        eng.inject_worker_failure(failures)
        with pytest.raises(NVMeIOError):
            sf.write(aligned_empty(8 * PAGE), 0).wait(timeout=20)
        with pytest.raises(NVMeIOError):
            sf.read(aligned_empty(PAGE), 0).wait(timeout=20)
        busy = eng.busy_seconds
        time.sleep(0.1)
        assert eng.busy_seconds == busy


def test_readable_after_close(tmp_path):
    with IOEngine({"block_size": PAGE}) as eng, SwapFile(tmp_path, 16 * PAGE, eng) as sf:
        sf.write(aligned_empty(8 * PAGE), 0).wait()
    assert eng.closed and eng.busy_seconds > 0
