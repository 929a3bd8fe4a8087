"""Helpers of the optimizer tests: torch reference runs and exact comparisons.

Every expected value comes from torch (``torch.optim.AdamW``/``Adam`` with
``foreach=False``, or torch's own dtype conversions), never from the code under test.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# NOTE: why 1e-5 and not bitwise: torch runs each line of Adam as a separate
# tensor op, rounding after every multiply and add; its vectorised kernels may
# or may not contract a*b+c into one FMA depending on how ATen was built, and
# its scalar tails differ from its vector bodies. Our kernel uses FMA for the
# moment updates and multiplies by 1/sqrt(1-beta2^t) instead of dividing. Each
# of those differs by <= 1 ulp (6e-8 relative) per operation; over 50 steps the
# accumulated difference stays around 1e-6, so 1e-5 catches any real error
# (a wrong coefficient shows up at the 1e-3 level or above).
RTOL = 1e-5


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    """Elementwise relative error <= rtol (see the note), with NaN/inf in the same places."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), f"NaN positions differ: {int((nan_a ^ nan_e).sum())} elements"
    finite = expected.isfinite()
    assert torch.equal(actual[~finite & ~nan_e], expected[~finite & ~nan_e]), "infinities differ"
    a, e = actual[finite].double(), expected[finite].double()
    if e.numel() == 0:
        return
    # NOTE: errors are relative to max(|expected|, mean |expected| of the
    # tensor). A parameter that has shrunk towards zero keeps the ulp-sized
    # absolute error it picked up while it was of ordinary size (torch itself
    # rounds differently in the scalar tails of its parallel chunks), which is
    # large relative to its now tiny value but not to the tensor's scale.
    scale = e.abs().mean().item()
    err = (a - e).abs() / e.abs().clamp_min(scale + 1e-30)
    worst = err.max().item()
    assert worst <= rtol, f"max relative error {worst:.3g} > {rtol:g}"


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equal, except that any NaN equals any NaN (payloads may differ)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), f"NaN positions differ: {int((nan_a ^ nan_e).sum())} elements"
    int_dtype = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    bits_a = actual.view(int_dtype)[~nan_a]
    bits_e = expected.view(int_dtype)[~nan_e]
    diff = int((bits_a != bits_e).sum())
    assert diff == 0, f"{diff} of {bits_a.numel()} elements differ in their bits"


def torch_reference(
    params: list[torch.Tensor],
    grads_per_step: list[list[torch.Tensor]] | Callable[[int], list[torch.Tensor]],
    *,
    adamw: bool,
    groups: list[dict] | None = None,
    lr_per_step: list[float] | None = None,
    **hyper,
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """Run torch's single-tensor Adam/AdamW on copies of ``params``.

    Returns the final parameters and the optimizer (whose state holds the moments).
    ``lr_per_step`` sets every group's lr before each step (times the group's
    ``lr_scale`` if it has one). ``grads_per_step`` is a list, or a function
    of the 0-based step (then ``lr_per_step`` gives the number of steps).
    """
    ref = [p.detach().clone() for p in params]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    if groups is None:
        opt = cls(ref, foreach=False, **hyper)
    else:
        opt = cls(
            [{**g, "params": [ref[i] for i in g["params"]]} for g in groups], foreach=False, **hyper
        )
    steps = len(lr_per_step) if callable(grads_per_step) else len(grads_per_step)
    for step in range(steps):
        grads = grads_per_step(step) if callable(grads_per_step) else grads_per_step[step]
        if lr_per_step is not None:
            for group in opt.param_groups:
                group["lr"] = lr_per_step[step] * group.get("lr_scale", 1.0)
        for p, g in zip(ref, grads, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
    return ref, opt


def random_floats(n: int, seed: int, *, specials: bool = True) -> torch.Tensor:
    """n fp32 values of every magnitude; with ``specials`` also NaN, +-inf, +-0 and subnormals."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32).clone()
    if not specials:
        values = torch.nan_to_num(values, nan=1.0, posinf=2.0, neginf=-2.0)
    return values
