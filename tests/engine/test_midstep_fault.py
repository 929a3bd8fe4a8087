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
