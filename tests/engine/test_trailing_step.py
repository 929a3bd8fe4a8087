"""optimizer.step() queues NVMe-bound chunk updates; they run when the chunk is next
needed. Whatever the user does between step() and the next forward must see
exactly the values plain PyTorch has after its step.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import batches, global_rel_error, gpt_loss, nvme_pair

import infinity
from infinity.offload import engine_of

TOL = 1e-5


def _pair(tmp_path):
    """An offloaded tiny GPT whose optimizer states live on NVMe, and its torch reference."""
    return nvme_pair(tmp_path)


def _step_both(model, opt, ref, ref_opt, batch) -> None:
    for m, o in ((model, opt), (ref, ref_opt)):
        gpt_loss(m, batch).backward()
        o.step()
        o.zero_grad()


def test_step_leaves_nvme_updates_queued_and_the_forward_runs_them(tmp_path):
    model, opt, ref, ref_opt = _pair(tmp_path)
    engine = engine_of(model)
    data = batches(3)
    for batch in data:
        _step_both(model, opt, ref, ref_opt, batch)
        assert engine.queue.trailing, "nothing was queued: the optimizer states are not on NVMe"
    before = engine.queue.trailing_chunk_steps
    with torch.no_grad():
        ours = model(data[0][0])
        theirs = ref(data[0][0])
    assert engine.queue.trailing_chunk_steps > before  # the forward ran queued updates
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert not engine.queue.trailing  # every chunk was touched by the forward


def test_state_dict_right_after_step_has_the_update(tmp_path):
    model, opt, ref, ref_opt = _pair(tmp_path)
    for batch in batches(2):
        _step_both(model, opt, ref, ref_opt, batch)
    assert engine_of(model).queue.trailing
    err = global_rel_error(model, ref)  # reads model.state_dict() before any forward
    assert err < TOL, f"global relative error {err:.2e}"


def test_learning_rate_changed_after_step_applies_from_the_next_step(tmp_path):
    model, opt, ref, ref_opt = _pair(tmp_path)
    data = batches(4)
    losses, ref_losses = [], []
    for i, batch in enumerate(data):
        for m, o, out in ((model, opt, losses), (ref, ref_opt, ref_losses)):
            loss = gpt_loss(m, batch)
            loss.backward()
            o.step()
            o.zero_grad()
            # a scheduler: the queued update must keep the rate of its own step
            for group in o.param_groups:
                group["lr"] = 1e-3 * (0.5 ** (i + 1))
            out.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    err = global_rel_error(model, ref)
    assert err < TOL, f"global relative error {err:.2e}"


def test_two_steps_without_a_forward_apply_twice_like_torch(tmp_path):
    model, opt, ref, ref_opt = _pair(tmp_path)
    batch = batches(1)[0]
    for m, o in ((model, opt), (ref, ref_opt)):
        gpt_loss(m, batch).backward()
        o.step()
        o.step()  # the same gradients again (torch does not zero them)
        o.zero_grad()
    err = global_rel_error(model, ref)
    assert err < TOL, f"global relative error {err:.2e}"


def test_checkpoint_saved_right_after_step_resumes_the_reference_curve(tmp_path):
    model, opt, ref, ref_opt = _pair(tmp_path / "a")
    data = batches(4)
    for batch in data[:2]:
        _step_both(model, opt, ref, ref_opt, batch)
    assert engine_of(model).queue.trailing
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()
    fresh, fresh_opt, _, _ = _pair(tmp_path / "b")
    infinity.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    for batch in data[2:]:
        _step_both(fresh, fresh_opt, ref, ref_opt, batch)
    err = global_rel_error(fresh, ref)
    assert err < TOL, f"global relative error {err:.2e}"


def test_gradients_read_after_step_are_the_step_s_gradients(tmp_path):
    model, opt, ref, ref_opt = _pair(tmp_path)
    batch = batches(1)[0]
    for m in (model, ref):
        gpt_loss(m, batch).backward()
    opt.step()
    ref_opt.step()
    grads = infinity.gradients(model)  # before zero_grad, as torch keeps them
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)


def _adafactor_pair(tmp_path):
    """A tiny GPT with Adafactor's states (per-tensor, made at a tensor's first update) on
    NVMe, and its torch reference: ``(model, optimizer, ref, ref_optimizer)``."""
    import copy

    from engine_helpers import offload_on_nvme, tiny_gpt

    from infinity.optim import CPUAdafactor

    model = tiny_gpt()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adafactor(ref.parameters(), lr=1e-2, foreach=False)
    model = offload_on_nvme(model, tmp_path, host_factor=2.0)
    return model, CPUAdafactor(model.parameters(), lr=1e-2), ref, ref_opt


def test_first_updates_run_inside_an_inference_mode_evaluation_train_on_like_torch(tmp_path):
    """Sweep seed 6161: the first update of NVMe-homed chunks, queued by step(), runs in
    the next forward; under ``torch.inference_mode()`` the per-tensor states it makes
    (Adafactor's factored moments) were inference tensors, and the next step could not
    update them in place."""
    model, opt, ref, ref_opt = _adafactor_pair(tmp_path)
    engine = engine_of(model)
    data = batches(3)
    _step_both(model, opt, ref, ref_opt, data[0])
    assert engine.queue.trailing, "nothing was queued: the states are not on NVMe"
    before = engine.queue.trailing_chunk_steps
    with torch.inference_mode():
        model(data[0][0])
    assert engine.queue.trailing_chunk_steps > before  # the evaluation ran them
    # the next updates run outside that mode (in the training forward after step 2)
    for batch in data[1:]:
        _step_both(model, opt, ref, ref_opt, batch)
    err = global_rel_error(model, ref)
    assert err < TOL, f"global relative error {err:.2e}"


def test_updates_run_inside_an_autocast_forward_compute_as_outside_it(tmp_path):
    """A queued update runs in the next forward, which may be under the user's
    ``torch.autocast``: Adafactor's factored estimate is a matmul, which autocast
    would run in bf16. The updates must compute as ``optimizer.step()`` does."""
    model, opt, ref, ref_opt = _adafactor_pair(tmp_path)
    engine = engine_of(model)
    for batch in batches(3):
        _step_both(model, opt, ref, ref_opt, batch)
        before = engine.queue.trailing_chunk_steps
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(batch[0])
        assert engine.queue.trailing_chunk_steps > before  # the evaluation ran them
    err = global_rel_error(model, ref)
    assert err < TOL, f"global relative error {err:.2e}"
