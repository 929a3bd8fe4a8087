"""When a dropped offloaded model's memory returns: NOTE [the model owns its engine].

python bench/drop_model.py [--layers 16] [--width 2048]

Offloads a stack of ``--layers`` square Linear layers (fp32, CPU backend, every state
in host memory), steps CPUAdam once, then drops the model and its optimizer: prints the
process's resident set (the kernel's count) after the step, right after ``del`` and
after a ``gc.collect()``. Where a reference cycle held the model, its states stayed
resident until the collection.
"""

from __future__ import annotations

import argparse
import gc
import weakref

import psutil
import torch

import infinity
from infinity.optim import CPUAdam


def main() -> None:
    """Build, step, drop, and print the resident set at each point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    process = psutil.Process()

    def resident() -> str:
        return f"{process.memory_info().rss >> 20} MiB"

    model = torch.nn.Sequential(
        *[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    )
    states = sum(p.numel() for p in model.parameters()) * 16 >> 20
    model = infinity.offload(
        model, infinity.Config(device="cpu", dtype="fp32", device_memory="300MiB")
    )
    optimizer = CPUAdam(model.parameters(), lr=1e-3)
    model(torch.randn(2, args.width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"states {states} MiB; resident after a step: {resident()}")
    alive = weakref.ref(model)
    del model, optimizer
    print(f"right after del: {resident()} (model alive: {alive() is not None})")
    gc.collect()
    print(f"after gc.collect(): {resident()} (model alive: {alive() is not None})")


if __name__ == "__main__":
    main()
