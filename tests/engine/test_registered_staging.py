"""The staging slabs of an NVMe-backed model are registered with io_uring and used."""

from __future__ import annotations

import pytest
from engine_helpers import (
    batches,
    config,
    global_rel_error,
    param_bytes,
    reference_pair,
    tiny_gpt,
    train,
)

import infinity
from infinity.io import IOEngine, available_backends
from infinity.optim import CPUAdam


def _offloaded(tmp_path, backend: str):
    model = tiny_gpt()
    ref, ref_opt = reference_pair(model)
    pbytes = param_bytes(model, 4)
    model = infinity.offload(
        model,
        config(
            device_memory=pbytes * 6 // 10,
            host_memory=pbytes,
            chunk_size="24KiB",
            nvme_path=str(tmp_path),
            aio={"backend": backend},
        ),
    )
    return model, CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1), ref, ref_opt


@pytest.mark.skipif("io_uring" not in available_backends(), reason="io_uring is not usable here")
def test_nvme_transfers_go_through_registered_staging_and_match_torch(tmp_path):
    model, opt, ref, ref_opt = _offloaded(tmp_path, "io_uring")
    data = batches(3)
    train(model, opt, data)
    train(ref, ref_opt, data)
    assert global_rel_error(model, ref) < 1e-5
    stats = infinity.stats(model)
    assert stats["nvme_registered_buffers"] is True
    assert "nvme_registration_error" not in stats
    engine = model._infinity_engine
    assert engine.swap.engine.fixed_transfers > 0


def test_a_refused_registration_is_reported_and_changes_nothing_else(tmp_path, monkeypatch):
    refusal = "io_uring_register(IORING_REGISTER_BUFFERS): Cannot allocate memory (errno 12)"
    monkeypatch.setattr(IOEngine, "register_buffers", lambda self, tensors: refusal)
    model, opt, ref, ref_opt = _offloaded(tmp_path, "auto")
    data = batches(2)
    train(model, opt, data)
    train(ref, ref_opt, data)
    assert global_rel_error(model, ref) < 1e-5
    stats = infinity.stats(model)
    assert stats["nvme_registered_buffers"] is False
    assert stats["nvme_registration_error"] == refusal
    assert stats["nvme_read_bytes"] > 0 and stats["nvme_write_bytes"] > 0
