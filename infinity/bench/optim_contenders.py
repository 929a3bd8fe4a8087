"""The timed closures of ``infinity bench optim``: each optimizer kernel and its torch
counterpart on the same buffers, and the memory-bandwidth probes.

Every optimizer gets four contenders:

- ``ours fp32``: our step with fp32 gradients (the fused native kernels of
  Adam, Lion and SGD).
- ``torch fp32``: torch's counterpart on the same parameter tensor and
  gradient: ``torch.optim.AdamW(fused=True)``, Lion written in torch
  operations (torch has no Lion; this is the update of the paper as
  ``lion_pytorch`` composes it), ``torch.optim.SGD(momentum=0.9, foreach=True)``.
- ``ours mixed``: bf16 gradients in, fp32 master and state, bf16 params out.
- ``torch mixed``: torch's best composition for that case: upcast the bf16
  gradients into the fp32 ``.grad``, the fp32 step, copy params to bf16.

Bytes moved per parameter (what a step must read and write, the STREAM
convention): Adam reads p, g, m, v and writes p, m, v (28 B); Lion and SGD
with momentum read p, g and one state and write p and the state (20 B). Mixed
reads a 2-byte gradient and writes a 2-byte copy instead of nothing: the same
totals. Torch's mixed compositions are credited with the same bytes (they move
more).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from infinity._native import native
from infinity._native.adam import BANDWIDTH_KERNELS
from infinity.optim import kernels
from infinity.optim.lion import lion_step
from infinity.optim.sgd import SGDHyperParams, sgd_step

OPTIMIZERS = ("adam", "lion", "sgd")
BYTES_PER_PARAM = {"adam": 28, "lion": 20, "sgd": 20}
# What each optimizer's torch contenders are, for the table.
TORCH_LABELS = {
    "adam": "torch AdamW(fused=True)",
    "lion": "Lion in torch ops",
    "sgd": "torch SGD(foreach=True)",
}
# Bytes of memory one parameter needs: p, g and two probe buffers in fp32, bf16
# gradients and output...
BASE_FOOTPRINT = 4 * 4 + 2 * 2
# ... and each optimizer's state, ours and torch's (fp32 slots).
STATE_FOOTPRINT = {"adam": 4 * 4, "lion": 2 * 4, "sgd": 2 * 4}
ADAM: dict[str, Any] = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
LION: dict[str, Any] = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.01}
SGD_HYPER = SGDHyperParams(
    lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False, maximize=False
)
# name -> (native kind, bytes per element); see cpp/simd/bandwidth.hpp
PROBE_BYTES = {"triad": 12, "axpy": 12, "adam_pattern": 28, "adam_prefetch": 28}

Fn = Callable[[], object]


class Buffers:
    """The tensors every contender shares: parameters, fp32 and bf16 gradients and
    the bf16 output."""

    def __init__(self, n: int) -> None:
        # NOTE: uniform [0, 1) values keep every intermediate a normal float:
        # subnormals would trigger microcode assists and time something else.
        self.n = n
        self.p, self.g = torch.rand(n), torch.rand(n)
        self.g16 = torch.rand(n).to(torch.bfloat16)
        self.out16 = torch.empty(n, dtype=torch.bfloat16)
        # torch's optimizers step the parameter tensor; `.grad` is the fp32 gradient.
        self.p.grad = self.g

    def upcast(self, step: Fn) -> Fn:
        """Torch's mixed composition around its fp32 ``step``."""
        g, g16, out16, p = self.g, self.g16, self.out16, self.p

        def mixed() -> None:
            g.copy_(g16)
            step()
            out16.copy_(p)

        return mixed


def _counter() -> Callable[[], int]:
    """Step numbers 1, 2, ... (bias corrections and SGD's first step depend on them)."""
    state = [0]

    def next_step() -> int:
        state[0] += 1
        return state[0]

    return next_step


