"""Homes planned again for the optimizer constructed over an offloaded model (rehome.py).

``offload()`` plans every home for Adam's units; an optimizer with less state
(Lion, SGD, Adafactor) constructed before any step plans them again, and the
host room it frees goes to parameters and gradients. Checked against plain
PyTorch with the reference optimizers, by the NVMe bytes of a step, and by
what must stay unchanged where the homes cannot move.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
from engine_helpers import (
    batches,
    config,
    global_rel_error,
    offload_on_nvme,
    param_bytes,
    tiny_gpt,
    train,
)
from lion_reference import ReferenceLion

import infinity
from infinity.core.names import HOST
from infinity.offload import engine_of
from infinity.optim import CPUSGD, CPUAdafactor, CPUAdam, CPULion
from infinity.runtime import rehome
from infinity.runtime.state_access import read_params

STEPS = 3
TOL = 1e-5
HOST_FACTOR = 2.5  # host memory, in fp32 parameters: Adam's units leave it to a few parameters

OPTIMIZERS = {
    "sgd": (
        lambda ps: CPUSGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False),
    ),
    "lion": (
        lambda ps: CPULion(ps, lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1),
        lambda ps: ReferenceLion(ps, lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1),
    ),
    "adafactor": (
        lambda ps: CPUAdafactor(ps, lr=2e-2, weight_decay=0.01),
        lambda ps: torch.optim.Adafactor(ps, lr=2e-2, weight_decay=0.01, foreach=False),
    ),
}


def _offload(tmp_path, *, seed=0, **overrides):
    """A tiny GPT offloaded with a small host budget (the rest on NVMe), and a copy."""
    model = tiny_gpt(seed=seed)
    ref = copy.deepcopy(model)
    return offload_on_nvme(model, tmp_path, HOST_FACTOR, **overrides), ref


def _host_homes(plan) -> int:
    return sum(h == HOST for homes in (plan.param_home, plan.grad_home) for h in homes)


def _nvme_bytes_of_last_step(model) -> float:
    last = infinity.stats(model)["last_step"]
    return last["nvme_read_bytes"] + last["nvme_write_bytes"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_rehomed_training_matches_the_reference(name, tmp_path):
    make, make_ref = OPTIMIZERS[name]
    model, ref = _offload(tmp_path)
    engine = engine_of(model)
    adams, old_swap = engine.home_plan, engine.swap.path
    opt = make(model.parameters())
    new = engine.home_plan
    # the homes really moved: more parameter and gradient chunks in host memory
    assert _host_homes(new) > _host_homes(adams)
    assert new.nvme_bytes < adams.nvme_bytes
    assert not os.path.exists(old_swap)  # the old swap file was released
    assert [s.path for s in engine.swaps] == [engine.swap.path]
    data = batches(STEPS)
    losses = train(model, opt, data)
    ref_losses = train(ref, make_ref(ref.parameters()), data)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert global_rel_error(model, ref) < TOL
    engine.close()


def test_the_nvme_bytes_of_a_step_drop(tmp_path, monkeypatch):
    data = batches(2)
    model, _ = _offload(tmp_path)
    train(model, CPULion(model.parameters(), lr=1e-3), data)
    rehomed = _nvme_bytes_of_last_step(model)
    engine_of(model).close()
    # the same optimizer in the homes planned for Adam (units re-cut inside them)
    monkeypatch.setattr(rehome, "_new_plan", lambda engine, wanted: (None, ""))
    model, _ = _offload(tmp_path)
    train(model, CPULion(model.parameters(), lr=1e-3), data)
    in_adams = _nvme_bytes_of_last_step(model)
    engine_of(model).close()
    # NOTE: a step's measured bytes move with prefetch timing (0.80x in one run under
    # load): the claim is that they drop, as they cannot without the re-home.
    assert 0 < rehomed < in_adams


def test_adam_keeps_the_homes_of_offload(tmp_path):
    model, ref = _offload(tmp_path)
    engine = engine_of(model)
    plan, manager = engine.home_plan, engine.manager
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    assert engine.home_plan is plan and engine.manager is manager
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    data = batches(2)
    assert train(model, opt, data) == pytest.approx(train(ref, ref_opt, data), rel=1e-5)
    engine.close()


def test_lion_then_adam_plans_the_homes_back_up(tmp_path):
    model, ref = _offload(tmp_path)
    engine = engine_of(model)
    adams = engine.home_plan
    CPULion(model.parameters(), lr=1e-3)
    assert engine.home_plan.nvme_bytes < adams.nvme_bytes
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    back = engine.home_plan
    assert (back.param_home, back.grad_home, back.optim_home) == (
        adams.param_home,
        adams.grad_home,
        adams.optim_home,
    )
    assert back.state_slots == adams.state_slots
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    data = batches(2)
    assert train(model, opt, data) == pytest.approx(train(ref, ref_opt, data), rel=1e-5)
    engine.close()


def test_adam_after_lion_errors_clearly_where_its_homes_cannot_come_back(tmp_path, monkeypatch):
    model, ref = _offload(tmp_path)
    engine = engine_of(model)
    opt = CPULion(model.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    monkeypatch.setattr(rehome, "_no_room", lambda engine, plan: "no room (test)")
    with pytest.raises(ValueError, match="homes were planned for .*CPULion"):
        CPUAdam(model.parameters(), lr=1e-3)
    # nothing changed: Lion still trains as its reference
    ref_opt = ReferenceLion(ref.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    data = batches(2)
    assert train(model, opt, data) == pytest.approx(train(ref, ref_opt, data), rel=1e-5)
    assert global_rel_error(model, ref) < TOL
    engine.close()


def test_a_swap_file_over_nvme_memory_keeps_adams_homes(tmp_path, caplog):
    model, _ = _offload(tmp_path / "probe")
    adam_nvme = engine_of(model).home_plan.nvme_bytes
    engine_of(model).close()
    # both swap files exist during the move: together they exceed this budget
    model, ref = _offload(tmp_path, nvme_memory=adam_nvme + adam_nvme // 4)
    engine = engine_of(model)
    plan = engine.home_plan
    with caplog.at_level(logging.WARNING, logger="infinity"):
        opt = CPULion(model.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "nvme_memory" in warnings[0] and "kept" in warnings[0]
    assert engine.home_plan is plan and engine.plan.state_slots == ("exp_avg",)
    ref_opt = ReferenceLion(ref.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    data = batches(2)
    assert train(model, opt, data) == pytest.approx(train(ref, ref_opt, data), rel=1e-5)
    engine.close()


def test_a_failed_allocation_keeps_adams_homes(tmp_path, monkeypatch, caplog):
    model, _ = _offload(tmp_path)
    engine = engine_of(model)
    plan, swap = engine.home_plan, engine.swap

    def no_space(config, nbytes):
        raise OSError(28, "No space left on device (test)")

    monkeypatch.setattr(rehome, "open_swap", no_space)
    with caplog.at_level(logging.WARNING, logger="infinity"):
        CPUSGD(model.parameters(), lr=0.05, momentum=0.9)
    assert "No space left" in caplog.text
    assert engine.home_plan is plan and engine.swap is swap and os.path.exists(swap.path)
    engine.close()


def test_a_failure_during_the_move_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    model, ref = _offload(tmp_path)
    engine = engine_of(model)
    plan, swap = engine.home_plan, engine.swap
    before = {e.name: v.clone() for e, v in read_params(engine, engine.registry.entries)}
    real_copy = rehome._copy_values
    swap_dirs = set(os.listdir(tmp_path))

    def failing_copy(chunks, new):
        new.write_initial = None  # the first chunk written raises
        real_copy(chunks, new)

    monkeypatch.setattr(rehome, "_copy_values", failing_copy)
    with pytest.raises(TypeError):
        CPULion(model.parameters(), lr=1e-3)
    assert engine.home_plan is plan and engine.swap is swap and engine.swaps == [swap]
    assert set(os.listdir(tmp_path)) == swap_dirs  # the new swap file is gone
    after = dict((e.name, v) for e, v in read_params(engine, engine.registry.entries))
    assert all(torch.equal(before[name], after[name]) for name in before)
    # and the next optimizer re-homes and trains as its reference
    monkeypatch.undo()
    opt = CPULion(model.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    assert engine.home_plan is not plan
    ref_opt = ReferenceLion(ref.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    data = batches(2)
    assert train(model, opt, data) == pytest.approx(train(ref, ref_opt, data), rel=1e-5)
    engine.close()


def test_a_forward_before_the_optimizer_keeps_the_homes(tmp_path, caplog):
    model, _ = _offload(tmp_path)
    engine = engine_of(model)
    plan = engine.home_plan
    x, _y = batches(1)[0]
    with torch.no_grad():
        model(x)
    with caplog.at_level(logging.WARNING, logger="infinity"):
        CPULion(model.parameters(), lr=1e-3)
    assert "a forward ran before the optimizer" in caplog.text
    assert engine.home_plan is plan
    engine.close()


def test_bf16_values_and_masters_move_exactly(tmp_path):
    model = tiny_gpt()
    pbytes = param_bytes(model, 2)
    cfg = config(
        dtype="bf16",
        device_memory=pbytes * 6 // 10,
        host_memory=pbytes * 5,
        nvme_path=str(tmp_path),
        chunk_size="12KiB",
    )
    model = infinity.offload(model, cfg)
    engine = engine_of(model)
    entries = engine.registry.entries
    params = {e.name: v for e, v in read_params(engine, entries)}
    masters = {e.name: v for e, v in read_params(engine, entries, master=True)}
    adams = engine.home_plan
    CPULion(model.parameters(), lr=1e-3)
    assert engine.home_plan.nvme_bytes < adams.nvme_bytes
    assert all(torch.equal(params[e.name], v) for e, v in read_params(engine, entries))
    moved = read_params(engine, entries, master=True)
    assert all(torch.equal(masters[e.name], v) for e, v in moved)
    engine.close()


def test_a_checkpoint_after_a_rehome_resumes_exactly(tmp_path):
    data = batches(4, seed=3)

    def setup(seed=0):
        model, _ = _offload(tmp_path / "nvme", seed=seed)
        adams = engine_of(model).home_plan
        opt = CPULion(model.parameters(), lr=2e-3, weight_decay=0.1)
        assert engine_of(model).home_plan.nvme_bytes < adams.nvme_bytes
        return model, opt

    (tmp_path / "nvme").mkdir()
    model, opt = setup()
    straight = train(model, opt, data)
    engine_of(model).close()
    model, opt = setup()
    first = train(model, opt, data[:2])
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()
    model, opt = setup(seed=5)
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    second = train(model, opt, data[2:])
    assert first + second == straight
    engine_of(model).close()


def test_the_new_homes_take_the_old_device_slabs(tmp_path):
    """A device budget near the GPU's memory cannot hold two sets of slots: the new
    manager takes the old one's slabs (copies only; neither uses them during the move)."""
    model, ref = _offload(tmp_path)
    engine = engine_of(model)
    old_slots = engine.home_plan.device_slots
    slabs = {pool.slab.data_ptr() for pool in engine.manager.device.pools.values()}
    opt = CPULion(model.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    assert engine.home_plan.device_slots == old_slots
    assert {pool.slab.data_ptr() for pool in engine.manager.device.pools.values()} == slabs
    ref_opt = ReferenceLion(ref.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    data = batches(2)
    assert train(model, opt, data) == pytest.approx(train(ref, ref_opt, data), rel=1e-5)
    engine.close()
