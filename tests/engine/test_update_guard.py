"""A chunk whose update trails ``optimizer.step()`` is never read stale: a read that
goes around the engine's entry points, straight to the chunk manager, runs the
update first (reading settles by construction), checked against torch; without
the update pipeline's runner the manager raises instead."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import batches, global_rel_error, gpt_loss, nvme_pair

from infinity.chunks.homes import Kind
from infinity.chunks.states import StaleRead, UpdateState
from infinity.offload import engine_of

TOL = 1e-5


def _chunk_values(engine, chunk: int) -> dict[str, torch.Tensor]:
    """The fp32 parameter values of ``chunk``'s tensors, read straight from the manager."""
    region, copy = engine.manager.open_host((Kind.PARAM, chunk), writable=False)
    try:
        flat = region.view(torch.float32)
        return {
            e.name: flat[s.offset : s.offset + s.numel].view(s.shape).clone()
            for e in engine.chunks.chunk_members[chunk]
            for s in [engine.layout.slots[e.index]]
        }
    finally:
        engine.manager.close_host(copy, modified=False)


def test_a_bypassing_read_of_a_trailing_chunk_runs_its_update_first(tmp_path):
    model, opt, ref, ref_opt = nvme_pair(tmp_path)
    engine = engine_of(model)
    for m, o in ((model, opt), (ref, ref_opt)):
        gpt_loss(m, batches(1)[0]).backward()
        o.step()
    trailing = [w.chunk for w in engine.queue.trailing]
    assert trailing, "nothing was queued: the optimizer states are not on NVMe"
    chunk = trailing[-1]
    assert engine.manager.updates[chunk] is UpdateState.TRAILING
    # gradients are not changed by the update: reading them runs nothing
    _region, copy = engine.manager.open_host((Kind.GRAD, chunk), writable=False)
    engine.manager.close_host(copy, modified=False)
    assert engine.manager.updates[chunk] is UpdateState.TRAILING
    # a parameter read straight from the manager: the update runs first
    got = _chunk_values(engine, chunk)
    assert engine.manager.updates[chunk] is UpdateState.IDLE
    want = dict(ref.named_parameters())
    for name, value in got.items():
        torch.testing.assert_close(value, want[name].detach(), rtol=TOL, atol=TOL)
    assert global_rel_error(model, ref) < TOL
    assert engine.manager.updates.count(UpdateState.IDLE) == engine.layout.num_chunks
    with torch.no_grad():
        torch.testing.assert_close(model(batches(1)[0][0]), ref(batches(1)[0][0]))


def test_without_the_pipeline_a_stale_read_raises(tmp_path):
    model, opt, _ref, _ref_opt = nvme_pair(tmp_path)
    engine = engine_of(model)
    gpt_loss(model, batches(1)[0]).backward()
    opt.step()
    chunk = [w.chunk for w in engine.queue.trailing][-1]
    runner, engine.manager.updates.runner = engine.manager.updates.runner, None
    try:
        for kind in (Kind.PARAM, Kind.OPTIM):
            with pytest.raises(StaleRead, match=f"chunk {chunk} .*TRAILING"):
                engine.manager.open_host((kind, chunk), writable=False)
        with pytest.raises(StaleRead, match=f"chunk {chunk} "):
            engine.manager.fetch_param(chunk)
    finally:
        engine.manager.updates.runner = runner
