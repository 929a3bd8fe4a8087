"""Chunks homed on the device (NOTE [chunks homed on the device], issue 43 part 2).

Device room beyond a slot for every chunk copy homes whole trainable chunks on the
device: their parameters, gradients and optimizer unit never cross the link and their
update runs there. References: ``torch.optim.AdamW`` on a deep copy, the same model
offloaded with every chunk homed on the host (on the CPU backend both updates are the
host kernel's, so they agree bit for bit), the counters of bytes the link moved, and
``adam_on_device`` against the host kernel and torch's AdamW on the same buffers.
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
    train,
)

import infinity
from infinity.core.names import DEVICE, HOST
from infinity.offload import engine_of
from infinity.optim import CPUAdafactor, CPUAdam, kernels
from infinity.optim.adafactor import ADAFACTOR
from infinity.optim.chunk_optimizer import StepViews
from infinity.optim.cpu_adam import ADAM, AdamHyperParams, adam_on_device
from infinity.optim.device_state import DEVICE_STEP_ELEMS
from infinity.optim.lion import LION, LionHyperParams, lion_on_device, lion_step
from infinity.optim.sgd import SGD, SGDHyperParams, sgd_on_device, sgd_step
from infinity.runtime.budgets import plan_for
from infinity.runtime.params import ParamRegistry

CHUNK = "16KiB"


def _offloaded(device_factor: float, dtype: str = "fp32", seed: int = 0, **kw):
    """A tiny GPT offloaded with ``device_memory`` of ``device_factor`` x its parameter
    bytes in ``dtype``, 16 KiB chunks; and its plain copy."""
    model = tiny_gpt(seed)
    ref = copy.deepcopy(model)
    size = 4 if dtype == "fp32" else 2
    budget = int(device_factor * param_bytes(model, size))
    cfg = config(device_memory=budget, host_memory="64MiB", dtype=dtype, chunk_size=CHUNK, **kw)
    return infinity.offload(model, cfg), ref


def _homes(model) -> list[str]:
    return [str(home) for home in engine_of(model).plan.optim_home if home is not None]


def test_room_beyond_every_copy_homes_chunks_on_the_device_and_nothing_crosses_the_link():
    model, ref = _offloaded(12.0)
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    data = batches(4)
    train(model, opt, data[:1])
    before = infinity.stats(model)
    train(model, opt, data[1:])
    train(ref, ref_opt, data)
    after = infinity.stats(model)
    assert set(_homes(model)) == {str(DEVICE)}
    assert after["placement"]["optim"][DEVICE] == len(_homes(model))
    # Every chunk trainable and homed on the device: no byte crosses the link.
    assert after["h2d_bytes"] - before["h2d_bytes"] == 0
    assert after["d2h_bytes"] - before["d2h_bytes"] == 0
    assert global_rel_error(model, ref) < 1e-5


def test_a_small_device_budget_homes_nothing_there():
    model, _ref = _offloaded(0.6)
    CPUAdam(model.parameters())
    assert set(_homes(model)) == {str(HOST)}


@pytest.mark.parametrize(
    ("dtype", "clip", "accum"), [("fp32", 0.0, 1), ("bf16", 0.5, 2), ("fp32", 0.05, 2)]
)
def test_chunks_homed_on_the_device_train_bit_for_bit_as_homed_on_the_host(dtype, clip, accum):
    """Some chunks homed on the device, the rest on the host, against every chunk on the
    host: the CPU backend's device is RAM and both update with the host kernel."""
    results = []
    for factor in (0.6, 4.0):
        model, _ref = _offloaded(factor, dtype)
        opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)

        def clip_grads(_step, model=model):
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

        train(model, opt, batches(3 * accum), accum=accum, before_step=clip_grads)
        results.append((_homes(model), model.state_dict(), opt.state_dict()))
    (host_homes, host_sd, host_opt), (mixed_homes, mixed_sd, mixed_opt) = results
    assert str(DEVICE) not in host_homes
    assert str(DEVICE) in mixed_homes and str(HOST) in mixed_homes
    for name, value in host_sd.items():
        assert torch.equal(value, mixed_sd[name]), name
    for index, state in host_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(mixed_opt["state"][index][key])
            )


