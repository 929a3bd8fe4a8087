"""The layout decided once, late (NOTE [the layout is decided once, late]).

``offload()`` only checks the budgets with Adam's plan; the homes are planned
and allocated for the first optimizer constructed over the model, or for Adam
at the first forward or read of the chunks. An optimizer with less state
(Lion, SGD, Adafactor) constructed first gets homes planned for it, and the
host room it frees goes to parameters and gradients. Checked against plain
PyTorch with the reference optimizers, by the NVMe bytes of a step, by the
values written at offload, and by what an optimizer constructed too late does.
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
from infinity.runtime.params import is_placeholder
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


def _swap_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def test_offload_allocates_nothing_until_the_optimizer(tmp_path):
    model, _ = _offload(tmp_path)
    engine = engine_of(model)
    assert not engine.laid_out and engine.offload_plan.nvme_bytes > 0
    assert _swap_files(tmp_path) == []  # no swap file yet
    # yet every parameter already looks offloaded: libraries read model.device from it
    assert all(is_placeholder(p.data) for p in model.parameters())
    assert {p.device for p in model.parameters()} == {engine.device}
    CPUAdam(model.parameters(), lr=1e-3)
    assert engine.laid_out and engine.laid_out_by == "the construction of CPUAdam"
    assert engine.home_plan is engine.offload_plan  # Adam's plan, as checked at offload
    assert [s.path for s in engine.swaps] == _swap_files(tmp_path)
    engine.close()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_homes_planned_for_the_optimizer_train_as_the_reference(name, tmp_path):
    make, make_ref = OPTIMIZERS[name]
    model, ref = _offload(tmp_path)
    engine = engine_of(model)
    adams = engine.offload_plan
    opt = make(model.parameters())
    new = engine.home_plan
    # planned for it: more parameter and gradient chunks in host memory than Adam's
    assert _host_homes(new) > _host_homes(adams)
    assert new.nvme_bytes < adams.nvme_bytes
    assert [s.path for s in engine.swaps] == _swap_files(tmp_path)  # one swap file
    data = batches(STEPS)
    losses = train(model, opt, data)
    ref_losses = train(ref, make_ref(ref.parameters()), data)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert global_rel_error(model, ref) < TOL
    engine.close()


def test_the_nvme_bytes_of_a_step_drop(tmp_path, caplog):
    data = batches(2)
    model, _ = _offload(tmp_path)
    train(model, CPULion(model.parameters(), lr=1e-3), data)
    planned_for_lion = _nvme_bytes_of_last_step(model)
    engine_of(model).close()
    # the same optimizer in the homes planned for Adam: a read of the model came first
    model, _ = _offload(tmp_path)
    infinity.stats(model)
    with caplog.at_level(logging.WARNING, logger="infinity"):
        opt = CPULion(model.parameters(), lr=1e-3)
    assert "planned for infinity.optim.CPUAdam at a read of its chunks" in caplog.text
    assert "construct CPULion right after infinity.offload()" in caplog.text
    train(model, opt, data)
    in_adams = _nvme_bytes_of_last_step(model)
    engine_of(model).close()
    # NOTE: a step's measured bytes move with prefetch timing (0.80x in one run under
    # load): the claim is that they drop.
    assert 0 < planned_for_lion < in_adams


def test_a_forward_before_the_optimizer_lays_out_for_adam_and_lion_still_trains(tmp_path, caplog):
    model, ref = _offload(tmp_path)
    engine = engine_of(model)
    x, _y = batches(1)[0]
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x), atol=1e-6)
    assert engine.laid_out_by == "the first forward"
    assert engine.home_plan is engine.offload_plan
    with caplog.at_level(logging.WARNING, logger="infinity"):
        opt = CPULion(model.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    assert "CPULion's units are cut inside them" in caplog.text
    assert engine.home_plan is engine.offload_plan and engine.plan.state_slots == ("exp_avg",)
    ref_opt = ReferenceLion(ref.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    data = batches(2)
    assert train(model, opt, data) == pytest.approx(train(ref, ref_opt, data), rel=1e-5)
    engine.close()


def test_adam_after_lion_is_a_clear_error_and_lion_trains_on(tmp_path):
    model, ref = _offload(tmp_path)
    engine = engine_of(model)
    opt = CPULion(model.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    late = "homes were planned for .*CPULion.*before .*CPUAdam was.*Construct .*CPUAdam first"
    with pytest.raises(ValueError, match=late):
        CPUAdam(model.parameters(), lr=1e-3)
    # nothing changed: Lion still trains as its reference
    ref_opt = ReferenceLion(ref.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    data = batches(2)
    assert train(model, opt, data) == pytest.approx(train(ref, ref_opt, data), rel=1e-5)
    assert global_rel_error(model, ref) < TOL
    engine.close()


def test_a_failed_swap_file_is_an_error_at_the_optimizer_and_leaves_nothing(tmp_path, monkeypatch):
    from infinity.runtime import engine as engine_module

    model, _ = _offload(tmp_path)

    def no_space(config, nbytes):
        raise OSError(28, "No space left on device (test)")

    monkeypatch.setattr(engine_module, "open_swap", no_space)
    with pytest.raises(OSError, match="No space left"):
        CPUSGD(model.parameters(), lr=0.05, momentum=0.9)
    assert _swap_files(tmp_path) == []
    with pytest.raises(RuntimeError, match="could not be laid out .*No space left"):
        infinity.stats(model)
    engine_of(model).close()


def test_bf16_values_and_masters_are_written_exactly_for_lion(tmp_path):
    model = tiny_gpt()
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
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
    CPULion(model.parameters(), lr=1e-3)
    assert engine.home_plan.nvme_bytes < engine.offload_plan.nvme_bytes
    entries = engine.registry.entries
    for entry, value in read_params(engine, entries):
        assert torch.equal(value, values[entry.name].to(torch.bfloat16).to(value.dtype))
    for entry, master in read_params(engine, entries, master=True):
        assert torch.equal(master, values[entry.name])
    engine.close()


def test_a_checkpoint_of_lions_homes_resumes_exactly(tmp_path):
    data = batches(4, seed=3)

    def setup(seed=0):
        model, _ = _offload(tmp_path / "nvme", seed=seed)
        opt = CPULion(model.parameters(), lr=2e-3, weight_decay=0.1)
        engine = engine_of(model)
        assert engine.home_plan.nvme_bytes < engine.offload_plan.nvme_bytes
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
