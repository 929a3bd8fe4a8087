"""Several optimizers over parts of one offloaded model.

Each steps its own tensors, as torch's do: two CPUAdam over a GPT's blocks and
over the rest, with other hyper-parameters, match two ``torch.optim.AdamW`` on a
deep copy (a clip over every parameter between). Where one
step must see every parameter (``overlap_optimizer``: the updates run during
backward with the last optimizer's groups and consume whole chunks' gradients;
fp16: one overflow check and scale update a step), a step by another optimizer
than the last constructed is refused naming both. Before, the overlapped case
failed saying to call ``zero_grad()`` after ``step()`` (which the loop did), and
fp16 said the loss was not scaled (it was).
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import batches, global_rel_error, offload_on_nvme, tiny_gpt

from infinity.optim import CPUAdam


def _parts(model: torch.nn.Module) -> tuple[list, list]:
    named = list(model.named_parameters())
    return [p for n, p in named if "blocks" in n], [p for n, p in named if "blocks" not in n]


def test_two_optimizers_over_parts_train_as_torch(tmp_path):
    base = tiny_gpt()
    ref = copy.deepcopy(base)
    model = offload_on_nvme(base, tmp_path, 1.0)
    ours = [
        CPUAdam(_parts(model)[0], lr=1e-3, weight_decay=0.1),
        CPUAdam(_parts(model)[1], lr=1e-2, weight_decay=0.0),
    ]
    theirs = [
        torch.optim.AdamW(_parts(ref)[0], lr=1e-3, weight_decay=0.1, foreach=False),
        torch.optim.AdamW(_parts(ref)[1], lr=1e-2, weight_decay=0.0, foreach=False),
    ]
    for x, y in batches(4):
        for m, opts in ((model, ours), (ref, theirs)):
            m(x, y).backward()
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.05)
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad()
    assert global_rel_error(model, ref) < 1e-6


@pytest.mark.parametrize("setting", ["overlap_optimizer", "fp16"])
def test_where_one_step_sees_the_whole_model_another_optimizer_is_refused(tmp_path, setting):
    overrides = {"overlap_optimizer": True} if setting == "overlap_optimizer" else {"dtype": "fp16"}
    model = offload_on_nvme(tiny_gpt(), tmp_path, 1.5, **overrides)
    blocks, rest = _parts(model)
    replaced = CPUAdam(model.parameters(), lr=1e-3)
    first, last = CPUAdam(blocks, lr=1e-3), CPUAdam(rest, lr=1e-2)
    x, y = batches(1)[0]
    last.scale_loss(model(x, y)).backward()
    for stepper in (first, replaced):
        held = len(list(stepper.param_groups[0]["params"]))
        with pytest.raises(RuntimeError, match=rf"this CPUAdam \(over {held} of"):
            stepper.step()
    with pytest.raises(RuntimeError, match=rf"over it last \(CPUAdam over {len(rest)}\)"):
        first.step()
    last.step()  # the last one steps as before
