"""The fewest NVMe bytes per step any placement of homes gives, per optimizer.

python bench/nvme_bytes_floor.py [--layers 8 --hidden 512 --json]

For the model and budgets of ``infinity bench train``'s cases c, c0, d and
d0, and for each optimizer, prints:
  - the NVMe bytes per step the planner plans (``Plan.traffic``);
  - the *floor*: the fewest bytes of any split of the host room left beside the
    plan's *minimum* staging (``Plan.min_host_bytes``) between parameter homes
    (forward's first chunks: they are also the ones backward fetches again) and
    optimizer-state homes.
Both against AdamW's planned bytes at the same budget; the floor also against
AdamW's own floor.

The floor is an optimistic bound: it keeps one staging slot's depth per kind,
which serialises the disk with the compute, so no real plan should reach it.
Where even the floor is above a goal, no placement meets the goal at that
budget. The planner's estimate is checked against the engine's measured
bytes in ``tests/engine/test_plan_estimate.py``; ``infinity bench train
--optimizer NAME`` measures them.

NOTE: this answers issue 29's question "can Lion reach 0.55x and Adafactor 0.3x
of AdamW's NVMe bytes?" from the plan alone, in a second (see docs/BENCHMARKS.md,
"NVMe bytes per step by optimizer").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile

import torch

from infinity.bench.train_cases import nvme_budgets
from infinity.cli.plan import OPTIMIZERS
from infinity.config import Config
from infinity.core.names import HOST, NVME
from infinity.core.plan import Plan
from infinity.models.gpt import GPT, GPTConfig
from infinity.runtime.budgets import plan_for
from infinity.runtime.params import ParamRegistry
from infinity.schedule.traffic import estimate_traffic


def nvme_bytes(traffic: dict[str, int]) -> int:
    """Bytes read plus bytes written."""
    return traffic["nvme_read_bytes"] + traffic["nvme_write_bytes"]


def _ratio(bytes_: int, adamw: int) -> float:
    return bytes_ / adamw if adamw else 0.0


def floor(plan: Plan, host_budget: int, consume_grads: bool) -> tuple[int, int, int]:
    """(bytes, parameter homes, optimizer homes) of the best split of the room."""
    n = plan.layout.num_chunks
    room = host_budget - plan.min_host_bytes - plan.tensor_state_bytes
    best: tuple[int, int, int] | None = None
    for params in range(n + 1):
        used = sum(plan.param_bytes(i) for i in range(params))
        if used > room:
            break
        for units in range(n + 1):
            if used + sum(plan.optim_bytes(i) for i in range(units)) > room:
                break
            homes = dataclasses.replace(
                plan,
                param_home=tuple(HOST if i < params else NVME for i in range(n)),
                optim_home=tuple(
                    HOST if i < units or plan.optim_home[i] == HOST else NVME for i in range(n)
                ),
            )
            moved = nvme_bytes(estimate_traffic(homes, consume_grads=consume_grads))
            if best is None or moved < best[0]:
                best = (moved, params, units)
    assert best is not None  # zero homes always fits: the plan itself needs no more
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args(argv)
    cfg = GPTConfig(
        vocab_size=256, seq_len=args.seq_len, layers=args.layers, hidden=args.hidden,
        heads=args.heads,
    )  # fmt: skip
    with torch.device("meta"):
        registry = ParamRegistry.from_model(GPT(cfg))
    cpu = torch.device("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:  # the plan only checks that it exists
        nvme = Config(device="cpu", dtype="fp32", device_memory=cfg.num_params * 2, nvme_path=tmp)
        optim_only, small = nvme_budgets(cfg, nvme)  # infinity bench train's
        for case, host, overlap in (
            ("c", optim_only, True), ("c0", optim_only, False),
            ("d", small, True), ("d0", small, False),
        ):  # fmt: skip
            config = nvme.replace(host_memory=host, overlap_optimizer=overlap)
            adam_plan = plan_for(registry, config, cpu, OPTIMIZERS["adamw"])
            adam = nvme_bytes(adam_plan.traffic)
            adam_floor = floor(adam_plan, host, overlap)[0]
            for name in ("adamw", "lion", "sgd", "adafactor"):
                plan = plan_for(registry, config, cpu, OPTIMIZERS[name])
                least, params, units = floor(plan, host, overlap)
                planned = nvme_bytes(plan.traffic)
                rows.append(
                    {
                        "case": case,
                        "optimizer": name,
                        "host_bytes": host,
                        "planned_bytes": planned,
                        "planned_vs_adamw": _ratio(planned, adam),
                        "floor_bytes": least,
                        "floor_vs_adamw_planned": _ratio(least, adam),
                        "floor_vs_adamw_floor": _ratio(least, adam_floor),
                        "floor_param_homes": params,
                        "floor_optimizer_homes": units,
                    }
                )
    if args.json:
        print(json.dumps({"model": f"GPT {cfg.layers}x{cfg.hidden}", "rows": rows}))
        return 0
    print(f"GPT {cfg.layers}x{cfg.hidden}, {cfg.num_params / 1e6:.1f}M parameters, fp32")
    print(
        "case optimizer   planned MiB (x AdamW's)   floor MiB (x AdamW's planned, floor)"
        "   the floor's homes"
    )
    for r in rows:
        print(
            f"{r['case']:<4} {r['optimizer']:<9} {r['planned_bytes'] / 2**20:9.1f} "
            f"({r['planned_vs_adamw']:.2f}x)       {r['floor_bytes'] / 2**20:9.1f} "
            f"({r['floor_vs_adamw_planned']:.2f}x, {r['floor_vs_adamw_floor']:.2f}x)"
            f"         {r['floor_param_homes']} param, {r['floor_optimizer_homes']} optimizer"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
