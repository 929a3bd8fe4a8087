"""``activations="auto"``, the measured bytes of every forward, and the check that
refuses a larger forward before it runs.

References: the fake-tensor estimate (no engine involved) for what a forward
saves; ``activations="keep"`` for the weights (a refused forward must leave
nothing changed: the steps after it equal a run that never tried it);
hand-computed choices for :func:`choose_blocks`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from activation_helpers import BATCH, SEQ, VOCAB, activation_config, tiny_model

import infinity
from infinity.activations.estimate import estimate
from infinity.activations.policy import choose_blocks
from infinity.config import ConfigError
from infinity.devices.cpu import CpuBackend
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.runtime.state_access import read_params
from infinity.utils.sizes import format_size

pytest.importorskip("transformers")


def test_auto_places_the_last_blocks_first() -> None:
    sizes = [10, 10, 10, 10]
    # The device holds two (the last two: backward needs them first), the host one more.
    assert choose_blocks(sizes, 25, 10, has_nvme=False) == [
        "checkpoint", "offload", "keep", "keep",
    ]  # fmt: skip
    assert choose_blocks(sizes, 25, 10, has_nvme=True) == ["offload", "offload", "keep", "keep"]
    assert choose_blocks(sizes, 0, 0, has_nvme=False) == ["checkpoint"] * 4
    assert choose_blocks(sizes, 40, 0, has_nvme=False) == ["keep"] * 4


@pytest.mark.parametrize("policy", ["keep", "checkpoint", "offload", "auto"])
def test_every_forward_is_measured_as_the_estimate_says(policy: str) -> None:
    model = tiny_model("llama")
    est = estimate(model, BATCH, SEQ, torch.float32)
    model = infinity.offload(model, activation_config(model, "fp32", policy, None))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    act = infinity.stats(model)["activations"]
    assert act["policy"] == policy and act["tokens_last_forward"] == BATCH * SEQ
    # checkpoint: the blocks save their inputs only (what they save again in
    # backward, one block at a time, is not the forward's)
    expect = est.total if policy != "checkpoint" else sum(est.block_inputs) + est.outside_blocks
    assert act["saved_last_forward_bytes"] == expect
    assert act["saved_bytes_per_token"] == expect / (BATCH * SEQ)
    # what stayed on the device: offload (every size moves here) and auto's first,
    # measuring forward move everything; keep and checkpoint move nothing
    moved = policy in ("offload", "auto")
    assert act["device_last_forward_bytes"] == (0 if moved else expect)
    engine_of(model).close()


def _train(policy: str, nvme: str | None, batches: list[int], **overrides):
    """Steps at the given batch sizes; a refused forward is recorded, not stepped."""
    model = tiny_model("llama")
    config = dataclasses.replace(activation_config(model, "fp32", policy, nvme), **overrides)
    model = infinity.offload(model, config)
    engine = engine_of(model)
    first_block = model.model.layers[0]
    ran = []
    first_block.register_forward_pre_hook(lambda m, a: ran.append(1))
    opt = CPUAdam(model.parameters(), lr=3e-3)
    losses: list[float | str] = []
    try:
        for batch in batches:
            # seeded by the steps taken: a refused batch does not shift the data after it
            steps = sum(not isinstance(x, str) for x in losses)
            g = torch.Generator().manual_seed(steps)
            ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
            before = len(ran)
            try:
                loss = model(input_ids=ids, labels=ids).loss
            except ConfigError as exc:
                assert len(ran) == before, "refused before any block ran"
                losses.append(str(exc))
                continue
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        masters = {
            e.name: v.clone() for e, v in read_params(engine, engine.registry.entries, master=True)
        }
        return losses, masters, infinity.stats(model)
    finally:
        engine.close()


def _same_training(run, reference) -> None:
    losses, masters, _ = run
    ref_losses, ref_masters, _ = reference
    assert [x for x in losses if not isinstance(x, str)] == ref_losses
    for key, value in ref_masters.items():
        assert torch.equal(masters[key], value), key


def test_keep_refuses_a_larger_forward_the_device_cannot_hold(monkeypatch) -> None:
    reference = _train("keep", None, [BATCH, BATCH])
    saved = reference[2]["activations"]["saved_last_forward_bytes"]
    # A device with room for two forwards: the one with 4x the tokens is refused
    # before it runs, naming the bytes; training goes on as if it was never tried.
    monkeypatch.setattr(CpuBackend, "free_memory", lambda self: 2 * saved)
    run = _train("keep", None, [BATCH, 4 * BATCH, BATCH])
    message = run[0][1]
    assert isinstance(message, str)
    assert "activations='keep'" in message and f"{format_size(2 * saved)} free" in message
    assert f"for {4 * BATCH * SEQ} tokens" in message and "measured at" in message
    assert "activations='offload'" in message
    _same_training(run, reference)


def test_a_first_forward_too_large_is_refused_before_it_runs(monkeypatch) -> None:
    """Nothing measured yet: the estimate on fake tensors stands in."""
    monkeypatch.setattr(CpuBackend, "free_memory", lambda self: 1 << 20)
    losses = _train("keep", None, [BATCH])[0]
    assert isinstance(losses[0], str) and "estimated before the first forward" in losses[0]
    assert (
        format_size(estimate(tiny_model("llama"), BATCH, SEQ, torch.float32).total) in (losses[0])
    )


def test_offload_refuses_a_larger_forward_beyond_the_nvme_limit(tmp_path) -> None:
    reference = _train("keep", None, [BATCH, BATCH])
    saved = reference[2]["activations"]["saved_last_forward_bytes"]
    model = tiny_model("llama")
    config = activation_config(model, "fp32", "offload", str(tmp_path))
    states = engine_of(infinity.offload(model, config)).plan.nvme_bytes
    engine_of(model).close()
    # NVMe for the states and about 1.5 forwards of activations: 4x the tokens cannot fit.
    run = _train(
        "offload", str(tmp_path), [BATCH, 4 * BATCH, BATCH], nvme_memory=states + saved * 3 // 2
    )
    message = run[0][1]
    assert isinstance(message, str)
    assert "activations='offload'" in message and "short" in message
    assert "nvme_memory" in message
    _same_training(run, reference)


@pytest.mark.parametrize("expect", ["keep", "offload", "checkpoint"])
def test_auto_chooses_by_the_budgets_and_trains_like_keep(expect: str, tmp_path) -> None:
    reference = _train("keep", None, [BATCH] * 3)
    nvme, budgets = None, {}
    if expect == "keep":  # room beside the chunk slots for every block
        budgets = {"device_memory": "64MiB"}
    elif expect == "offload":  # a device full of slots, states and activations on NVMe
        nvme = str(tmp_path)
    else:  # no NVMe, and host memory for the states and 64 KiB (under one block)
        budgets = {"host_memory": reference[2]["host_reserved_bytes"] + (64 << 10)}
    run = _train("auto", nvme, [BATCH] * 3, **budgets)
    act = run[2]["activations"]
    assert act["blocks"][expect] == 3, act["blocks"]
    if expect != "checkpoint":  # (there, what host memory cannot hold stays put)
        # on the device: the blocks auto keeps, within the room the chunk slots leave
        stats = run[2]
        room = stats["device_budget_bytes"] - stats["device_reserved_bytes"]
        kept = sum(reference[2]["activations"]["per_block_last_forward_bytes"])
        assert act["device_last_forward_bytes"] == (kept if expect == "keep" else 0)
        assert act["device_last_forward_bytes"] <= room
    _same_training(run, reference)


def test_the_train_command_reports_what_auto_chose(tmp_path, capsys, monkeypatch) -> None:
    from infinity.cli.main import main

    monkeypatch.chdir(tmp_path)
    flags = ["--preset", "tiny", "--plot", "none", "--eval-batches", "0", "--steps", "2"]
    code = main(["train", *flags, "--activations", "auto", "--nvme-path", str(tmp_path / "n")])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("activations (auto: "))
    assert "blocks offloaded" in line and "saved by the last forward" in line
