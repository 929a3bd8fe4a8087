"""Failures surface as NVMeIOError (an OSError with errno and path); nothing crashes or hangs."""

from __future__ import annotations

import errno
import gc
import os
import time

import pytest
from io_helpers import file_bytes, mounted_tmpfs, random_tensor, run_python

from infinity.io import IOEngine, NVMeIOError, SwapFile, aligned_empty, available_backends, wait_all

PAGE = 4096


def test_read_past_end_of_file_fails(make_engine, tmp_path):
    """A read that runs past EOF is an error (ENODATA), not silently zero-filled."""
    eng = make_engine(block_size=4 * PAGE, queue_depth=4)
    path = tmp_path / "short.bin"
    path.write_bytes(b"\x01" * (10 * PAGE))
    with open(path, "rb") as f:
        t = aligned_empty(12 * PAGE)  # last two pages are beyond the end
        req = eng.read(t, f, 0)
        with pytest.raises(NVMeIOError) as info:
            req.wait()
        err = info.value
        assert isinstance(err, OSError) and err.errno == errno.ENODATA
        assert err.filename == str(path)
        msg = str(err)
        assert str(path) in msg and "offset 0" in msg and str(12 * PAGE) in msg
        assert "No data available" in msg and "end of file" in msg
        # Entirely beyond the end: the very first piece finds nothing.
        with pytest.raises(NVMeIOError, match="end of file"):
            eng.read(aligned_empty(PAGE), f, 20 * PAGE).wait()


def test_injected_eio_on_nth_piece(make_engine, tmp_path):
    """The Nth piece fails with the injected errno; earlier and later requests succeed."""
    eng = make_engine(block_size=PAGE, queue_depth=2)
    with SwapFile(tmp_path, 64 * PAGE, eng) as sf:
        good, expected = random_tensor(8 * PAGE, seed=1)
        sf.write(good, 0).wait()  # 8 pieces, no fault armed
        eng.inject_fault(3, errno.EIO)
        req = sf.write(aligned_empty(8 * PAGE), 8 * PAGE)
        with pytest.raises(NVMeIOError) as info:
            req.wait()
        assert info.value.errno == errno.EIO
        assert "Input/output error" in str(info.value)
        assert "failing piece: offset 40960" in str(info.value)  # 8 pages + 2 pages in
        assert info.value.offset == 8 * PAGE and info.value.nbytes == 8 * PAGE
        # One shot: the engine keeps working afterwards.
        after, after_expected = random_tensor(4 * PAGE, seed=2)
        assert sf.write(after, 16 * PAGE).wait() == 4 * PAGE
        assert file_bytes(sf.path, 0, 8 * PAGE) == expected
        assert file_bytes(sf.path, 16 * PAGE, 4 * PAGE) == after_expected


def test_injected_enospc_on_nth_request(make_engine, tmp_path):
    """per='request': the Nth request fails with ENOSPC; wait_all waits all, raises the first."""
    eng = make_engine(block_size=2 * PAGE, queue_depth=4)
    with SwapFile(tmp_path, 64 * PAGE, eng) as sf:
        eng.inject_fault(2, errno.ENOSPC, per="request")
        tensors = [random_tensor(4 * PAGE, seed=i) for i in range(4)]
        reqs = [sf.write(t, i * 4 * PAGE) for i, (t, _) in enumerate(tensors)]
        with pytest.raises(NVMeIOError) as info:
            wait_all(reqs)
        assert info.value.errno == errno.ENOSPC and "No space left on device" in str(info.value)
        assert info.value.offset == 4 * PAGE
        assert all(r.done() for r in reqs)
        assert [r.exception() is None for r in reqs] == [True, False, True, True]
        for i in (0, 2, 3):
            assert file_bytes(sf.path, i * 4 * PAGE, 4 * PAGE) == tensors[i][1]


def test_real_disk_full_on_tiny_tmpfs(make_engine, tmp_path):
    """A write to a full file system fails with ENOSPC (and a short write is continued first)."""
    eng = make_engine(block_size=64 * PAGE, queue_depth=4)
    with mounted_tmpfs(tmp_path / "tiny", "size=1M") as mnt:
        path = mnt / "fill.bin"
        t, _ = random_tensor(2 << 20, seed=5)  # twice the file system's size
        with open(path, "wb") as f:
            req = eng.write(t, f, 0)
            with pytest.raises(NVMeIOError) as info:
                req.wait()
        assert info.value.errno == errno.ENOSPC
        assert str(path) in str(info.value)
        # Everything up to the full disk was written, nothing was dropped silently.
        assert 0 < req.bytes_done <= 1 << 20


