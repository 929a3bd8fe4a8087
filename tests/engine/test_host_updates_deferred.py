"""Host-homed updates deferred into the next forward (a GPU backend's default) train
bit-identically to updates run inside ``optimizer.step()``, and do trail.

NOTE [host updates behind the forward]: the CPU backend computes on the host's
own cores, so it runs them at once; the queue's ``defer_host`` is set here by
hand to put the CUDA backend's path through the CPU tests.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import batches, config, param_bytes, tiny_gpt, train

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam

CASES = {
    "fp32": {},
    "bf16": {"dtype": "bf16"},
    "accumulation+clipping": {"accum": 2, "clip": 0.5},
    "overlapped": {"overlap_optimizer": True},
    "nvme+bf16": {"dtype": "bf16", "nvme": True},
}


def _run(tmp_path, defer: bool, case: dict, trails: list[int] | None = None, worker: bool = False):
    model = tiny_gpt(seed=3)
    pbytes = param_bytes(model, 4)
    kw: dict = {"device_memory": pbytes // 2, "chunk_size": "8KiB"}
    kw["dtype"] = case.get("dtype", "fp32")
    if "overlap_optimizer" in case:
        kw["overlap_optimizer"] = case["overlap_optimizer"]
    if case.get("nvme"):
        kw.update(host_memory=pbytes * 2, nvme_path=str(tmp_path / f"nvme-{defer}"))
    model = infinity.offload(model, config(**kw))
    engine = engine_of(model)
    engine.queue.defer_host = defer
    engine.queue.on_worker = worker  # NOTE [host updates on a worker]: a GPU's default
    opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    accum, clip = case.get("accum", 1), case.get("clip")

    def clip_grads(_step: int) -> None:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

    data = batches(6 * accum, seed=5)
    losses: list[float] = []
    for step in range(6):
        micro = data[step * accum : (step + 1) * accum]
        losses += train(model, opt, micro, accum=accum, before_step=clip_grads)
        if trails is not None:
            trails.append(len(engine.queue.trailing))
    state = model.state_dict()  # settles the last step's trailing updates
    on_worker = engine.queue.worker_chunk_steps
    engine.close()
    if trails is not None:
        trails.append(on_worker)
    return losses, state


@pytest.mark.parametrize("worker", [False, True], ids=["inline", "worker"])
@pytest.mark.parametrize("name", list(CASES))
def test_deferred_host_updates_are_bit_identical_and_trail(tmp_path, name, worker):
    case = CASES[name]
    eager_losses, eager_state = _run(tmp_path, False, case)
    trails: list[int] = []
    losses, state = _run(tmp_path, True, case, trails, worker=worker)
    on_worker = trails.pop()
    assert losses == eager_losses
    for key, value in eager_state.items():
        assert torch.equal(state[key], value), key
    if case.get("overlap_optimizer"):
        return  # every update ran during backward: nothing is left to trail
    # From the second step on (the first has no trace yet) updates are left queued
    # by optimizer.step() and run inside the next forward.
    assert min(trails[1:]) > 0, trails
    # with the worker, the host-homed ones ran there (NVMe-homed ones run here: in
    # the NVMe case every chunk has its optimizer state there)
    assert (on_worker > 0) == (worker and not case.get("nvme")), on_worker


def test_an_update_that_fails_on_the_worker_stops_the_model_and_close_frees_the_worker(
    tmp_path, monkeypatch
):
    """A kernel error on the worker is raised where the chunk is next needed, every
    later use raises naming it, and close() waits for the worker and stops it."""
    import threading

    from infinity.runtime import offloaded_step

    model = tiny_gpt(seed=3)
    kw = {"device_memory": param_bytes(model, 4) // 2, "chunk_size": "8KiB"}
    model = infinity.offload(model, config(**kw))
    engine = engine_of(model)
    opt = CPUAdam(model.parameters(), lr=3e-3)
    engine.queue.defer_host = engine.queue.on_worker = True
    data = batches(4, seed=5)
    train(model, opt, data[:1])  # the first step runs at once (no trace yet)
    train(model, opt, data[1:2])  # the second trails into the next forward

    def broken(self) -> None:
        raise ValueError("a kernel failed")

    monkeypatch.setattr(offloaded_step.OpenedChunk, "compute", broken)
    with pytest.raises(ValueError, match="a kernel failed"):
        train(model, opt, data[2:3])
    with pytest.raises(RuntimeError, match="stopped after an error inside an optimizer update"):
        train(model, opt, data[3:4])
    engine.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("infinity-update")]
