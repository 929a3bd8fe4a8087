"""Activations in the tiers: peak memory and step time of each policy, and the anchors, in one run.

python bench/activations.py [--layers 8 --hidden 1024 --vocab 8192 --seq-len 8192
                             --device-memory 256MiB --host-memory 512MiB
                             --nvme-path .infinity/bench --steps 2 --rows ROW,... --json]

A ``transformers`` Llama (issue 27's shape: hidden 1024, 8 layers, vocabulary
8192; fp32 compute, batch 1) trains one warm-up step and ``--steps`` timed
steps per row, each row in its own process so that its peak RSS is its own:

- ``plain``: the model in RAM, ``torch.optim.AdamW``: what a user runs when it fits;
- ``save_on_cpu``: plain with ``torch.autograd.graph.save_on_cpu`` (the anchor
  for offloading; on a CPU it has nowhere to move the tensors to);
- ``torch_checkpoint``: plain with ``gradient_checkpointing_enable`` (non-reentrant);
- ``keep`` / ``checkpoint``: infinity (states within the budgets, the rest on
  NVMe) with ``Config(activations=...)``;
- ``offload_host``: ``activations="offload"`` with a host budget that holds
  them (no NVMe tier for activations: on the CPU backend, where the device is
  RAM, they are only accounted, not copied);
- ``offload_nvme``: ``activations="offload"`` at the budgets: what the states
  leave of the host budget, then NVMe;
- ``auto``: ``activations="auto"`` at the budgets (its warm-up step measures,
  the timed steps run its choice per block).

Per row: peak RSS (``ru_maxrss``), what the steps add to the resting RSS (the RSS
before the first step, model built and offloaded), for infinity's rows the steps' peak
RSS (``VmHWM`` reset before the first) against ``infinity.memory_forecast``'s, the
median step time and its ratio to ``checkpoint``'s, activation bytes saved per step,
their peak in host memory and on NVMe, NVMe bytes written and read per step, and the
seconds backward waited for an activation read.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import psutil
import torch

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.utils.process_memory import reset_resident_peak, resident_peak_bytes
from infinity.utils.sizes import format_size, parse_size

ROWS = (
    "plain", "save_on_cpu", "torch_checkpoint", "keep", "checkpoint", "offload_host",
    "offload_nvme", "auto",
)  # fmt: skip


def build(args: argparse.Namespace, empty: bool) -> torch.nn.Module:
    """The Llama, seeded (on the meta device under ``init_empty`` for infinity)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    if empty:
        with infinity.init_empty():
            return transformers.LlamaForCausalLM(cfg).train()
    return transformers.LlamaForCausalLM(cfg).train()


