"""The engine's host-thread time per step where compute is small (issue 43 part 4).

python bench/hook_overhead.py [--layers 16] [--fraction 0.25] [--clip] [--steps 10]

A ``transformers`` Llama with many layers and a tiny hidden size (64), bf16, on the
CPU backend with a device budget that is ``--fraction`` of its bf16 parameters: the
step is mostly the engine's own Python (hooks, fetches, the prefetch plan), which
on a GPU is what bounds a small batch. Prints the median step and the median of
``infinity.stats(model)["last_step"]["hook_seconds"]``; ``--clip`` clips at 1.0.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import transformers

import infinity
from infinity.optim import CPUAdam


def main() -> None:
    """Train a few warm-up steps, then time ``--steps`` more."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--clip", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=args.layers, num_attention_heads=4,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    budget = max(int(params * 2 * args.fraction), 1 << 20)
    model = infinity.offload(
        model, infinity.Config(device="cpu", dtype="bf16", device_memory=budget)
    )
    opt = CPUAdam(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    laps = []
    for step in range(3 + args.steps):
        model(input_ids=ids, labels=ids).loss.backward()
        if args.clip:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if step >= 3:
            laps.append(infinity.stats(model)["last_step"])
    step_ms = statistics.median(lap["seconds"] for lap in laps) * 1e3
    hooks_ms = statistics.median(lap["hook_seconds"] for lap in laps) * 1e3
    print(f"{args.layers} layers, budget {args.fraction} of the parameters, clip {args.clip}: "
          f"step {step_ms:.1f} ms, hooks {hooks_ms:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
