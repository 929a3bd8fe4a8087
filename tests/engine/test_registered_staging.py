"""The staging slabs of an NVMe-backed model are registered with io_uring and used."""

from __future__ import annotations

import pytest
from engine_helpers import nvme_pair, train_pair_error

import infinity
from infinity.io import IOEngine, available_backends
from infinity.offload import engine_of


def _offloaded(tmp_path, backend: str):
    return nvme_pair(tmp_path, host_factor=1.0, aio={"backend": backend})


@pytest.mark.skipif("io_uring" not in available_backends(), reason="io_uring is not usable here")
def test_nvme_transfers_go_through_registered_staging_and_match_torch(tmp_path):
    model, opt, ref, ref_opt = _offloaded(tmp_path, "io_uring")
    assert train_pair_error(model, opt, ref, ref_opt, steps=3) < 1e-5
    stats = infinity.stats(model)
    assert stats["nvme_registered_buffers"] is True
    assert "nvme_registration_error" not in stats
    assert engine_of(model).swap.engine.fixed_transfers > 0


def test_a_refused_registration_is_reported_and_changes_nothing_else(tmp_path, monkeypatch):
    refusal = "io_uring_register(IORING_REGISTER_BUFFERS): Cannot allocate memory (errno 12)"
    monkeypatch.setattr(IOEngine, "register_buffers", lambda self, tensors: refusal)
    model, opt, ref, ref_opt = _offloaded(tmp_path, "auto")
    assert train_pair_error(model, opt, ref, ref_opt, steps=2) < 1e-5
    stats = infinity.stats(model)
    assert stats["nvme_registered_buffers"] is False
    assert stats["nvme_registration_error"] == refusal
    assert stats["nvme_read_bytes"] > 0 and stats["nvme_write_bytes"] > 0
