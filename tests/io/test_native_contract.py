"""The I/O contract (alignment, limits) Python reads from ``infinity._C.io`` is the one
the native engine enforces, and a misaligned request is rejected on both sides.

The expected numbers are written out here (4096: the O_DIRECT logical block of
the disks and file systems we support); the boundaries are probed on the native
engine itself, bypassing every Python check.
"""

from __future__ import annotations

import errno

import pytest

from infinity import _C, AioConfig, ConfigError
from infinity._native import io as contract
from infinity.io import SwapFile, aligned_empty, available_backends

PAGE = 4096


def _native_accepts(block_size: int = PAGE, queue_depth: int = 1, threads: int = 1) -> bool:
    """Whether the native engine itself takes these limits (the threads backend works anywhere)."""
    try:
        engine = _C.io.Engine("threads", block_size, queue_depth, threads)
    except ValueError:
        return False
    engine.close()
    return True


def _config_accepts(**aio: int) -> bool:
    try:
        AioConfig(**aio)
    except ConfigError:
        return False
    return True


def test_python_reads_the_native_values():
    assert contract.ALIGNMENT == _C.io.ALIGNMENT == PAGE
    assert contract.MAX_BLOCK_SIZE == _C.io.MAX_BLOCK_SIZE == 1 << 30
    assert contract.MAX_QUEUE_DEPTH == _C.io.MAX_QUEUE_DEPTH
    assert contract.MAX_THREADS == _C.io.MAX_THREADS
    assert contract.MAX_REGISTERED_BYTES == _C.io.MAX_REGISTERED_BYTES == 1 << 30


@pytest.mark.parametrize(
    "block_size", [PAGE // 2, PAGE - 1, PAGE, PAGE + 512, 2 * PAGE, 3 * PAGE + 1, 256 << 10]
)
def test_config_and_engine_agree_on_block_size(block_size):
    assert _config_accepts(block_size=block_size) == _native_accepts(block_size=block_size)
    assert _native_accepts(block_size=block_size) == (block_size % PAGE == 0)


def test_engine_limits_are_the_exported_ones():
    assert _native_accepts(block_size=contract.MAX_BLOCK_SIZE)
    assert not _native_accepts(block_size=contract.MAX_BLOCK_SIZE + PAGE)
    assert _native_accepts(queue_depth=contract.MAX_QUEUE_DEPTH)
    assert not _native_accepts(queue_depth=contract.MAX_QUEUE_DEPTH + 1)
    assert not _native_accepts(queue_depth=0)
    assert not _native_accepts(threads=contract.MAX_THREADS + 1)
    assert not _native_accepts(threads=0)


@pytest.mark.parametrize(
    ("field", "values"),
    [
        ("queue_depth", lambda: [0, 1, contract.MAX_QUEUE_DEPTH, contract.MAX_QUEUE_DEPTH + 1]),
        ("threads", lambda: [0, 1, 2, contract.MAX_THREADS + 1]),
    ],
)
def test_config_and_engine_agree_on_counts(field, values):
    for value in values():
        assert _config_accepts(**{field: value}) == _native_accepts(**{field: value}), value


def test_misaligned_offset_is_rejected_with_the_same_message_on_both_sides(engine, tmp_path):
    buf = aligned_empty(PAGE)
    with SwapFile(tmp_path, 4 * PAGE, engine) as sf:
        with pytest.raises(ValueError) as python_side:
            sf.write(buf, 100)
        assert str(python_side.value) == (
            "offset=100 is not a multiple of 4096 (O_DIRECT alignment); e.g. 0 or 4096"
        )
        with pytest.raises(ValueError) as native_side:
            engine._native.submit(True, buf.data_ptr(), PAGE, sf.fileno(), 100, sf.path)
        assert str(native_side.value) == "offset=100 is not a multiple of 4096 (O_DIRECT alignment)"
        assert str(python_side.value).startswith(str(native_side.value))


def test_misaligned_length_and_address_are_rejected_natively(engine, tmp_path):
    buf = aligned_empty(2 * PAGE)
    with SwapFile(tmp_path, 4 * PAGE, engine) as sf:
        with pytest.raises(ValueError, match=r"^nbytes=5000 is not a multiple of 4096 \(O_DIRECT"):
            engine._native.submit(False, buf.data_ptr(), 5000, sf.fileno(), 0, sf.path)
        with pytest.raises(ValueError, match=r"^buffer address=\d+ is not a multiple of 4096"):
            engine._native.submit(False, buf.data_ptr() + 512, PAGE, sf.fileno(), 0, sf.path)


@pytest.mark.skipif("io_uring" not in available_backends(), reason="io_uring does not work here")
def test_registered_span_limit_is_the_exported_one():
    buf = aligned_empty(PAGE)
    engine = _C.io.Engine("io_uring", PAGE, 1, 1)
    try:  # checked before the kernel is asked: the span is never touched
        too_big = (buf.data_ptr(), contract.MAX_REGISTERED_BYTES + PAGE)
        assert engine.register_buffers([too_big]) == errno.EINVAL
        assert engine.register_buffers([(buf.data_ptr(), PAGE)]) == 0
    finally:
        engine.close()
