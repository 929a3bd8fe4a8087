"""The engine's host-thread time per step where compute is small (issue 43 part 4).

python bench/hook_overhead.py [--layers 16] [--fraction 0.25] [--clip] [--steps 10] [--rounds 3]

A ``transformers`` Llama with many layers and a tiny hidden size (64), bf16, on the
CPU backend with a device budget that is ``--fraction`` of its bf16 parameters: the
step is mostly the engine's own Python (hooks, fetches, the prefetch plan), which
on a GPU is what bounds a small batch. The same model also trains plain (bf16,
``torch.optim.AdamW``) in the same process, rounds interleaved. Prints per round the
median step of each, infinity's overhead (its step less plain's) and the median of
``infinity.stats(model)["last_step"]["hook_seconds"]``; ``--clip`` clips at 1.0.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import transformers

import infinity
from infinity.optim import CPUAdam


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _trainer(model: torch.nn.Module, opt: torch.optim.Optimizer, clip: bool) -> Callable[[], None]:
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step


def main() -> None:
    """Warm both up, then time ``--steps`` steps of each per round."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--clip", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    plain_model = _model(args.layers).to(torch.bfloat16)
    plain = _trainer(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-4), args.clip)
    model = _model(args.layers)
    params = sum(p.numel() for p in model.parameters())
    budget = max(int(params * 2 * args.fraction), 1 << 20)
    model = infinity.offload(
        model, infinity.Config(device="cpu", dtype="bf16", device_memory=budget)
    )
    offloaded = _trainer(model, CPUAdam(model.parameters(), lr=1e-4), args.clip)
    for _ in range(3):
        plain()
        offloaded()
    print(f"{args.layers} layers, device budget {args.fraction} of the parameters, "
          f"clip {args.clip}, median of {args.steps} steps (ms):")  # fmt: skip
    for r in range(args.rounds):
        laps: dict[str, list[float]] = {"plain": [], "infinity": [], "hooks": []}
        for _ in range(args.steps):
            for name, step in (("plain", plain), ("infinity", offloaded)):
                start = time.perf_counter()
                step()
                laps[name].append(time.perf_counter() - start)
            laps["hooks"].append(infinity.stats(model)["last_step"]["hook_seconds"])
        ms = {k: statistics.median(v) * 1e3 for k, v in laps.items()}
        over = ms["infinity"] - ms["plain"]
        print(f"round {r + 1}: plain {ms['plain']:.1f}, infinity {ms['infinity']:.1f} "
              f"({ms['infinity'] / ms['plain']:.2f}x), overhead {over:.1f}, "
              f"hooks {ms['hooks']:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
