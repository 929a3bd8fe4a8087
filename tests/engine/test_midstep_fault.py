"""An I/O error inside the optimizer step (after backward, with some chunks updated and
others not): the step raises ``NVMeIOError``, every later call refuses, and the
checkpoint saved before loads into a fresh model that then trains exactly like a
run that never failed (and like ``torch.optim.AdamW``)."""

from __future__ import annotations

import errno

import pytest
import torch
from engine_helpers import (
    batches,
    global_rel_error,
    gpt_loss,
    nvme_pair,
    resume_equals_uninterrupted,
    train,
)

import infinity
from infinity.offload import engine_of


@pytest.fixture(autouse=True)
def _one_compute_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_io_error_in_the_step_fails_the_engine_and_the_checkpoint_resumes_exactly(tmp_path):
    data = batches(4)
    model, opt, ref, ref_opt = nvme_pair(tmp_path / "a", host_factor=1.0)
    train(model, opt, data[:2])
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)

    gpt_loss(model, data[2]).backward()  # backward completes, fault-free
    engine = engine_of(model)
    engine.synchronize()
    # NOTE: the second request of the step fails: the first chunk's update may
    # already be on its way home while the others have not started.
    engine.swap.engine.inject_fault(2, errno.EIO, per="request")
    with pytest.raises(infinity.NVMeIOError) as first:
        opt.step()
        engine.synchronize()  # in case the failed request was still in flight
    assert first.value.errno == errno.EIO
    for call in (lambda: model(*data[3]), opt.step, model.state_dict, engine.synchronize):
        with pytest.raises(infinity.NVMeIOError, match="refuses to run"):
            call()
    engine.close()

    resumed = resume_equals_uninterrupted(tmp_path, tmp_path / "ckpt", data, start=2)
    train(ref, ref_opt, data)
    assert global_rel_error(resumed, ref) < 1e-5
    engine_of(resumed).close()


class _KernelFailsAt:
    """The engine's chunk optimizer, raising at its ``fail_at``-th kernel call."""

    def __init__(self, inner, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, views, hyper, *, step, grad_scale):
        self.calls += 1
        if self.calls == self.fail_at:
            raise MemoryError("injected: the kernel could not allocate")
        self.inner.step(views, hyper, step=step, grad_scale=grad_scale)


def test_an_error_inside_an_update_fails_the_engine_naming_it_and_the_checkpoint_resumes(
    tmp_path,
):
    data = batches(4)
    model, opt, ref, ref_opt = nvme_pair(tmp_path / "a", host_factor=1.0)
    train(model, opt, data[:2])
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)

    gpt_loss(model, data[2]).backward()
    engine = engine_of(model)
    # The second chunk's update fails after the first one's has been written.
    engine.chunks.chunk_optimizer = _KernelFailsAt(engine.chunks.chunk_optimizer, fail_at=2)
    with pytest.raises(MemoryError, match="injected"):
        opt.step()
        engine.synchronize()  # the updates may trail the step: they run here
    for call in (lambda: model(*data[3]), opt.step, model.state_dict, engine.synchronize):
        with pytest.raises(RuntimeError, match=r"stopped after an error.*MemoryError: injected"):
            call()
    engine.close()  # releases quietly: the error was raised already

    resumed = resume_equals_uninterrupted(tmp_path, tmp_path / "ckpt", data, start=2)
    train(ref, ref_opt, data)
    assert global_rel_error(resumed, ref) < 1e-5
    engine_of(resumed).close()
