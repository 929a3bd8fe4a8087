"""fp16 in the sweep's reference: torch's dynamic loss scaling around a step, and the
ranks' gradients reduced as infinity reduces them (see :func:`rank_grads`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from sweep_cases import Case

import infinity

Grads = list[torch.Tensor | None]


def rank_grads(
    case: Case,
    compute: torch.nn.Module,
    slices: Iterable[torch.Tensor],
    scale: float,
    loss_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[Grads], float]:
    """fp16 on ``case.world`` ranks: each rank's gradients of its slice's scaled loss,
    and the mean of their losses (``.grad`` is left as it was).

    NOTE: infinity reduces fp16 gradients as DeepSpeed does: the ranks' gradients are
    summed in fp16, then divided by the ranks, and the step is skipped when the sum
    holds an inf. Each rank's gradient is that of its own slice's mean loss, about
    ``world`` times the whole batch's share, so a sum overflows at a loss scale where
    one process's whole-batch gradient would not: the reference forms the same sums
    to skip the same steps.
    """
    params = list(compute.parameters())
    earlier = [p.grad for p in params]
    grads, total = [], 0.0
    for ids in slices:
        for p in params:
            p.grad = None
        ids = ids.to(case.backend)
        own = compute(input_ids=ids, labels=ids).loss if loss_of is None else loss_of(ids)
        loss = own / case.accumulation
        (loss * scale).backward()
        total += float(loss.detach()) / case.world
        grads.append([p.grad for p in params])
    for p, before in zip(params, earlier, strict=True):
        p.grad = before
    return grads, total


def added(a: Grads, b: Grads) -> Grads:
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b, strict=True)]


def add_rank_mean(compute: torch.nn.Module, ranks: list[Grads]) -> None:
    """``.grad +=`` the ranks' gradients summed in fp16, divided by the ranks."""
    summed = ranks[0]
    for grads in ranks[1:]:
        summed = added(summed, grads)
    params = list(compute.parameters())
    mean = [None if g is None else g / len(ranks) for g in summed]
    for p, value in zip(params, added([p.grad for p in params], mean), strict=True):
        p.grad = value


class Fp16Scaler:
    """What ``torch.amp.GradScaler`` does around a step, for gradients already copied to
    fp32 masters: divide them by the scale, or skip the step and halve the scale when
    one is inf or NaN (growth after 1000 good steps never comes in a case)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale or infinity.Config().initial_loss_scale

    def unscale(self, masters: list[torch.Tensor]) -> bool:
        grads = [m.grad for m in masters if m.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self.scale /= 2
            return False
        for g in grads:
            g.div_(self.scale)
        return True