def test_a_checkpoint_moves_between_device_and_host_homes(tmp_path):
    data = batches(4)
    straight, _ref = _offloaded(12.0)
    opt = CPUAdam(straight.parameters(), lr=1e-2)
    train(straight, opt, data)

    first, _ref = _offloaded(12.0)
    first_opt = CPUAdam(first.parameters(), lr=1e-2)
    train(first, first_opt, data[:2])
    infinity.save_checkpoint(tmp_path / "ckpt", first, first_opt)
    second, _ref = _offloaded(0.6)
    second_opt = CPUAdam(second.parameters(), lr=1e-2)
    infinity.load_checkpoint(tmp_path / "ckpt", second, second_opt)
    assert str(DEVICE) not in _homes(second)
    train(second, second_opt, data[2:])
    for name, value in straight.state_dict().items():
        assert torch.equal(value, second.state_dict()[name]), name


def test_the_device_lines_hold_the_homes():
    model, _ref = _offloaded(12.0)
    train(model, CPUAdam(model.parameters()), batches(1))
    lines = infinity.stats(model)["memory"]["device"]["lines"]
    plan = engine_of(model).plan
    assert lines["chunks homed on the device"]["limit"] == plan.home_bytes(DEVICE) > 0
    assert lines["chunk slots"]["limit"] == plan.device_bytes
    assert plan.device_reserved_bytes <= plan.budgets.device


def test_an_optimizer_that_cannot_step_them_is_refused_after_they_are_homed():
    model, _ref = _offloaded(12.0)
    x, y = batches(1)[0]
    model(x, y)  # laid out for Adam at the first forward: homes on the device
    assert str(DEVICE) in _homes(model)
    with pytest.raises(
        ValueError, match="homed on cpu and stepped there.*before the first forward"
    ):
        CPUAdafactor(model.parameters())


def test_the_planner_homes_on_the_device_only_what_the_optimizer_steps_there():
    model = tiny_gpt()
    registry = ParamRegistry.from_model(model)
    big = config(device_memory=12 * param_bytes(model, 4), host_memory="64MiB", chunk_size=CHUNK)
    # a device that is not the host's RAM (the planner asks nothing of it)
    cpu, fence = torch.device("cpu"), torch.device("meta")
    assert DEVICE in plan_for(registry, big, cpu).optim_home
    assert DEVICE in plan_for(registry, big, cpu, LION).optim_home  # the host kernel
    assert DEVICE in plan_for(registry, big, fence).optim_home  # adam_on_device
    assert DEVICE in plan_for(registry, big, fence, LION).optim_home  # lion_on_device
    assert DEVICE in plan_for(registry, big, fence, SGD).optim_home  # sgd_on_device
    assert DEVICE not in plan_for(registry, big, cpu, ADAFACTOR).optim_home  # whole tensors
    int8 = big.replace(optimizer_state_dtype="int8")  # optim/device_state.py's codes
    assert DEVICE in plan_for(registry, int8, fence).optim_home
    assert DEVICE in plan_for(registry, int8, cpu).optim_home
    # "auto" on a device that is not RAM leaves the room to the activations
    auto = big.replace(device_memory="auto")
    assert DEVICE not in plan_for(registry, auto, fence).optim_home
    assert DEVICE in plan_for(registry, auto, cpu).optim_home


def _views(n: int, seed: int, with_out16: bool):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    out16 = torch.empty(n, dtype=torch.bfloat16) if with_out16 else None
    return master, grad, m, v, out16


@pytest.mark.parametrize("adamw", [True, False])
def test_adam_on_device_computes_what_the_host_kernel_computes(adamw):
    """The device update on host buffers (its math, wherever it runs), against the host
    kernel and torch's AdamW, over more than one block."""
    n = DEVICE_STEP_ELEMS + 1000
    hyper = AdamHyperParams(
        lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=adamw
    )
    ours = _views(n, 0, with_out16=True)
    host = _views(n, 0, with_out16=True)
    for step in (1, 2, 3):
        views = StepViews(ours[0], ours[1], {"exp_avg": ours[2], "exp_avg_sq": ours[3]}, ours[4])
        adam_on_device(views, hyper, step=step, grad_scale=0.5)
        kernels.adam_step(
            host[0], host[1], host[2], host[3], step=step, grad_scale=0.5, out16=host[4],
            **hyper.kernel_kwargs(),
        )  # fmt: skip
    for a, b in zip(ours, host, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7)
    # the 16-bit copy is the master rounded to nearest, as the host kernel writes it
    assert torch.equal(ours[4], ours[0].to(torch.bfloat16))
    cuda = torch.device("cuda")
    assert ADAM.steps_on(cuda) and SGD.with_state_dtype("bf16").steps_on(cuda)
    assert ADAM.with_state_dtype("int8").steps_on(cuda)


