"""CPUAdam and kernels.adam_step against torch.optim.AdamW / Adam (foreach=False)."""

from __future__ import annotations

import pytest
import torch
from adam_reference import assert_rel_close, torch_reference

from infinity.optim import CPUAdam, kernels

SIZES = [1, 7, 1023, 2**20 + 3]
STEPS = 50


def _grads(step: int) -> list[torch.Tensor]:
    """The gradients of one step, regenerated on demand (no 50-step copy in memory)."""
    gen = torch.Generator().manual_seed(1000 + step)
    # NOTE: gradients of very different scales in different steps make the
    # bias corrections and eps matter, not just the sign of the update.
    scale = 10.0 ** (step % 5 - 3)
    return [torch.randn(n, generator=gen) * scale for n in SIZES]


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_cpu_adam_matches_torch_over_50_steps(adamw: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    params0 = [torch.randn(n, generator=gen) for n in SIZES]
    # Two groups with different lr and weight decay, and an LR that changes every step.
    groups = [
        {"params": [0, 2], "lr_scale": 1.0, "weight_decay": 0.1},
        {"params": [1, 3], "lr_scale": 0.3, "weight_decay": 0.0},
    ]
    lr_per_step = [1e-2 * (1.0 - step / STEPS) + 1e-4 for step in range(STEPS)]
    hyper = {"betas": (0.9, 0.99), "eps": 1e-8}
    expected, ref_opt = torch_reference(
        params0, _grads, adamw=adamw, groups=groups, lr_per_step=lr_per_step, **hyper
    )

    params = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = CPUAdam(
        [{**g, "params": [params[i] for i in g["params"]]} for g in groups], adamw=adamw, **hyper
    )
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_per_step[step] * group["lr_scale"]
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()
    for p, e in zip(params, expected, strict=True):
        assert_rel_close(p.detach(), e)
    # the moments and the step count are torch's too
    for p, e in zip(params, expected, strict=True):
        ours, theirs = opt.state[p], ref_opt.state[e]
        assert_rel_close(ours["exp_avg"], theirs["exp_avg"])
        assert_rel_close(ours["exp_avg_sq"], theirs["exp_avg_sq"])
        assert ours["step"].dtype == theirs["step"].dtype and ours["step"].item() == STEPS


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.0)], ids=["default", "beta1<0.5,beta2=0"])
def test_adam_step_matches_torch(adamw: bool, betas: tuple[float, float]) -> None:
    # beta1 < 0.5 takes the other branch of torch's lerp (weight >= 0.5).
    n = 4099
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(n, generator=gen)
    grads = [[torch.randn(n, generator=gen)] for _ in range(20)]
    hyper = {"lr": 3e-3, "betas": betas, "eps": 1e-6, "weight_decay": 0.05}
    (expected,), _ = torch_reference([p0], grads, adamw=adamw, **hyper)

    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, (g,) in enumerate(grads, start=1):
        kernels.adam_step(
            p, g, m, v, step=step, lr=3e-3, beta1=betas[0], beta2=betas[1], eps=1e-6,
            weight_decay=0.05, adamw=adamw,
        )  # fmt: skip
    assert_rel_close(p, expected)


@pytest.mark.parametrize("grad_scale", [0.25, 1.0 / 65536.0, 3.7])
def test_grad_scale_equals_torch_on_scaled_grads(grad_scale: float) -> None:
    n = 2049
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    raw = [[torch.randn(n, generator=gen) * 100.0] for _ in range(10)]
    scaled = [[g * grad_scale for g in gs] for gs in raw]
    (expected,), _ = torch_reference([p0], scaled, adamw=True, lr=1e-2, weight_decay=0.01)

    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, (g,) in enumerate(raw, start=1):
        kernels.adam_step(
            p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.01, grad_scale=grad_scale,
        )  # fmt: skip
    assert_rel_close(p, expected)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_nan_and_inf_gradients_propagate_like_torch(adamw: bool) -> None:
    n = 1000
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(n, generator=gen)
    grads = []
    for step in range(6):
        g = torch.randn(n, generator=gen)
        g[step * 7 : step * 7 + 3] = float("nan")
        g[500 + step * 5] = float("inf")
        g[600 + step * 5] = float("-inf")
        grads.append([g])
    # a parameter that is already NaN or inf
    p0[900], p0[901] = float("nan"), float("inf")
    (expected,), _ = torch_reference([p0], grads, adamw=adamw, lr=1e-2, weight_decay=0.1)
    assert expected.isnan().any() and expected.isfinite().any()

    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, (g,) in enumerate(grads, start=1):
        kernels.adam_step(
            p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.1, adamw=adamw,
        )  # fmt: skip
    assert_rel_close(p, expected)


def test_parameters_without_grad_are_skipped() -> None:
    a = torch.nn.Parameter(torch.ones(5))
    b = torch.nn.Parameter(torch.ones(5))
    opt = CPUAdam([a, b], lr=0.1)
    a.grad = torch.ones(5)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(5)) and len(opt.state[b]) == 0
    assert not torch.equal(a.detach(), torch.ones(5))


def test_non_contiguous_and_channels_last_parameters_match_torch() -> None:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(4, 3, 5, 6, generator=gen)
    shapes_make = [
        lambda t: t.contiguous(memory_format=torch.channels_last),  # dense, permuted
        lambda t: t[:, :, ::2, :].clone().transpose(0, 3),  # dense, transposed
        lambda t: t[:, :, ::2, :],  # a view with gaps
    ]
    for make in shapes_make:
        p0 = make(base.clone())
        grads = [[torch.randn(p0.shape, generator=gen)] for _ in range(5)]
        (expected,), _ = torch_reference([p0], grads, adamw=True, lr=1e-2, weight_decay=0.1)
        p = torch.nn.Parameter(make(base.clone()))
        opt = CPUAdam([p], lr=1e-2, weight_decay=0.1)
        for (g,) in grads:
            p.grad = g.clone()
            opt.step()
        assert_rel_close(p.detach(), expected)


def test_closure_is_called_with_grad_enabled_and_its_loss_returned() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = CPUAdam([p], lr=0.1)

    def closure() -> torch.Tensor:
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == pytest.approx(5.0)
    ref = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    ref_opt = torch.optim.AdamW([ref], lr=0.1, foreach=False)  # both at their defaults
    ref.grad = 2 * ref.detach()
    ref_opt.step()
    assert_rel_close(p.detach(), ref.detach())


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_defaults_are_torchs_so_a_swap_changes_nothing(adamw: bool) -> None:
    """Constructed with nothing but the parameters (issue 28: weight_decay was 0.0
    where AdamW's is 0.01), CPUAdam trains exactly like torch's optimizer."""
    g = torch.Generator().manual_seed(3)
    ours = torch.nn.Parameter(torch.randn(4096, generator=g) * 3)
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt = CPUAdam([ours]) if adamw else CPUAdam([ours], adamw=False)
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = ref_cls([theirs], foreach=False)
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert opt.defaults[key] == ref.defaults[key], key
    for _ in range(5):
        grad = torch.randn(4096, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    assert_rel_close(ours.detach(), theirs.detach(), 1e-5)
