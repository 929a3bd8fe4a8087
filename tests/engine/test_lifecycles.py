"""The engine's small lifecycles (a tensor's gradient, the backward pass, the fp16 loss
scale): every legal path, every illegal move raises, and on a real model the states
follow what torch reports (``param.grad is not None``, a backward running or not)."""

from __future__ import annotations

import itertools

import pytest
from engine_helpers import batches, config, gpt_loss, tiny_gpt

import infinity
from infinity.chunks.states import IllegalTransition
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.runtime.model_chunks import (
    LEGAL_BACKWARD,
    LEGAL_LOSS_SCALE,
    LEGAL_TENSOR_GRAD,
    Backward,
    Lifecycle,
    LossScale,
    TensorGrad,
    TensorGrads,
)

MACHINES = [
    (Backward, LEGAL_BACKWARD),
    (LossScale, LEGAL_LOSS_SCALE),
    (TensorGrad, LEGAL_TENSOR_GRAD),
]


def _cases(legal_only: bool) -> list[tuple[type, object, object]]:
    out = []
    for enum_type, legal in MACHINES:
        for old, new in itertools.product(enum_type, enum_type):
            if ((old, new) in legal) == legal_only:
                out.append((enum_type, old, new))
    return out


def _name(value: object) -> str:
    return getattr(value, "name", getattr(value, "__name__", str(value)))


@pytest.mark.parametrize(("machine", "old", "new"), _cases(True), ids=_name)
def test_every_legal_transition_is_allowed(machine, old, new):
    legal = dict(MACHINES)[machine]
    life = Lifecycle(old, legal, "thing")
    life.move(new)
    assert life.state is new


@pytest.mark.parametrize(("machine", "old", "new"), _cases(False), ids=_name)
def test_every_illegal_transition_raises_naming_both_states(machine, old, new):
    legal = dict(MACHINES)[machine]
    life = Lifecycle(old, legal, "thing")
    with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
        life.move(new)
    assert life.state is old  # nothing changed


def test_tensor_grads_count_held_gradients_and_refuse_dropping_what_is_not_held():
    grads = TensorGrads(3)
    assert not grads.any and [grads[i] for i in range(3)] == [False] * 3
    grads.received(1)
    grads.received(1)  # accumulation: a second micro-batch
    grads.received(2)
    assert grads.any and grads.held == 2 and [grads[i] for i in range(3)] == [False, True, True]
    grads.dropped(1)
    assert grads.held == 1 and not grads[1]
    with pytest.raises(IllegalTransition, match="gradient of tensor 0: NONE -> NONE"):
        grads.dropped(0)
    grads.drop_all()
    assert not grads.any and grads.held == 0


def test_the_engine_states_follow_backward_zero_grad_and_the_loss_scale():
    model = tiny_gpt()
    infinity.offload(model, config(dtype="fp16"))
    engine = engine_of(model)
    opt = CPUAdam(model.parameters(), lr=1e-3)
    seen_running = []
    last = list(model.parameters())[-1]
    last.register_hook(lambda g: seen_running.append(engine.sink.running))
    opt.scale_loss(gpt_loss(model, batches(1)[0])).backward()
    assert seen_running == [True] and not engine.sink.running
    assert engine.pipeline.loss_scale.state is LossScale.SCALED
    trainable = [p for p in model.parameters() if p.requires_grad]
    index = {id(e.param): e.index for e in engine.registry.entries}
    # What torch shows (a sentinel in .grad) is what the states say.
    assert all(engine.chunks.has_grad[index[id(p)]] == (p.grad is not None) for p in trainable)
    assert engine.chunks.has_grad.held == len(trainable)
    opt.step()
    assert engine.pipeline.loss_scale.state is LossScale.UNSCALED
    opt.zero_grad()
    opt.step()  # collects the zeroed sentinels: nothing held any more
    assert not engine.chunks.has_grad.any
    engine.close()
