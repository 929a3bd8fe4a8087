"""``model.to(...)`` on an offloaded model: a no-op to where it is, an error elsewhere.

``transformers.Trainer`` under ``torchrun`` moves the model to
``device(type='cpu', index=0)``; plain ``Tensor.to`` would copy every parameter
placeholder into a full tensor. The reference for "unchanged" is the model's
own state before the call, read back through ``state_dict()``.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import batches, config, gpt_loss, tiny_gpt, tiny_llama

import infinity
from infinity.offload import engine_of
from infinity.runtime.params import ModelChangedError, is_placeholder


def test_moves_to_its_own_device_leave_the_model_as_it_is():
    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    try:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ptrs = [p.untyped_storage().data_ptr() for p in model.parameters()]
        for target in ("cpu", torch.device("cpu", 0), torch.float32):
            assert model.to(target) is model
        assert model.to(device="cpu", dtype=torch.float32) is model
        assert all(is_placeholder(p.data) for p in model.parameters())
        assert ptrs == [p.untyped_storage().data_ptr() for p in model.parameters()]
        after = model.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in before.items())
        gpt_loss(model, batches(1)[0]).backward()  # still trains: nothing was changed
    finally:
        engine_of(model).close()


@pytest.mark.parametrize("target", [torch.float16, "meta"])
def test_other_moves_are_refused_with_the_way_to_choose_them(target):
    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    try:
        expected = r"model\.to\(.*infinity\.Config\(device=\.\.\., dtype"
        # before the layout and after it: placeholders both times
        for lay_out in (False, True):
            if lay_out:
                engine_of(model).lay_out()
            with pytest.raises(ValueError, match=expected):
                model.to(target)
            assert all(is_placeholder(p.data) for p in model.parameters())
    finally:
        engine_of(model).close()


def test_removing_the_hooks_gives_the_model_its_own_to_back():
    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    engine = engine_of(model)
    assert "to" in model.__dict__
    engine.hooks.remove()
    engine.close()
    assert "to" not in model.__dict__  # the class's Module.to again


def test_a_deep_copy_is_refused_saying_how_to_get_a_second_model():
    """An EMA (``AveragedModel``) or a reference model deep-copied from an offloaded one
    held NaN placeholders (and its forward drove the original's engine)."""
    import copy

    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    for make_copy in (copy.deepcopy, torch.optim.swa_utils.AveragedModel):
        with pytest.raises(TypeError, match="load_state_dict"):
            make_copy(model)
    # the engine's own shape-only copy (the activation estimate of a first forward) works,
    # and the model trains as before
    batch = batches(1)[0]
    gpt_loss(model, batch).backward()
    assert "__deepcopy__" in model.__dict__
    engine = engine_of(model)
    engine.hooks.remove()
    engine.close()
    assert "__deepcopy__" not in model.__dict__  # copy.deepcopy copies a plain module again
    copy.deepcopy(model)


def test_a_grad_scaler_is_told_that_the_engine_scales_the_loss():
    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    opt = infinity.optim.CPUAdam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(gpt_loss(model, batches(1)[0])).backward()
    with pytest.raises(RuntimeError, match=r"scale_loss\(loss\)"):
        scaler.step(opt)


@pytest.mark.parametrize("laid_out", [False, True], ids=["before-layout", "after-layout"])
@pytest.mark.parametrize(
    "write",
    [
        lambda p: p.fill_(0.0),
        lambda p: torch.nn.init.zeros_(p),
        lambda p: torch.nn.init.constant_(p, 0.5),
    ],
    ids=["fill_", "init.zeros_", "init.constant_"],
)
def test_a_write_in_place_after_offload_is_refused_not_dropped(laid_out, write):
    """Constant fills pass on a placeholder (one NaN cell expanded): the write reached no
    weight and was dropped silently, and it overwrote the NaN every placeholder shows."""
    before = tiny_gpt().state_dict()  # the same weights, never offloaded (a read lays out)
    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    if laid_out:
        infinity.optim.CPUAdam(model.parameters(), lr=1e-3)
    target = model.blocks[0].attn.qkv.bias
    with torch.no_grad():
        write(target)
    batch = batches(1)[0]
    with pytest.raises(ModelChangedError, match=r"blocks\.0\.attn\.qkv\.bias.*written in place"):
        if laid_out:
            gpt_loss(model, batch)
        else:
            infinity.optim.CPUAdam(model.parameters(), lr=1e-3)  # the lay-out checks first
    assert torch.isnan(target.data).all()  # every placeholder shows NaN again
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the chunks: untouched
    gpt_loss(model, batch).backward()  # once said, the model trains on


def test_a_conversion_before_the_layout_is_refused_not_dropped():
    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    model.blocks[0].half()  # a submodule's conversion: past the model's own guards
    with pytest.raises(ModelChangedError, match="float16"):
        infinity.optim.CPUAdam(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("convert", ["half", "bfloat16", "double"])
def test_converting_the_whole_model_is_refused_before_it_copies_anything(convert):
    """``model.half()`` runs ``Module._apply`` (past the guard of ``model.to``), which
    turned every placeholder into a full tensor: a whole copy of the model before the next
    forward refused it. No-ops (``float()`` of an fp32 model, ``share_memory()``) pass."""
    before = tiny_gpt().state_dict()
    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    with pytest.raises(ValueError, match="would make a full copy of every one"):
        getattr(model, convert)()
    assert all(p.dtype == torch.float32 and is_placeholder(p.data) for p in model.parameters())
    assert model.float() is model and model.share_memory() is model
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    gpt_loss(model, batches(1)[0]).backward()


def test_a_parameter_replaced_after_offload_is_refused_even_at_the_same_count():
    """A replaced parameter (``resize_token_embeddings`` swaps the module) kept the count,
    and trained in RAM beside the chunks, unoffloaded."""
    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    gpt_loss(model, batches(1)[0]).backward()
    model.wpe = torch.nn.Parameter(torch.zeros(model.wpe.shape))
    with pytest.raises(ModelChangedError, match="'wpe' was replaced"):
        gpt_loss(model, batches(1)[0])


@pytest.mark.parametrize(
    "make, ours",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "CPUAdam with"),
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False), r"CPUAdam\(adamw=False\)"),
        (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), "CPUSGD"),
    ],
    ids=["AdamW", "Adam", "SGD"],
)
def test_a_torch_optimizer_over_offloaded_parameters_is_refused_naming_ours(make, ours):
    """torch's own optimizers wrote into the placeholders at their first step and failed in
    torch ("more than one element of the written-to tensor refers to a single memory
    location"). Ordinary tensors beside the model, in another optimizer, still step."""
    model = infinity.offload(tiny_gpt(), config(dtype="fp32"))
    before = tiny_gpt().state_dict()
    extra = torch.nn.Parameter(torch.ones(3))
    side = make([extra])
    optimizer = make(model.parameters())
    gpt_loss(model, batches(1)[0]).backward()
    (extra * 2).sum().backward()
    with pytest.raises(TypeError, match=ours):
        optimizer.step()
    side.step()
    assert not torch.equal(extra.detach(), torch.ones(3))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_torch_optimizer_steps_a_prompt_beside_a_frozen_offloaded_model():
    """Prompt tuning with torch's AdamW over the prompt and ``model.parameters()``: the
    frozen offloaded model has no gradient (torch skips it), the prompt steps as in
    plain torch."""
    reference = tiny_llama().requires_grad_(False)
    model = infinity.offload(tiny_llama().requires_grad_(False), config(dtype="fp32"))
    prompts = []
    for m in (model, reference):
        torch.manual_seed(3)
        prompt = torch.nn.Parameter(torch.randn(1, 4, 32) * 0.02)
        optimizer = torch.optim.AdamW([prompt, *m.parameters()], lr=1e-2)
        for ids, _ in batches(2):
            embeds = reference.get_input_embeddings()(ids)  # the same frozen table
            embeds = torch.cat([prompt.expand(len(ids), -1, -1), embeds], dim=1)
            m(inputs_embeds=embeds, labels=torch.cat([ids[:, :4], ids], dim=1)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        prompts.append(prompt)
    assert not torch.equal(prompts[1], prompts[0] * 0)
    torch.testing.assert_close(prompts[0], prompts[1])