def test_swapfile_larger_than_disk_fails_at_creation(tmp_path):
    """Preallocation turns a too-small disk into an error naming path, bytes asked and free."""
    with mounted_tmpfs(tmp_path / "tiny", "size=1M") as mnt:
        with pytest.raises(OSError) as info:
            SwapFile(mnt, 4 << 20)
        err = info.value
        assert err.errno == errno.ENOSPC
        msg = str(err)
        assert str(mnt) in msg and "4194304 bytes" in msg and "free there" in msg
        assert os.listdir(mnt) == []  # the private directory was cleaned up


def test_failed_request_completes_all_pieces(make_engine, tmp_path):
    """After a failure the request still completes; no piece is left in flight or dropped."""
    eng = make_engine(block_size=PAGE, queue_depth=8, threads=2)
    with SwapFile(tmp_path, 256 * PAGE, eng) as sf:
        eng.inject_fault(5, errno.EIO)
        req = sf.write(aligned_empty(200 * PAGE), 0)
        with pytest.raises(NVMeIOError):
            req.wait()
        assert req.done()
        assert req.bytes_done < 200 * PAGE  # the rest was not handed out after the failure


def test_close_waits_for_requests_in_flight(make_engine, tmp_path):
    """close() with slow requests in flight waits for all of them; their data lands."""
    eng = make_engine(block_size=4 * PAGE, queue_depth=2)
    with SwapFile(tmp_path, 64 * PAGE, eng) as sf:
        eng.inject_delay(200_000)  # 200 ms per request: all still pending at close()
        tensors = [random_tensor(8 * PAGE, seed=20 + i) for i in range(6)]
        reqs = [sf.write(t, i * 8 * PAGE) for i, (t, _) in enumerate(tensors)]
        assert not any(r.done() for r in reqs)
        eng.close()
        assert all(r.done() for r in reqs)
        for i, (_, expected) in enumerate(tensors):
            assert file_bytes(sf.path, i * 8 * PAGE, 8 * PAGE) == expected
        with pytest.raises(RuntimeError, match="closed"):
            sf.write(tensors[0][0], 0)


def test_dropped_engine_and_requests_keep_buffers_alive(backend, tmp_path):
    """Dropping every reference (engine, requests, tensors) mid-flight is safe and loses nothing."""
    path = tmp_path / "dropped.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    expected = []
    try:
        eng = IOEngine({"backend": backend, "block_size": 4 * PAGE, "queue_depth": 2})
        eng.inject_delay(30_000)
        for i in range(8):
            t, data = random_tensor(16 * PAGE, seed=40 + i)
            eng.write(t, fd, i * 16 * PAGE)  # request and tensor dropped at once
            expected.append(data)
            del t
        del eng
        gc.collect()  # the engine's finalizer drains the requests
        # Overwrite freshly freed memory, to make a use-after-free visible in the file.
        junk = [bytearray(b"\xee" * (16 * PAGE)) for _ in range(16)]
        del junk
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(expected)


def test_injected_delay_changes_timing_only(make_engine, tmp_path):
    eng = make_engine(block_size=4 * PAGE)
    with SwapFile(tmp_path, 16 * PAGE, eng) as sf:
        t, expected = random_tensor(16 * PAGE, seed=9)
        eng.inject_delay(150_000)
        start = time.monotonic()
        req = sf.write(t, 0)
        assert not req.done()
        assert req.wait() == 16 * PAGE
        assert time.monotonic() - start >= 0.15
        eng.inject_delay(0)
        assert file_bytes(sf.path, 0, 16 * PAGE) == expected


def test_wait_timeout_and_interrupt(make_engine, tmp_path):
    """wait(timeout) raises TimeoutError; the request itself still completes afterwards."""
    eng = make_engine()
    with SwapFile(tmp_path, 16 * PAGE, eng) as sf:
        eng.inject_delay(300_000)
        req = sf.write(aligned_empty(16 * PAGE), 0)
        with pytest.raises(TimeoutError, match=r"did not finish within 0\.05 s"):
            req.wait(timeout=0.05)
        with pytest.raises(TimeoutError):
            wait_all([req], timeout=0.01)
        assert req.wait() == 16 * PAGE


def test_write_to_read_only_fd_fails_with_ebadf(make_engine, tmp_path):
    eng = make_engine()
    path = tmp_path / "ro.bin"
    path.write_bytes(b"\0" * PAGE)
    with open(path, "rb") as f:
        with pytest.raises(NVMeIOError) as info:
            eng.write(aligned_empty(PAGE), f, 0).wait()
    assert info.value.errno == errno.EBADF


