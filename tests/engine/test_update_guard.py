"""A chunk whose update trails ``optimizer.step()`` cannot be read around the engine:
the chunk manager raises instead of handing out the values from before the step,
while every engine entry point still runs the update first (checked against torch)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import batches, global_rel_error, gpt_loss, nvme_pair

from infinity.chunks.homes import Kind
from infinity.chunks.update_state import StaleRead, UpdateState
from infinity.offload import engine_of

TOL = 1e-5


def test_a_trailing_chunk_raises_on_a_bypassing_read_and_the_engine_settles_it(tmp_path):
    model, opt, ref, ref_opt = nvme_pair(tmp_path)
    engine = engine_of(model)
    for m, o in ((model, opt), (ref, ref_opt)):
        gpt_loss(m, batches(1)[0]).backward()
        o.step()
    trailing = [w.chunk for w in engine.trailing]
    assert trailing, "nothing was queued: the optimizer states are not on NVMe"
    chunk = trailing[-1]
    assert engine.manager.updates[chunk] is UpdateState.TRAILING
    for kind in (Kind.PARAM, Kind.OPTIM):
        with pytest.raises(StaleRead, match=f"chunk {chunk} .*TRAILING"):
            engine.manager.open_host((kind, chunk), writable=False)
    with pytest.raises(StaleRead, match=f"chunk {chunk} "):
        engine.manager.fetch_param(chunk)
    # gradients are not changed by the update: reading them stays allowed
    _region, copy = engine.manager.open_host((Kind.GRAD, chunk), writable=False)
    engine.manager.close_host(copy, modified=False)
    # state_dict() settles the step first: the torch values, and nothing is queued
    assert global_rel_error(model, ref) < TOL
    assert engine.manager.updates.count(UpdateState.IDLE) == engine.layout.num_chunks
    _region, copy = engine.manager.open_host((Kind.PARAM, chunk), writable=False)
    engine.manager.close_host(copy, modified=False)
    with torch.no_grad():
        torch.testing.assert_close(model(batches(1)[0][0]), ref(batches(1)[0][0]))