def test_lion_on_device_computes_what_the_host_kernel_computes():
    n = DEVICE_STEP_ELEMS + 1000
    hyper = LionHyperParams(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    ours = _views(n, 1, with_out16=True)
    host = _views(n, 1, with_out16=True)
    for step in range(3):
        views = StepViews(ours[0], ours[1], {"exp_avg": ours[2]}, ours[4])
        lion_on_device(views, hyper, step=step + 1, grad_scale=0.5)
        lion_step(
            host[0], host[1], host[2], lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1,
            grad_scale=0.5, out16=host[4],
        )  # fmt: skip
    # the sign of the interpolation decides each step: equal wherever it is not ~0
    assert (ours[0] != host[0]).sum() <= 2
    assert torch.allclose(ours[0], host[0], atol=3e-3)
    assert torch.allclose(ours[2], host[2], rtol=1e-6, atol=1e-9)
    assert torch.equal(ours[4], ours[0].to(torch.bfloat16))


def test_each_chunk_homed_there_costs_its_optimizer_unit_beyond_a_slot_for_every_copy():
    """A homed chunk's parameter and gradient copies no longer need cache slots: room for
    k optimizer units beyond a slot for every copy homes exactly k chunks (from the back)."""
    model = tiny_gpt()
    registry = ParamRegistry.from_model(model)
    probe = plan_for(registry, config(device_memory=1 << 30, chunk_size=CHUNK), torch.device("cpu"))
    chunks = probe.layout.chunks
    assert all(c.trainable and not c.oversize for c in chunks)
    every_copy = sum(2 * c.capacity * 4 for c in chunks)
    unit = probe.optim_bytes(len(chunks) - 1)
    for k in (0, 1, 3):
        budget = every_copy + k * unit
        plan = plan_for(
            registry,
            config(device_memory=budget, host_memory="64MiB", chunk_size=CHUNK),
            torch.device("cpu"),
        )
        homed = [i for i, home in enumerate(plan.optim_home) if home == DEVICE]
        assert homed == list(range(len(chunks) - k, len(chunks))), (k, homed)
        assert plan.device_reserved_bytes <= budget


def test_a_budget_above_the_free_device_memory_homes_nothing_there(monkeypatch, caplog):
    """On a GPU, a ``device_memory`` above what it has free reserved only the slots it
    needed before chunks were homed there: the plan then homes none (and says why)
    rather than fail to allocate."""
    from infinity.runtime import budgets

    model = tiny_gpt()
    registry = ParamRegistry.from_model(model)
    big = config(device_memory=12 * param_bytes(model, 4), host_memory="64MiB", chunk_size=CHUNK)
    roomy = plan_for(registry, big, torch.device("cpu"))
    assert DEVICE in roomy.optim_home
    monkeypatch.setattr(budgets, "_free_on_gpu", lambda device: roomy.device_reserved_bytes - 1)
    with caplog.at_level("WARNING", logger="infinity"):
        plan = plan_for(registry, big, torch.device("cpu"))
    assert DEVICE not in plan.optim_home
    # the plan of before: a slot for every copy, no more
    assert plan == plan_for(registry, big, torch.device("cpu"), device_homes=False)
    assert "more than cpu has free" in caplog.text


@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "maximize", "weight_decay"),
    [(0.0, 0.0, False, False, 0.0), (0.9, 0.0, True, False, 0.1), (0.9, 0.3, False, True, 0.1)],
)
def test_sgd_on_device_computes_what_the_host_kernel_computes(
    momentum, dampening, nesterov, maximize, weight_decay
):
    n = DEVICE_STEP_ELEMS + 1000
    hyper = SGDHyperParams(
        lr=1e-2, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
        nesterov=nesterov, maximize=maximize,
    )  # fmt: skip
    ours = _views(n, 2, with_out16=True)
    host = _views(n, 2, with_out16=True)
    for step in (1, 2, 3):
        views = StepViews(ours[0], ours[1], {"momentum_buffer": ours[2]}, ours[4])
        sgd_on_device(views, hyper, first_step=step == 1, grad_scale=0.5)
        sgd_step(
            host[0], host[1], host[2], lr=1e-2, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
            first_step=step == 1, grad_scale=0.5, out16=host[4],
        )  # fmt: skip
    for a, b in zip(ours, host, strict=True):
        if a is not ours[3]:  # (the second moment of these views is not SGD's)
            assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-8)
    assert torch.equal(ours[4], ours[0].to(torch.bfloat16))
