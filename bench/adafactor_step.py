"""Step time of CPUAdafactor's update against torch.optim.Adafactor on the same tensors.

CPUAdafactor runs the update as torch's single-tensor Adafactor does, per tensor
(vectorised torch ops; an offloaded chunk runs the same function on each tensor
of the chunk). This measures whether that composition is a bottleneck: the
median step over the shapes of a GPT's parameters, paired per round against
torch's single-tensor (``foreach=False``) and multi-tensor (``foreach=True``)
paths, and the Adam kernel (``CPUAdam``) on the same tensors for scale.

    python bench/adafactor_step.py [--layers 8 --hidden 512 --rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from infinity.optim import CPUAdafactor, CPUAdam


def _params(layers: int, hidden: int) -> list[torch.nn.Parameter]:
    """A GPT's parameter shapes: per block qkv, projection, MLP in and out, norms."""
    shapes: list[tuple[int, ...]] = [(256, hidden)]
    for _ in range(layers):
        shapes += [
            (3 * hidden, hidden),
            (hidden, hidden),
            (4 * hidden, hidden),
            (hidden, 4 * hidden),
        ]
        shapes += [(hidden,), (hidden,), (3 * hidden,), (4 * hidden,)]
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]


def _timer(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], layers, hidden):
    params = _params(layers, hidden)
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = make(params)
    opt.step()  # states allocated outside the timing

    def once() -> float:
        start = time.perf_counter()
        opt.step()
        return time.perf_counter() - start

    return once


def main() -> None:
    """Print the median step time of each path and its ratio to torch's single-tensor one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    paths = {
        "torch Adafactor(foreach=False)": lambda ps: torch.optim.Adafactor(ps, foreach=False),
        "torch Adafactor(foreach=True)": lambda ps: torch.optim.Adafactor(ps, foreach=True),
        "infinity CPUAdafactor": CPUAdafactor,
        "infinity CPUAdam (for scale)": CPUAdam,
    }
    timers = {name: _timer(make, args.layers, args.hidden) for name, make in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, once in timers.items():  # NOTE: interleaved, so drift hits all alike
            times[name].append(once())
    n = sum(p.numel() for p in _params(args.layers, args.hidden))
    base = times["torch Adafactor(foreach=False)"]
    print(f"{n / 1e6:.1f}M parameters, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for name, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"{name:<34}{statistics.median(values) * 1e3:>9.1f} ms  x{ratio:.2f}")


if __name__ == "__main__":
    main()
