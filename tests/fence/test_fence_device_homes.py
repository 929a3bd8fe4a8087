"""Chunks homed on the device, on the fence (NOTE [chunks homed on the device]).

There the update of a homed chunk runs as device kernels (``adam_on_device``) and every
host reader (gradients, optimizer state, a loaded state) goes through a host copy of
the device home. References: plain PyTorch on the fence (its gradients, bit for bit)
and ``torch.optim.AdamW`` (its moments and weights, to rounding).
"""

from __future__ import annotations

import copy

import torch
from engine_helpers import batches, gpt_loss, param_bytes, tiny_gpt

import infinity
from infinity.core.names import DEVICE
from infinity.offload import engine_of
from infinity.optim import CPUAdam

FENCE = torch.device("fence", 0)


def _homed(model: torch.nn.Module, dtype: str, room: int) -> torch.nn.Module:
    """``model`` offloaded on the fence with ``room`` x its parameter bytes of device
    memory: every chunk homed there."""
    size = 4 if dtype == "fp32" else 2
    cfg = infinity.Config(
        device="fence",
        dtype=dtype,
        device_memory=room * param_bytes(model, size),
        host_memory="64MiB",
        chunk_size="16KiB",
    )
    return infinity.offload(model, cfg)


def _pair():
    plain = tiny_gpt()
    model = _homed(copy.deepcopy(plain), "fp32", 12)
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    plain = plain.to(FENCE)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    return model, opt, plain, ref_opt


def test_chunks_homed_on_the_fence_train_and_read_back_as_plain_pytorch():
    model, opt, plain, ref_opt = _pair()
    homes = engine_of(model).plan.optim_home
    assert homes and all(home == DEVICE for home in homes)
    for step, (x, y) in enumerate(batches(3)):
        batch = (x.to(FENCE), y.to(FENCE))
        gpt_loss(model, batch).backward()
        gpt_loss(plain, batch).backward()
        if step == 0:  # the gradients (weights still equal), read back from their device homes
            grads = infinity.gradients(model)
            for name, p in plain.named_parameters():
                assert torch.equal(grads[name].cpu(), p.grad.cpu()), name
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ours = model.state_dict()
    for name, value in plain.state_dict().items():
        # a few ulps apart per step (as the host kernel is from torch's AdamW), which
        # Adam's normalisation can carry to a step's size where a gradient is near zero
        torch.testing.assert_close(ours[name].cpu(), value.cpu(), rtol=0, atol=3e-5, msg=name)
    state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for index, moments in ref_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                state[index][key].cpu(), moments[key].cpu(), rtol=1e-4, atol=1e-9
            )


def test_a_state_loaded_into_device_homes_is_what_is_read_back():
    model, opt, _plain, _ref_opt = _pair()
    x, y = batches(1)[0]
    gpt_loss(model, (x.to(FENCE), y.to(FENCE))).backward()
    opt.step()
    saved = opt.state_dict()
    changed = copy.deepcopy(saved)
    for moments in changed["state"].values():
        moments["exp_avg"] = moments["exp_avg"] * 2 + 1
    opt.load_state_dict(changed)
    read = opt.state_dict()["state"]
    for index, moments in changed["state"].items():
        assert torch.equal(read[index]["exp_avg"].cpu(), moments["exp_avg"].cpu())
        assert torch.equal(
            read[index]["exp_avg_sq"].cpu(), saved["state"][index]["exp_avg_sq"].cpu()
        )


def test_pretrained_weights_leave_and_enter_device_homes_whole(tmp_path):
    """A saved model's weights are its state (its oversize embedding, in spans on its home,
    included), and loading them into another model homed on the device computes alike."""
    from engine_helpers import tiny_llama

    def offloaded(seed: int):
        # the embedding is oversize
        model = _homed(tiny_llama(vocab=256, hidden=64, seed=seed), "bf16", 40)
        return model, CPUAdam(model.parameters(), lr=1e-2)

    model, opt = offloaded(0)
    plan = engine_of(model).plan
    assert all(home == DEVICE for home in plan.optim_home)
    assert any(c.oversize for c in plan.layout.chunks)
    ids = torch.randint(0, 256, (2, 16), device=FENCE)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    infinity.save_pretrained(model, tmp_path)
    ours = {k: v.cpu() for k, v in model.state_dict().items()}
    transformers = __import__("transformers")
    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    for name, value in ours.items():
        assert torch.equal(saved[name].to(value.dtype), value), name
    other, _opt = offloaded(3)
    infinity.load_pretrained(other, tmp_path)
    assert torch.equal(other(input_ids=ids).logits.cpu(), model(input_ids=ids).logits.cpu())


def test_each_device_update_stays_within_the_scratch_the_plan_reserves():
    """The fence's allocator counts every temporary: the peak of each optimizer's update on
    the device, per state format, over the views is at most ``device_step_scratch``."""
    from infinity.devices.fence import load
    from infinity.optim.chunk_optimizer import StepViews
    from infinity.optim.cpu_adam import ADAM, AdamHyperParams
    from infinity.optim.device_state import DEVICE_STEP_ELEMS
    from infinity.optim.lion import LION, LionHyperParams
    from infinity.optim.sgd import SGD, SGDHyperParams

    native = load()
    n = 2 * DEVICE_STEP_ELEMS + 100
    adam = AdamHyperParams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
    lion = LionHyperParams(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
    sgd = SGDHyperParams(
        lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False
    )
    cases = [(ADAM, adam), (LION, lion), (SGD, sgd)]
    for optimizer, hyper in cases:
        for fmt in optimizer.state_dtypes:
            units = optimizer.with_state_dtype(fmt)
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[fmt]
            state = {s: torch.zeros(n, dtype=dtype, device=FENCE) for s in units.state_slots}
            blocks = -(-n // 256) if fmt == "int8" else 0
            views = StepViews(
                torch.randn(n).to(FENCE),
                torch.randn(n).to(torch.bfloat16).to(FENCE),
                state,
                torch.empty(n, dtype=torch.bfloat16, device=FENCE),
                scales={s: torch.zeros(blocks, device=FENCE) for s in units.state_slots},
                rounding=(3, 0),
            )
            before = native.memory_allocated()
            native.reset_peak_memory_stats()
            units.step(views, hyper, step=2, grad_scale=0.5)
            peak = native.max_memory_allocated() - before
            assert 0 < peak <= units.device_step_scratch(n, FENCE), (units.name, fmt, peak)