@pytest.mark.parametrize("transient", [errno.EAGAIN, errno.EINTR])
def test_transient_errors_are_retried(make_engine, tmp_path, transient):
    """A piece completing with EAGAIN/EINTR is resubmitted; the request succeeds."""
    eng = make_engine(block_size=2 * PAGE, queue_depth=2)
    with SwapFile(tmp_path, 16 * PAGE, eng) as sf:
        t, expected = random_tensor(16 * PAGE, seed=31)
        eng.inject_fault(3, transient)
        assert sf.write(t, 0).wait() == 16 * PAGE
        assert file_bytes(sf.path, 0, 16 * PAGE) == expected
        back = aligned_empty(16 * PAGE)
        eng.inject_fault(1, transient)
        assert sf.read(back, 0).wait() == 16 * PAGE
        assert back.numpy().tobytes() == expected


@pytest.mark.parametrize("nth", [1, 2, 4])
def test_short_transfers_are_continued(make_engine, tmp_path, nth):
    """A piece the kernel completes only partly is continued from where it stopped."""
    eng = make_engine(block_size=8 * PAGE, queue_depth=3)
    with SwapFile(tmp_path, 64 * PAGE, eng) as sf:
        t, expected = random_tensor(40 * PAGE, seed=50 + nth)
        eng.inject_short_transfer(nth)
        req = sf.write(t, 8 * PAGE)
        assert req.wait() == 40 * PAGE and req.bytes_done == 40 * PAGE
        assert file_bytes(sf.path, 8 * PAGE, 40 * PAGE) == expected
        back = aligned_empty(40 * PAGE)
        eng.inject_short_transfer(nth)
        assert sf.read(back, 8 * PAGE).wait() == 40 * PAGE
        assert back.numpy().tobytes() == expected


def test_forked_child_cannot_use_or_delete_parent_objects(tmp_path):
    """After fork() the child gets a clear error, and its GC leaves the parent's file alone."""
    code = f"""
import gc, os, sys
from infinity.io import IOEngine, SwapFile, aligned_empty
eng = IOEngine()
sf = SwapFile({str(tmp_path)!r}, 1 << 20, eng)
req = sf.write(aligned_empty(1 << 20), 0)
pid = os.fork()
if pid == 0:
    ok = True
    for action in (lambda: eng.write(aligned_empty(4096), sf, 0), lambda: req.wait()):
        try:
            action()
            ok = False
        except RuntimeError as exc:
            ok = ok and "fork" in str(exc)
    del sf, eng, req
    gc.collect()
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), os.path.exists(sf.path), req.wait())
path = sf.path
sf.close()
eng.close()
print(os.path.exists(path))
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True", str(1 << 20), "False"]


BATCH_BACKENDS = [b for b in available_backends() if b != "threads"]  # threads submit no batches


@pytest.mark.parametrize("batch_backend", BATCH_BACKENDS)
def test_failed_batch_submission_fails_its_requests(batch_backend, tmp_path):
    """A submitting system call that fails (not EAGAIN) fails the pieces it carried
    with that errno; the engine works afterwards. EAGAIN is retried."""
    with IOEngine({"backend": batch_backend, "block_size": PAGE, "queue_depth": 4}) as eng:
        with SwapFile(tmp_path, 16 * PAGE, eng) as sf:
            eng.inject_submit_error(1, errno.EINVAL)
            with pytest.raises(NVMeIOError) as info:
                sf.write(aligned_empty(4 * PAGE), 0).wait()
            assert info.value.errno == errno.EINVAL and info.value.filename == sf.path
            t, expected = random_tensor(8 * PAGE, seed=61)
            assert sf.write(t, 0).wait() == 8 * PAGE
            assert file_bytes(sf.path, 0, 8 * PAGE) == expected
            eng.inject_submit_error(1, errno.EAGAIN)
            back = aligned_empty(8 * PAGE)
            assert sf.read(back, 0).wait() == 8 * PAGE
            assert back.numpy().tobytes() == expected


@pytest.mark.parametrize("failures", [1, 2])
def test_worker_failing_internally_fails_requests_and_never_hangs(make_engine, tmp_path, failures):
    """A worker broken by an internal error fails its requests with EIO (never hangs a
    waiter), even when a second failure hits it while it does so; close() returns."""
    eng = make_engine(block_size=PAGE, queue_depth=2, threads=1)
    with SwapFile(tmp_path, 16 * PAGE, eng) as sf:
        eng.inject_worker_failure(failures)
        with pytest.raises(NVMeIOError) as info:
            sf.write(aligned_empty(8 * PAGE), 0).wait(timeout=20)
        assert info.value.errno == errno.EIO and info.value.filename == sf.path
        detail = "failed while draining" if failures == 2 else "injected internal failure"
        assert "I/O worker failed" in str(info.value) and detail in str(info.value)
        with pytest.raises(NVMeIOError, match="I/O worker failed"):
            sf.read(aligned_empty(PAGE), 0).wait(timeout=20)
    eng.close()
    assert eng.closed
