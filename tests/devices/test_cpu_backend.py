"""The CPU backend's copies: asynchronous, in order, on a native thread.

Every check reads the destination bytes back and compares them with the
source tensors the test made itself.
"""

from __future__ import annotations

import gc
import signal

import pytest
import torch
from io_helpers import run_python

from infinity.devices.cpu import CpuBackend


@pytest.fixture
def backend():
    b = CpuBackend()
    yield b
    b.close()


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_copies_land_in_submission_order(backend):
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    sources = [_random_bytes(1 << 20, seed) for seed in range(8)]
    handles = [backend.copy_async(dst, src) for src in sources]
    handles[-1].wait()
    # In order: every earlier copy is complete, and the last one wrote last.
    assert all(h.done() for h in handles)
    assert torch.equal(dst, sources[-1])


def test_many_sizes_copy_exact_bytes_and_nothing_else(backend):
    slab = torch.zeros(1 << 16, dtype=torch.uint8)
    expected = slab.clone()
    offset, pending = 0, []
    for seed, n in enumerate([0, 1, 7, 4096, 12345, 3, 40000]):
        src = _random_bytes(n, seed)
        pending.append(backend.copy_async(slab[offset : offset + n], src))
        expected[offset : offset + n] = src
        offset += n + 5  # untouched gaps between the copies
    backend.synchronize()
    assert all(h.done() for h in pending)
    assert torch.equal(slab, expected)


def test_dropped_handle_and_source_stay_valid_until_the_copy_ran():
    backend = CpuBackend(copy_delay_s=0.05)
    try:
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        src = _random_bytes(1 << 20, 1)
        expected = src.clone()
        handle = backend.copy_async(dst, src)
        assert not handle.done()  # still waiting out the injected delay
        del src, handle
        gc.collect()
        backend.synchronize()
        assert torch.equal(dst, expected)
    finally:
        backend.close()


def test_bad_copies_are_refused_with_the_sizes(backend):
    with pytest.raises(ValueError, match="4096 bytes into a 8192-byte tensor"):
        backend.copy_async(
            torch.zeros(8192, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
        )
    strided = torch.zeros(64, 64, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        backend.copy_async(strided, torch.zeros(64 * 64, dtype=torch.uint8))
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.copy_async(torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8))


def test_a_long_wait_is_interrupted_by_a_signal():
    backend = CpuBackend(copy_delay_s=1.5)

    class Interrupted(Exception):
        pass

    def on_alarm(_signum, _frame):
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        handle = backend.copy_async(
            torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
        )
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            handle.wait()
        assert not handle.done()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        backend.close()  # finishes the delayed copy


def test_a_forked_child_gets_a_clear_error():
    code = """
import os, torch
from infinity.devices.cpu import CpuBackend
b = CpuBackend()
pid = os.fork()
if pid == 0:
    try:
        b.copy_async(torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8))
        os._exit(1)
    except RuntimeError as exc:
        b.close()  # must not hang or crash in the child
        os._exit(0 if "fork" in str(exc) else 2)
_, status = os.waitpid(pid, 0)
dst = torch.zeros(8, dtype=torch.uint8)
b.copy_async(dst, torch.ones(8, dtype=torch.uint8)).wait()
print(os.waitstatus_to_exitcode(status), int(dst.sum()))
b.close()
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "8"]
