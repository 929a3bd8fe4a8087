"""``torch.compile`` of an offloaded model trains as the same model does in eager mode.

The engine's hooks are opaque to Dynamo (graph breaks); the compute between
them is compiled. Compiled code may round differently from eager code (fused
kernels, other graph boundaries), so the tolerance is measured in the same test: the
compiled-vs-eager difference of the *plain* model (no offload), times a margin
for the different graph boundaries. After the first step, no frame may be
compiled again (parameters are rebound by the hooks at every call; guards must
still hold).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from engine_helpers import (
    batches,
    config,
    global_rel_error,
    param_bytes,
    tiny_gpt,
    tiny_llama,
)
from torch._dynamo.utils import counters

import infinity
from infinity.optim import CPUAdam

STEPS = 3
# The offloaded graphs end at every module owning parameters, so they fuse
# less than the plain model's and round in other places: allow an order of
# magnitude over the plain model's compiled-vs-eager noise (Inductor, Llama:
# 2.2e-8 measured; offloaded 3.6e-8), but never less than a few float32 ulps
# of relative error (aot_eager, Llama: plain 0, offloaded 2.6e-8 measured).
MARGIN = 10.0
FLOOR = 8 * torch.finfo(torch.float32).eps


def _llama_loss(model, batch) -> torch.Tensor:
    x, _ = batch
    return model(input_ids=x, labels=x).loss


def _gpt_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return model(x, y)


def _compiled_so_far() -> tuple[int, int]:
    """(frames Dynamo compiled, graphs it produced) in this process since the reset."""
    return counters["frames"]["total"], counters["stats"]["unique_graphs"]


def _train(model, opt, data, loss_fn, backend: str | None) -> list[float]:
    """``STEPS`` steps, compiled with ``backend`` (eager if ``None``); for a
    compiled model, check that the first step compiles and no later one does."""
    compiled = backend is not None
    run = torch.compile(model, backend=backend) if compiled else model
    losses, seen = [], [_compiled_so_far()]
    for batch in data:
        loss = loss_fn(run, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        seen.append(_compiled_so_far())
    if compiled:
        assert seen[1][1] > seen[0][1], "the first step compiled no graph"
        assert seen[-1] == seen[1], f"compiled again after the first step: {seen}"
    return losses


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "arch,backend",
    [
        ("gpt", "aot_eager"),
        ("llama", "aot_eager"),
        # Inductor's code generation takes about a minute on two cores.
        pytest.param("llama", "inductor", marks=pytest.mark.slow),
    ],
)
def test_compiled_offloaded_training_equals_eager(arch, backend):
    """Dynamo and AOTAutograd (``aot_eager``: graph breaks, guards, saved tensors
    of compiled graphs) and Inductor's kernels (``inductor``) around the hooks."""
    build: Callable[[], torch.nn.Module]
    if arch == "llama":
        build, loss_fn, chunk = tiny_llama, _llama_loss, "8KiB"
        data = batches(STEPS, seq=16)
    else:
        build, loss_fn, chunk = tiny_gpt, _gpt_loss, "24KiB"
        data = batches(STEPS)
    base = build()
    budget = param_bytes(base, 4) * 6 // 10  # the device holds 60% of the parameters

    def plain(backend: str | None):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        return model, _train(model, opt, data, loss_fn, backend)

    def offloaded(backend: str | None):
        model = infinity.offload(
            copy.deepcopy(base), config(device_memory=budget, chunk_size=chunk)
        )
        opt = CPUAdam(model.parameters(), lr=1e-3)
        return model, _train(model, opt, data, loss_fn, backend)

    plain_eager, plain_eager_losses = plain(None)
    plain_compiled, plain_compiled_losses = plain(backend)
    noise = global_rel_error(plain_compiled, plain_eager)
    assert plain_compiled_losses == pytest.approx(plain_eager_losses, rel=1e-5)

    eager, eager_losses = offloaded(None)
    compiled, compiled_losses = offloaded(backend)
    assert eager.state_dict().keys() == compiled.state_dict().keys()
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    err = global_rel_error(compiled, eager)
    tol = max(MARGIN * noise, FLOOR)
    assert err <= tol, f"compiled vs eager offloaded: {err:.2e} > {tol:.2e} (plain: {noise:.2e})"


def test_infinity_takes_the_compiled_wrapper_for_the_offloaded_model(tmp_path):
    """``torch.compile(model)`` returns a new module holding the model: ``stats``,
    ``save_checkpoint`` and ``load_checkpoint`` take it as the model it wraps (they said
    it was not offloaded), and the state saved through it loads into another model."""
    data = batches(STEPS, seq=16)
    cfg = config(device_memory=param_bytes(tiny_llama(), 4) * 6 // 10, chunk_size="8KiB")
    model = infinity.offload(tiny_llama(), cfg)
    opt = CPUAdam(model.parameters(), lr=1e-3)
    run = torch.compile(model, backend="aot_eager")
    for batch in data[:2]:
        _llama_loss(run, batch).backward()
        opt.step()
        opt.zero_grad()
    assert infinity.stats(run)["placement"] == infinity.stats(model)["placement"]
    infinity.save_checkpoint(tmp_path / "ck", run, opt)
    other = infinity.offload(tiny_llama(seed=1), cfg)
    other_opt = CPUAdam(other.parameters(), lr=1e-3)
    infinity.load_checkpoint(tmp_path / "ck", torch.compile(other, backend="aot_eager"), other_opt)
    ours, theirs = other.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    # and both train on alike (the optimizer's state came along)
    for m, o in ((model, opt), (other, other_opt)):
        _llama_loss(m, data[2]).backward()
        o.step()
    assert global_rel_error(other, model) == 0.0