def _loss(args: argparse.Namespace, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own loss, or (``--loss blocks``) infinity's a block of tokens at a time."""
    if args.loss == "model":
        return model(input_ids=ids, labels=ids).loss
    targets = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    return infinity.causal_lm_loss(model, ids, targets, block_tokens=512)


def run_row(args: argparse.Namespace, row: str) -> dict:
    """One row in this process: warm-up, timed steps, counters."""
    infinity_row = row not in ("plain", "save_on_cpu", "torch_checkpoint")
    model = build(args, empty=infinity_row)
    stats: dict = {}
    if infinity_row:
        policy = "offload" if row.startswith("offload") else row
        host = args.host_memory
        if row == "offload_host":
            # room for every saved tensor: about 256 bytes per layer, token and unit of
            # width in fp32, plus the logits and their gradient
            saved = args.layers * args.seq_len * args.hidden * 256 + 12 * args.vocab * args.seq_len
            host = parse_size(args.host_memory) + saved
        config = infinity.Config(
            dtype="fp32",
            device_memory=args.device_memory,
            host_memory=host,
            nvme_path=args.nvme_path,
            activations=policy,
        )
        model = infinity.offload(model, config)
        opt: torch.optim.Optimizer = CPUAdam(model.parameters(), lr=3e-4, weight_decay=0.1)
    else:
        if row == "torch_checkpoint":
            model.gradient_checkpointing_enable({"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    forecast = None
    if infinity_row:
        shape = torch.zeros((1, args.seq_len), dtype=torch.long)
        forecast = infinity.memory_forecast(model, lambda m: _loss(args, m, shape), args.seq_len)
    rest_rss = psutil.Process().memory_info().rss
    reset_resident_peak()
    times, losses = [], []
    before: dict = {}
    for step in range(1 + args.steps):
        ids = torch.randint(0, args.vocab, (1, args.seq_len), generator=gen)
        if step == 1 and infinity_row:
            before = infinity.stats(model).get("activations", {})
        start = time.perf_counter()
        if row == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                loss = _loss(args, model, ids)
        else:
            loss = _loss(args, model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    if infinity_row:
        stats = infinity.stats(model)
        engine_of(model).close()
    out = {
        "row": row,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rest_rss": rest_rss,
        "steps_peak_rss": resident_peak_bytes(),  # since the steps began
        "forecast_rss": None if forecast is None else forecast.resident_peak,
        "step_seconds": statistics.median(times),
        "losses": losses,
    }
    act = stats.get("activations")
    if act and "packed_bytes" in act:  # moved: offload, auto
        steps = max(1, args.steps)
        out["activations"] = {
            "saved_per_step": act["saved_last_forward_bytes"],
            "blocks": act.get("blocks"),
            "host_peak": act["host_peak_bytes"],
            "nvme_peak": act["nvme_peak_bytes"],
            "written_per_step": (act["nvme_written_bytes"] - before.get("nvme_written_bytes", 0))
            / steps,
            "read_per_step": (act["nvme_read_bytes"] - before.get("nvme_read_bytes", 0)) / steps,
            "wait_seconds": (act["read_wait_seconds"] - before.get("read_wait_seconds", 0)) / steps,
            "reads_not_ahead": act["reads_not_ahead"] - before.get("reads_not_ahead", 0),
        }
    return out


def main() -> int:
    """Run every row in its own process and print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument("--device-memory", default="256MiB")
    parser.add_argument("--host-memory", default="512MiB")
    parser.add_argument("--nvme-path", default=".infinity/bench")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument(
        "--loss",
        choices=("model", "blocks"),
        default="model",
        help="every row's loss: the model's own, or infinity.causal_lm_loss in 512-token blocks",
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # one row, in this process
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    if args.row:
        print(json.dumps(run_row(args, args.row)))
        return 0
    results = []
    for row in args.rows.split(","):
        if row not in ROWS:
            parser.error(f"--rows: {row!r} is not one of {', '.join(ROWS)}")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--row", row]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            print(f"{row}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
            results.append({"row": row, "error": done.stderr.strip().splitlines()[-1]})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"... {row}: {results[-1]['step_seconds']:.2f} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    ref = next((r for r in results if r["row"] == "checkpoint" and "error" not in r), None)
    print(
        f"Llama {args.layers} x {args.hidden}, vocabulary {args.vocab}, {args.seq_len} tokens "
        f"per step (batch 1, fp32); infinity budgets device {args.device_memory}, host "
        f"{args.host_memory}, NVMe {args.nvme_path}"
    )
    print(
        "| row | peak RSS | steps add | steps' peak / forecast | step | vs checkpoint "
        "| saved per step | host peak | NVMe peak | NVMe written / read per step "
        "| backward wait |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['row']} | failed: {r['error']} |")
            continue
        ratio = f"{r['step_seconds'] / ref['step_seconds']:.2f}x" if ref else "-"
        a = r.get("activations")
        cells = (
            [
                format_size(a["saved_per_step"]),
                format_size(a["host_peak"]),
                format_size(a["nvme_peak"]),
                f"{format_size(a['written_per_step'])} / {format_size(a['read_per_step'])}",
                f"{a['wait_seconds']:.2f} s",
            ]
            if a
            else ["-"] * 5
        )
        forecast = (
            f"{format_size(r['steps_peak_rss'])} / {format_size(r['forecast_rss'])} = "
            f"{r['steps_peak_rss'] / r['forecast_rss']:.2f}x"
            if r.get("forecast_rss")
            else "-"
        )
        print(
            f"| {r['row']} | {format_size(r['peak_rss'])} | "
            f"{format_size(r['peak_rss'] - r['rest_rss'])} | {forecast} | "
            f"{r['step_seconds']:.2f} s | {ratio} | " + " | ".join(cells) + " |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
