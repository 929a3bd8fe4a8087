"""Transfer routes as data (NOTE [routes are data]): the table, and a backend that
reads NVMe straight into device memory training like plain PyTorch.

The direct route (nvme -> device) is what GPU-direct storage would give a GPU;
``CpuBackend(nvme_direct=True)`` runs it here, since its device slots are RAM.
Adding it took one route in ``chunks/movers.py``, one mover in
``chunks/movers.py`` and one backend method: these tests hold it to that.
"""

from __future__ import annotations

import copy

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
from infinity.chunks.movers import Purpose, Route, Stop, device_mover, route, route_table
from infinity.core.names import HOST, NVME
from infinity.devices.cpu import CpuBackend
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.runtime import engine as engine_module

STEPS = 4
TOL = 1e-5  # fp32 against torch's single-tensor AdamW (test_equivalence.py's bound)


def test_the_table_says_how_each_purpose_travels():
    table = route_table()
    assert str(table(Purpose.COMPUTE, NVME)) == "nvme -> staging -> device"
    assert str(table(Purpose.COMPUTE, HOST)) == "host -> device"
    assert str(table(Purpose.FLUSH, NVME)) == "device -> staging -> nvme"
    assert str(table(Purpose.STEP, NVME)) == "nvme -> staging"
    direct = route_table(nvme_to_device=True)
    assert str(direct(Purpose.COMPUTE, NVME)) == "nvme -> device"
    # Only the route of parameters from NVMe changes: gradients still add up on
    # the host and the optimizer runs there.
    for purpose, tier in table.routes:
        if (purpose, tier) != (Purpose.COMPUTE, NVME):
            assert direct(purpose, tier) == table(purpose, tier)
    assert len(table.lines()) == len(table.routes)


def test_a_route_visits_each_stop_once_and_an_unknown_one_names_itself():
    with pytest.raises(ValueError, match="each stop once"):
        route(Stop.NVME, Stop.STAGING, Stop.NVME)
    with pytest.raises(AssertionError, match="no mover runs the route host -> staging -> device"):
        device_mover(Route((Stop.HOST, Stop.STAGING, Stop.DEVICE)))


def _on_nvme(tmp_path, monkeypatch, *, direct: bool, lr: float = 1e-3, device_part: int = 2):
    """A tiny GPT with its parameters and states on NVMe on the CPU backend, with or
    without the direct route: (model, reference, its AdamW, backend)."""
    backend = CpuBackend(nvme_direct=direct)
    monkeypatch.setattr(engine_module, "make_backend", lambda _device: backend)
    model = tiny_gpt(hidden=64)
    ref, ref_opt = reference_pair(model, lr=lr)
    pbytes = param_bytes(model, 4)
    cfg = config(
        device_memory=pbytes // device_part,
        host_memory=int(pbytes * 0.5),
        nvme_path=str(tmp_path),
        chunk_size="32KiB",
    )
    model = infinity.offload(model, cfg)
    assert engine_of(model).plan.param_home.count(NVME) > 0, "parameters must be on NVMe"
    return model, ref, ref_opt, backend


def _train_on_nvme(tmp_path, monkeypatch, *, direct: bool):
    """:func:`_on_nvme` trained a few steps beside its reference; (model, reference,
    backend, traffic)."""
    model, ref, ref_opt, backend = _on_nvme(tmp_path, monkeypatch, direct=direct)
    engine = engine_of(model)
    data = batches(STEPS)
    train(model, CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1), data)
    train(ref, ref_opt, data)
    engine.synchronize()
    traffic = infinity.stats(model)
    return model, ref, backend, traffic


def test_parameters_read_straight_into_device_memory_train_like_plain_pytorch(
    tmp_path, monkeypatch
):
    model, ref, backend, direct = _train_on_nvme(tmp_path / "a", monkeypatch, direct=True)
    engine = engine_of(model)
    assert str(engine.manager.routes(Purpose.COMPUTE, NVME)) == "nvme -> device"
    assert backend.direct_reads > 0, "the nvme -> device route never ran"
    err = global_rel_error(model, ref)
    assert err < TOL, f"global relative error {err:.2e}"
    engine.close()

    model, _ref, staged_backend, staged = _train_on_nvme(tmp_path / "b", monkeypatch, direct=False)
    assert staged_backend.direct_reads == 0
    # Parameters read straight into device memory never cross the host -> device link.
    assert direct["h2d_bytes"] < staged["h2d_bytes"]
    engine_of(model).close()


def test_an_update_staged_on_the_host_is_what_the_device_gets(tmp_path, monkeypatch):
    # NOTE: with fp32 parameters the optimizer updates a parameter chunk in host
    # staging and writes it home; the next forward's fetch must see the update
    # whether it comes from that copy or from the disk (an oversize chunk's
    # spans are written as spans: a whole read would not wait for them). Steps
    # of a large learning rate make a stale read change the next loss visibly.
    model, ref, ref_opt, backend = _on_nvme(
        tmp_path, monkeypatch, direct=True, lr=0.1, device_part=3
    )
    initial = copy.deepcopy(ref)
    data = batches(3)
    losses = train(model, CPUAdam(model.parameters(), lr=0.1, weight_decay=0.1), data)
    ref_losses = train(ref, ref_opt, data)
    assert backend.direct_reads > 0
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # At this rate Adam's normalised steps amplify rounding in near-zero gradients
    # (the staged route measures the same 8e-4), far below what the steps moved.
    moved = global_rel_error(initial, ref)
    assert global_rel_error(model, ref) < 0.01 * moved
    engine_of(model).close()
