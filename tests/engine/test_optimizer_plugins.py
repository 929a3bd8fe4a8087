"""Optimizers as plug-ins: CPUSGD, CPULion and CPUAdafactor train offloaded models like their
references.

Each case trains the same model on the same batches twice, once plainly with
the reference (``torch.optim.SGD``, ``torch.optim.Adafactor``, or the Lion written in
``lion_reference``)
and once offloaded with the infinity optimizer, with budgets that keep the
optimizer state in host memory or send it to NVMe, with accumulation and
clipping, and with the overlapped step. The engine learns the optimizer from
the one constructed over the model: no other switch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import (
    batches,
    config,
    global_rel_error,
    param_bytes,
    tiny_gpt,
    tiny_llama,
    train,
)
from lion_reference import ReferenceLion

import infinity
from infinity.config import ConfigError
from infinity.core.names import NVME
from infinity.offload import engine_of
from infinity.optim import CPUSGD, CPUAdafactor, CPUAdam, CPULion

STEPS = 4
TOL = 1e-5  # fp32: rounding-level differences, amplified a little by training

# name -> (infinity optimizer, reference), both from a parameter list
OPTIMIZERS = {
    "sgd-momentum-decay": (
        lambda ps: CPUSGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False),
    ),
    "sgd-nesterov": (
        lambda ps: CPUSGD(ps, lr=0.05, momentum=0.8, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True, foreach=False),
    ),
    "sgd-dampening-maximize": (
        lambda ps: CPUSGD(ps, lr=0.02, momentum=0.5, dampening=0.3, maximize=True),
        lambda ps: torch.optim.SGD(
            ps, lr=0.02, momentum=0.5, dampening=0.3, maximize=True, foreach=False
        ),
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
# Adafactor's factored states are per tensor, in host memory: no state slot.
SLOTS = {"sgd": ("momentum_buffer",), "lion": ("exp_avg",), "adafactor": ()}


def _budgets(model: torch.nn.Module, placement: str, tmp_path) -> dict:
    pbytes = param_bytes(model, 4)
    cfg = {"device_memory": pbytes * 6 // 10, "chunk_size": "24KiB"}
    if placement == "nvme":
        # NOTE: 2x the parameters of host memory holds parameters and gradients,
        # the units (one slot) go to NVMe.
        cfg.update(host_memory=pbytes * 2, nvme_path=str(tmp_path))
    return cfg


def _run(name: str, placement: str, tmp_path, *, accum=1, clip=0.0, overlap=False):
    """(offloaded model, its optimizer, reference model, reference optimizer), trained."""
    make, make_ref = OPTIMIZERS[name]
    model = tiny_gpt()
    ref = copy.deepcopy(model)
    ref_opt = make_ref(ref.parameters())
    cfg = _budgets(model, placement, tmp_path)
    model = infinity.offload(model, config(overlap_optimizer=overlap, **cfg))
    opt = make(model.parameters())
    engine = engine_of(model)
    assert engine.plan.state_slots == SLOTS[name.split("-")[0]]
    if placement == "nvme" and SLOTS[name.split("-")[0]]:
        # NOTE: fp32 Adafactor's units are empty (its factors are per tensor): the
        # homes planned again for it keep nothing on NVMe.
        assert NVME in set(engine.plan.optim_home)
    data = batches(STEPS * accum)

    def clipping(model):
        if not clip:
            return None
        return lambda _step: torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

    losses = train(model, opt, data, accum=accum, before_step=clipping(model))
    ref_losses = train(ref, ref_opt, data, accum=accum, before_step=clipping(ref))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    return model, opt, ref, ref_opt


@pytest.mark.parametrize("placement", ["host", "nvme"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offloaded_training_matches_the_reference(name, placement, tmp_path):
    model, opt, ref, ref_opt = _run(name, placement, tmp_path)
    assert global_rel_error(model, ref) < TOL
    # The optimizer state dict carries the slots by name, as the reference's does.
    state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        for slot, tensor in value.items():
            torch.testing.assert_close(state[key][slot], tensor, rtol=1e-4, atol=1e-6)
    engine_of(model).close()


@pytest.mark.parametrize("name", ["sgd-momentum-decay", "lion", "adafactor"])
def test_accumulation_and_clipping_with_states_on_nvme(name, tmp_path):
    model, _opt, ref, _ = _run(name, "nvme", tmp_path, accum=2, clip=0.5)
    assert global_rel_error(model, ref) < TOL
    engine_of(model).close()


@pytest.mark.parametrize("name", ["sgd-nesterov", "lion", "adafactor"])
def test_the_overlapped_step(name, tmp_path):
    model, _opt, ref, _ = _run(name, "nvme", tmp_path, overlap=True)
    engine = engine_of(model)
    assert engine.queue.early_chunk_steps > 0  # chunks stepped during backward
    assert global_rel_error(model, ref) < TOL
    engine.close()


def _nvme_bytes_per_step(make, tmp_path) -> tuple[int, int]:
    """NVMe bytes read and written by the second step of a model whose states are on NVMe."""
    model = tiny_gpt()
    model = infinity.offload(model, config(**_budgets(model, "nvme", tmp_path)))
    opt = make(model.parameters())
    data = batches(2)
    train(model, opt, data[:1])
    engine_of(model).synchronize()
    before = infinity.stats(model)
    train(model, opt, data[1:])
    engine_of(model).synchronize()
    after = infinity.stats(model)
    engine_of(model).close()
    return tuple(after[k] - before[k] for k in ("nvme_read_bytes", "nvme_write_bytes"))


def test_the_optimizer_decides_the_bytes_that_cross_the_disk(tmp_path):
    """Lion and SGD with momentum move one fp32 state per parameter, Adam two: with the
    same budgets the units they read and write per step shrink."""
    adam = _nvme_bytes_per_step(lambda ps: CPUAdam(ps, lr=1e-3), tmp_path / "adam")
    lion = _nvme_bytes_per_step(lambda ps: CPULion(ps, lr=1e-4), tmp_path / "lion")
    sgd = _nvme_bytes_per_step(lambda ps: CPUSGD(ps, lr=0.1, momentum=0.9), tmp_path / "sgd")
    adafactor = _nvme_bytes_per_step(lambda ps: CPUAdafactor(ps), tmp_path / "adafactor")
    for ours in (lion, sgd, adafactor):
        assert ours[0] < adam[0] and ours[1] < adam[1]
    # Adafactor's states stay in host memory: with fp32 compute its units are empty,
    # so its NVMe traffic is what the others move besides their units.
    assert adafactor[0] <= adam[0] - 2 * (adam[0] - lion[0])
    assert adafactor[1] <= adam[1] - 2 * (adam[1] - lion[1])
    # ... and take R + C numbers per matrix, a full one per vector, in host memory.
    model = tiny_gpt()
    factors = sum(
        p.shape[0] + p.shape[1] if p.dim() == 2 else p.numel() for p in model.parameters()
    )
    model = infinity.offload(model, config())
    train(model, CPUAdafactor(model.parameters()), batches(1))
    assert infinity.stats(model)["optimizer_tensor_state_bytes"] == 4 * factors
    engine_of(model).close()
    # fp32 compute: a unit is the state slots alone, so Lion's is exactly half Adam's.
    model = tiny_gpt()
    model = infinity.offload(model, config(**_budgets(model, "nvme", tmp_path / "plan")))
    engine = engine_of(model)
    adams = engine.plan
    adam_units = sum(adams.optim_bytes(i) for i in range(engine.layout.num_chunks))
    CPULion(model.parameters())
    lion_units = sum(engine.plan.optim_bytes(i) for i in range(engine.layout.num_chunks))
    assert lion_units * 2 == adam_units
    assert engine.plan.traffic["nvme_read_bytes"] < adams.traffic["nvme_read_bytes"]
    engine.close()


def test_sgd_refuses_a_state_dtype_it_cannot_store(tmp_path):
    model = infinity.offload(tiny_gpt(), config(optimizer_state_dtype="int8"))
    with pytest.raises(ConfigError, match=r"optimizer_state_dtype='int8'.*CPUSGD.*'fp32'"):
        CPUSGD(model.parameters(), lr=0.1, momentum=0.9)
    # Nothing changed: Adam's units (int8 included) still serve CPUAdam.
    CPUAdam(model.parameters())
    assert engine_of(model).plan.state_slots == ("exp_avg", "exp_avg_sq")
    engine_of(model).close()


def test_the_last_optimizer_constructed_lays_out_the_units_until_one_steps(tmp_path):
    model = infinity.offload(tiny_gpt(), config())
    engine = engine_of(model)
    adam = CPUAdam(model.parameters(), lr=1e-3)
    lion = CPULion(model.parameters(), lr=1e-4)  # nothing stepped yet: Lion takes over
    assert engine.plan.state_slots == ("exp_avg",)
    data = batches(2)
    with pytest.raises(RuntimeError, match=r"CPUAdam cannot step.*CPULion"):
        train(model, adam, data[:1])
    adam.zero_grad()
    train(model, lion, data[1:])
    with pytest.raises(ValueError, match=r"belongs to infinity\.optim\.CPULion.*CPUSGD"):
        CPUSGD(model.parameters(), lr=0.1)
    assert engine.plan.state_slots == ("exp_avg",)  # refused: nothing changed
    engine.close()


def test_adafactor_gathers_a_tensor_staged_in_spans(tmp_path):
    """Adafactor reads whole tensors: an oversize chunk that the host budget stages in
    spans is gathered for its step, and trains like torch.optim.Adafactor (bit for bit
    like the same model whose chunk is staged whole)."""
    vocab = 2048  # the tied embedding (512 KiB in fp32) spans 8 chunks

    def loss_fn(m, batch):
        return m(input_ids=batch[0], labels=batch[1]).loss

    def run(host: str, where: str):
        model = tiny_llama(vocab, hidden=64, intermediate=128, tie=True)
        cfg = {"device_memory": "3MiB", "host_memory": host, "chunk_size": 64 << 10}
        model = infinity.offload(model, config(nvme_path=str(tmp_path / where), **cfg))
        opt = CPUAdafactor(model.parameters(), lr=2e-2, weight_decay=0.01)
        plan = engine_of(model).plan
        spans = plan.span_elems < max(c.capacity for c in plan.layout.chunks)
        losses = train(model, opt, data, loss_fn=loss_fn)
        return model, losses, spans

    data = batches(2, vocab=vocab, seq=16)
    ref = tiny_llama(vocab, hidden=64, intermediate=128, tie=True)
    ref_opt = torch.optim.Adafactor(ref.parameters(), lr=2e-2, weight_decay=0.01, foreach=False)
    ref_losses = train(ref, ref_opt, data, loss_fn=loss_fn)
    model, losses, spans = run("640KiB", "spans")
    whole, whole_losses, whole_spans = run("64MiB", "whole")
    assert spans and not whole_spans
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert global_rel_error(model, ref) < TOL
    assert losses == whole_losses
    for a, b in zip(model.state_dict().values(), whole.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    engine_of(model).close()
    engine_of(whole).close()
