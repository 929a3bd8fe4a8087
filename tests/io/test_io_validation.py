"""Bad arguments are rejected in Python with a clear error, before any native call."""

from __future__ import annotations

import os

import pytest
import torch

from infinity import ConfigError
from infinity.io import IOEngine, SwapFile, aligned_empty

PAGE = 4096


@pytest.fixture
def sf(engine, tmp_path):
    with SwapFile(tmp_path, 16 * PAGE, engine) as f:
        yield f


def test_misaligned_buffer_is_rejected(sf):
    t = aligned_empty(3 * PAGE)
    with pytest.raises(ValueError, match=r"data_ptr\(\)=0x[0-9a-f]+ is not 4096-byte aligned"):
        sf.write(t[1 : 1 + 2 * PAGE], 0)


def test_misaligned_length_is_rejected(sf):
    t = aligned_empty(2 * PAGE)
    with pytest.raises(ValueError, match=r"5000 bytes, not a multiple of 4096"):
        sf.read(t[:5000], 0)


def test_misaligned_offset_is_rejected(sf):
    with pytest.raises(ValueError, match=r"offset=100 is not a multiple of 4096"):
        sf.write(aligned_empty(PAGE), 100)
    with pytest.raises(ValueError, match=r"offset=-4096 is negative"):
        sf.write(aligned_empty(PAGE), -PAGE)
    with pytest.raises(TypeError, match="offset must be an int"):
        sf.write(aligned_empty(PAGE), 4096.0)


def test_non_contiguous_and_non_tensor_are_rejected(sf):
    t = aligned_empty(4 * PAGE, torch.float32).view(2, 2 * PAGE // 4)
    with pytest.raises(ValueError, match="not contiguous"):
        sf.write(t.t(), 0)
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        sf.write(bytearray(PAGE), 0)
    with pytest.raises(ValueError, match="is on meta"):
        sf.write(torch.empty(PAGE, dtype=torch.uint8, device="meta"), 0)


def test_region_outside_swap_file_is_rejected(sf):
    with pytest.raises(ValueError, match=r"region \[61440, 69632\) is outside swap file"):
        sf.read(aligned_empty(2 * PAGE), 15 * PAGE)


def test_bad_file_targets_are_rejected(engine, tmp_path):
    t = aligned_empty(PAGE)
    with pytest.raises(TypeError, match="fd_or_file must be"):
        engine.read(t, "/etc/passwd", 0)
    fd = os.open(tmp_path / "x", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    with pytest.raises(ValueError, match=f"file descriptor {fd} is not open"):
        engine.read(t, fd, 0)
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            engine.read(t, r, 0)
    finally:
        os.close(r)
        os.close(w)


def test_use_after_close(make_engine, tmp_path):
    eng = make_engine()
    sf = SwapFile(tmp_path, 4 * PAGE, eng)
    sf.close()
    sf.close()  # idempotent
    with pytest.raises(ValueError, match="is closed"):
        sf.read(aligned_empty(PAGE), 0)
    with pytest.raises(ValueError, match="is closed"):
        sf.fileno()
    eng.close()
    eng.close()
    with pytest.raises(RuntimeError, match="IOEngine is closed"):
        eng.write(aligned_empty(PAGE), 0, 0)
    with pytest.raises(RuntimeError, match="IOEngine is closed"):
        eng.inject_delay(1)


def test_engine_config_is_validated():
    with pytest.raises(ConfigError, match=r"aio\.block_size=5000 must be a positive multiple"):
        IOEngine({"block_size": 5000})
    with pytest.raises(ConfigError, match="unknown key"):
        IOEngine({"depth": 3})
    with pytest.raises(ConfigError, match=r"aio\.backend='spdk' is not one of"):
        IOEngine({"backend": "spdk"})


def test_fault_and_delay_arguments_are_validated(engine):
    with pytest.raises(ValueError, match="nth"):
        engine.inject_fault(-1, 5)
    with pytest.raises(ValueError, match="errno"):
        engine.inject_fault(1, 0)
    with pytest.raises(ValueError, match="per="):
        engine.inject_fault(1, 5, per="batch")
    with pytest.raises(ValueError, match="us="):
        engine.inject_delay(-5)


def test_aligned_empty(tmp_path):
    t = aligned_empty(5 * PAGE + 8, torch.float64)
    assert t.dtype == torch.float64 and t.numel() == (5 * PAGE + 8) // 8
    assert t.data_ptr() % PAGE == 0
    with pytest.raises(ValueError, match=r"whole number of torch\.float32"):
        aligned_empty(6, torch.float32)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        aligned_empty(-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            aligned_empty(PAGE, pinned=True)
    assert aligned_empty(0).numel() == 0
