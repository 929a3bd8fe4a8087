"""The steps' peak resident set against ``infinity.memory_forecast``, and plain PyTorch's.

python bench/memory_forecast.py [--batch 4 --seq-len 256 --device-memory 512MiB
                                 --host-memory 768MiB --nvme-path .infinity/bench
                                 --steps 3 --activations keep]

``transformers`` GPT-2 124M (fp32, tied 50257 x 768 embedding), states beyond the host
budget on NVMe (issue 41's case). Each row runs in its own process, so its peak is its
own: ``plain`` (the model and ``torch.optim.AdamW`` in RAM) and ``infinity`` (offloaded,
``CPUAdam``); ``--loss blocks`` takes the loss with ``infinity.causal_lm_loss``. Per
row: the resident set before the steps, the steps' peak (``VmHWM``
reset before the first step), and for infinity the forecast and the peak's ratio to it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

import infinity
from infinity.utils.process_memory import reset_resident_peak, resident_bytes, resident_peak_bytes
from infinity.utils.sizes import format_size


def _loss(args: argparse.Namespace, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own loss, or (``--loss blocks``) infinity's a block of tokens at a time."""
    if args.loss == "model":
        return model(input_ids=ids, labels=ids).loss
    targets = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    return infinity.causal_lm_loss(model, ids, targets)


def run_row(args: argparse.Namespace, row: str) -> dict:
    """One row in this process."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    forecast = None
    if row == "infinity":
        config = infinity.Config(
            device="cpu",
            dtype="fp32",
            device_memory=args.device_memory,
            host_memory=args.host_memory,
            nvme_path=args.nvme_path,
            activations=args.activations,
        )
        model = infinity.offload(model, config)
        opt: torch.optim.Optimizer = infinity.optim.CPUAdam(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, 50257, (args.batch, args.seq_len), generator=gen)
        for _ in range(args.steps)
    ]
    if row == "infinity":
        shape = batches[0]
        forecast = infinity.memory_forecast(model, lambda m: _loss(args, m, shape), shape.numel())
    rest = resident_bytes()
    reset_resident_peak()
    for ids in batches:
        _loss(args, model, ids).backward()
        opt.step()
        opt.zero_grad()
    out = {"row": row, "rest": rest, "peak": resident_peak_bytes()}
    if forecast is not None:
        out["forecast"] = forecast.resident_peak
        out["working_set"] = forecast.working_set.peak
    return out


def main() -> int:
    """Run both rows, each in its own process, and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device-memory", default="512MiB")
    parser.add_argument("--host-memory", default="768MiB")
    parser.add_argument("--nvme-path", default=".infinity/bench")
    parser.add_argument("--activations", default="keep")
    parser.add_argument("--loss", choices=("model", "blocks"), default="model")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    if args.row:
        print(json.dumps(run_row(args, args.row)))
        return 0
    print(
        f"GPT-2 124M, {args.batch} x {args.seq_len} tokens, fp32, activations="
        f"{args.activations}, loss {args.loss}; infinity at device {args.device_memory}, host "
        f"{args.host_memory}, NVMe {args.nvme_path}"
    )
    print(
        "| row | resident before the steps | steps' peak | forecast (working set) "
        "| peak / forecast |"
    )
    print("|---|---|---|---|---|")
    for row in ("plain", "infinity"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--row", row]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            print(f"| {row} | failed: {done.stderr.strip().splitlines()[-1]} |")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        ratio = f"{r['peak'] / r['forecast']:.2f}x" if "forecast" in r else "-"
        forecast = (
            f"{format_size(r['forecast'])} ({format_size(r['working_set'])})"
            if "forecast" in r
            else "-"
        )
        print(
            f"| {row} | {format_size(r['rest'])} | {format_size(r['peak'])} | {forecast} "
            f"| {ratio} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