def adam(b: Buffers) -> dict[str, Fn]:
    """Our fused Adam kernel against ``torch.optim.AdamW(fused=True)``."""
    m, v = torch.rand(b.n), torch.rand(b.n)
    step = _counter()

    def ours(grad: torch.Tensor, out: torch.Tensor | None) -> None:
        kernels.adam_step(b.p, grad, m, v, step=step(), out16=out, **ADAM)

    opt = torch.optim.AdamW(
        [b.p], lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
        weight_decay=ADAM["weight_decay"], fused=True,
    )  # fmt: skip
    return _four(b, ours, opt.step)


def lion(b: Buffers) -> dict[str, Fn]:
    """Our fused Lion kernel against Lion written in torch operations."""
    m, theirs = torch.rand(b.n), torch.rand(b.n)
    lr, beta1, beta2, decay = LION["lr"], LION["beta1"], LION["beta2"], LION["weight_decay"]

    def ours(grad: torch.Tensor, out: torch.Tensor | None) -> None:
        lion_step(b.p, grad, m, out16=out, **LION)

    def torch_lion() -> None:
        # The paper's update in the fewest torch passes (decoupled decay,
        # sign of the interpolation, momentum update); the sign needs a temporary.
        b.p.mul_(1 - lr * decay)
        b.p.add_(theirs.lerp(b.g, 1 - beta1).sign_(), alpha=-lr)
        theirs.lerp_(b.g, 1 - beta2)

    return _four(b, ours, torch_lion)


def sgd(b: Buffers) -> dict[str, Fn]:
    """Our fused SGD kernel against ``torch.optim.SGD(momentum=0.9, foreach=True)``."""
    buf = torch.rand(b.n)
    step = _counter()
    hyper: dict[str, Any] = dict(
        lr=SGD_HYPER.lr, momentum=SGD_HYPER.momentum, dampening=SGD_HYPER.dampening,
        weight_decay=SGD_HYPER.weight_decay, nesterov=SGD_HYPER.nesterov,
    )  # fmt: skip

    def ours(grad: torch.Tensor, out: torch.Tensor | None) -> None:
        sgd_step(b.p, grad, buf, first_step=step() == 1, out16=out, **hyper)

    opt = torch.optim.SGD(
        [b.p], lr=SGD_HYPER.lr, momentum=SGD_HYPER.momentum,
        weight_decay=SGD_HYPER.weight_decay, foreach=True,
    )  # fmt: skip
    return _four(b, ours, opt.step)


def _four(
    b: Buffers, ours: Callable[[torch.Tensor, torch.Tensor | None], None], theirs: Fn
) -> dict[str, Fn]:
    return {
        "ours fp32": lambda: ours(b.g, None),
        "torch fp32": theirs,
        "ours mixed": lambda: ours(b.g16, b.out16),
        "torch mixed": b.upcast(theirs),
    }


BUILDERS: dict[str, Callable[[Buffers], dict[str, Fn]]] = {
    "adam": adam,
    "lion": lion,
    "sgd": sgd,
}


def probes(b: Buffers) -> dict[str, Fn]:
    """Memory-bandwidth probes from the native module, on the kernels' pool of threads:
    a STREAM triad (``a = b + s*c``), an in-place axpy (``a += s*b``), and the Adam
    access pattern without arithmetic (4 streams read, 3 written), without and with
    the kernel's software prefetch. The fastest is the roofline.

    They stream through the parameters, the (only read) fp32 gradients and
    two scratch buffers: ``p += g``-style passes keep the values normal floats, so
    the contenders' timings are unaffected, and the footprint grows by 8 B/param.
    """
    c, d = torch.rand(b.n), torch.rand(b.n)
    module = native().adam

    def probe(kind: int) -> Fn:
        return lambda: module.bandwidth_probe(
            kind, b.p.data_ptr(), b.g.data_ptr(), c.data_ptr(), d.data_ptr(), b.n
        )

    return {f"probe {name}": probe(BANDWIDTH_KERNELS[name]) for name in PROBE_BYTES}
