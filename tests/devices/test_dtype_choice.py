"""``dtype="auto"``: bf16 only where the device computes it natively (NOTE [dtype auto]).

The CPU's abilities are read from ``/proc/cpuinfo`` and torch's and oneDNN's
ISA settings; the tests set each input by hand, so they judge the rule on any
machine, and one test runs a child on this machine held to AVX2 by the same
environment variables torch and oneDNN read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import infinity
from infinity.devices import choice


@pytest.fixture
def cpu(monkeypatch):
    """``cpu(flags, capability)``: pretend the CPU has ``flags`` and torch runs ``capability``."""

    def pretend(flags: set[str], capability: str = "AVX512") -> None:
        monkeypatch.setattr(choice, "_cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)

    return pretend


def test_bf16_only_where_the_cpu_has_bf16_instructions(cpu, monkeypatch):
    cpu({"avx2", "avx512f", "avx512_bf16"})
    assert choice.choose_dtype("cpu").dtype == "bf16"
    cpu({"avx2", "amx_bf16", "amx_tile"})
    assert choice.choose_dtype("cpu").dtype == "bf16"
    cpu({"avx2", "fma", "f16c"}, capability="AVX2")
    picked = choice.choose_dtype("cpu")
    assert picked.dtype == "fp32" and "AVX512_BF16" in picked.reason
    cpu({"avx512f", "avx512_bf16"}, capability="AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert choice.choose_dtype("cpu").dtype == "fp32"
    cpu({"avx512f", "avx512_bf16"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert choice.choose_dtype("cpu").dtype == "fp32"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert choice.choose_dtype("cpu").dtype == "bf16"


def test_the_fence_follows_the_cpu_and_auto_reaches_the_engine(cpu):
    cpu({"avx2"}, capability="AVX2")
    assert choice.choose_dtype("fence").dtype == "fp32"
    assert "fence" in choice.choose_dtype("fence").reason
    resolved = choice.resolved(infinity.Config())
    assert (resolved.device, resolved.dtype) == ("cpu", "fp32")
    assert infinity.Config().dtype == "auto"  # the user's Config keeps it


def test_an_explicit_bf16_on_a_cpu_without_it_warns_once_with_the_cost(cpu):
    cpu({"avx2"}, capability="AVX2")
    choice._warn_emulated_bf16.cache_clear()
    choice.emulated_bf16_slowdown.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"bf16 matmul is \d+x slower than fp32 here"):
        assert choice.resolve_dtype("bf16", "cpu") == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choice.resolve_dtype("bf16", "cpu") == "bf16"  # once per process


def test_an_engine_reports_the_dtype_it_chose(cpu):
    from engine_helpers import tiny_gpt

    from infinity.offload import engine_of

    cpu({"avx2"}, capability="AVX2")
    model = infinity.offload(tiny_gpt(), infinity.Config(device="cpu"))
    try:
        assert infinity.stats(model)["dtype"] == "fp32"
        assert next(model.parameters()).dtype == torch.float32
    finally:
        engine_of(model).close()


def test_a_process_held_to_avx2_picks_fp32_and_its_bf16_is_slow():
    """The real thing on this machine: torch and oneDNN held to AVX2 emulate bf16."""
    code = (
        "from infinity.devices import choice; "
        "print(choice.choose_dtype('cpu').dtype, round(choice.emulated_bf16_slowdown()))"
    )
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    dtype, slowdown = out.stdout.split()
    assert dtype == "fp32"
    assert int(slowdown) >= 3  # emulated bf16 products (94x on an AVX2-only EPYC)
