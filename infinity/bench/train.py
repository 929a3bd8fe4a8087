"""``infinity bench train``: offloaded step time against plain PyTorch.

The flags, their checks and the tables. The GPT cases are run by
:mod:`infinity.bench.train_cases`; ``--gpt2`` (GPT-2 124M, plain vs infinity, where
the time goes) by :mod:`infinity.bench.train_gpt2`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from infinity.bench.train_cases import OPTIMIZERS, run_all
from infinity.bench.train_gpt2 import run_gpt2
from infinity.cli.main import CommandError
from infinity.models.gpt import GPTConfig
from infinity.schedule.planner import PlanError
from infinity.utils.sizes import format_size

TARGETS = {"b": ("vs_plain", 1.15), "c": ("vs_bound", 1.2), "d": ("vs_bound", 1.2)}
# c0/d0 (no overlap) are reported for comparison, without a target.
GPT2_TARGETS = {"default": 1.15, "overlap": 1.10}  # x plain, issue 18 part 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``infinity bench train``."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--steps",
        type=int,
        default=18,
        help="timed steps per case (ratios are medians over rounds of --block steps)",
    )
    parser.add_argument("--warmup", type=int, default=4, help="untimed warm-up steps per case")
    parser.add_argument(
        "--block",
        type=int,
        default=4,
        help="consecutive steps per case before the next case runs; the first of each "
        "block is not timed (timed steps are rounded up to whole blocks)",
    )
    parser.add_argument("--nvme-path", default=".infinity/bench", help="directory on the NVMe disk")
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adam",
        help="the optimizer of every case (infinity's offloaded, torch's in plain PyTorch; "
        "AdamW for lion, which torch lacks); not with --gpt2",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on the last line"
    )
    parser.add_argument(
        "--gpt2",
        action="store_true",
        help="instead: transformers GPT2LMHeadModel 124M (fp32, batch 4 x --seq-len), plain "
        "vs infinity default vs overlap_optimizer=True, one process per case; uses "
        "--steps (rounded up to rounds of --block), --device-memory, --host-memory",
    )
    parser.add_argument("--device-memory", default="512MiB", help="--gpt2 only")
    parser.add_argument("--host-memory", default="1GiB", help="--gpt2 only")
    parser.add_argument(
        "--compare-block-size",
        metavar="SIZE",
        help="--gpt2 only: add a case default@SIZE, the default step with aio.block_size=SIZE",
    )
    parser.add_argument(
        "--compare-sched-batch",
        action="store_true",
        help="--gpt2 only: add default+batch, the default case with the engine's native threads "
        "under SCHED_BATCH (no wake-up preemption of the compute thread)",
    )


def _verdict(case: dict) -> str:
    """The target's verdict on the median, and how many rounds alone would disagree.

    A median a hair either side of its limit says little on a noisy
    machine; the count of rounds on the other side tells the reader how firm
    the verdict is.
    """
    target = TARGETS.get(case["case"])
    if target is None:
        return ""
    key, limit = target
    rounds = case["round_ratios"] if key == "vs_plain" else case["bound_round_ratios"]
    met = case[key] <= limit
    against = sum((r > limit) if met else (r <= limit) for r in rounds)
    side = "over" if met else "under"
    return (
        f"{key} <= {limit}: {'met' if met else 'MISSED'} "
        f"({against} of {len(rounds)} rounds {side} the limit)"
    )


def _check_block(args: argparse.Namespace) -> None:
    if args.block < 2:
        raise CommandError(f"--block {args.block} must be >= 2 (a block's first step is untimed)")


def _make_nvme_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"cannot use --nvme-path {path!r}: {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    """Run every case and print the table (and JSON)."""
    if args.gpt2:
        if args.optimizer != "adam":
            raise CommandError("--optimizer applies to the GPT cases only, not --gpt2")
        return _run_gpt2(args)
    sizes = (args.layers, args.hidden, args.heads, args.seq_len, args.batch_size, args.steps)
    if min(sizes) < 1:
        raise CommandError(
            "--layers, --hidden, --heads, --seq-len, --batch-size and --steps must be >= 1"
        )
    _check_block(args)
    if args.warmup < 0:
        raise CommandError(f"--warmup {args.warmup} must be >= 0")
    try:
        cfg = GPTConfig(
            vocab_size=256,
            seq_len=args.seq_len,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    _make_nvme_dir(args.nvme_path)
    try:
        report = run_all(
            cfg,
            batch=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
            nvme_dir=args.nvme_path,
            block=args.block,
            progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True),
            optimizer=args.optimizer,
        )
    except PlanError as exc:
        # The cases' budgets are fractions of the model (device = half
        # the parameters), so a tiny model can leave less than one module needs.
        raise CommandError(
            f"this model is too small for the bench's budgets: {exc} "
            "(use more --layers or a larger --hidden)"
        ) from None
    print(
        f"{report['model']}, {args.optimizer}: {report['params'] / 1e6:.1f}M parameters, batch "
        f"{args.batch_size} x "
        f"{args.seq_len} tokens; NVMe {report['nvme_read_gbps']:.2f} GB/s read, "
        f"{report['nvme_write_gbps']:.2f} GB/s write (1 GB = 1e9 bytes)"
    )
    print(
        f"{'case':<5}{'step s':>8}{'x plain':>9}{'IO bound s':>12}{'x bound':>9}"
        f"{'rounds':>12}{'h2d':>11}{'d2h':>11}{'nvme rd':>11}{'nvme wr':>11}  target"
    )
    for case in report["cases"]:
        t = case["traffic_per_step"]
        rounds = case["bound_round_ratios"]
        print(
            f"{case['case']:<5}{case['step_seconds']:>8.3f}{case['vs_plain']:>9.2f}"
            f"{case['io_lower_bound_seconds']:>12.3f}{case['vs_bound']:>9.2f}"
            f"{f'{min(rounds):.2f}-{max(rounds):.2f}':>12}"
            + "".join(
                f"{format_size(t.get(k, 0)):>11}"
                for k in ("h2d_bytes", "d2h_bytes", "nvme_read_bytes", "nvme_write_bytes")
            )
            + f"  {_verdict(case)}"
        )
    print(
        "x plain and x bound are medians over rounds of paired ratios; 'rounds' is their "
        "range (x bound), a measure of this machine's noise"
    )
    if args.json:
        print(json.dumps(report))
    return 0


def _breakdown_lines(case: dict[str, Any]) -> list[str]:
    b = case["breakdown"]
    cpu = b.get("thread_cpu", {})
    lines = [
        f"  {case['case']}: fwd+bwd {b['fwd_bwd_seconds']:.2f} s, step() {b['step_seconds']:.2f} s;"
        " CPU s per step: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items()))
    ]
    if "engine" in b:
        lines.append(
            "    on the compute thread (exclusive s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(b["engine"].items()))
        )
    if "traffic" in b:
        t = b["traffic"]
        lines.append(
            "    per step: "
            + ", ".join(
                f"{k.removesuffix('_bytes')} {format_size(t.get(k, 0))}"
                for k in ("h2d_bytes", "d2h_bytes", "nvme_read_bytes", "nvme_write_bytes")
            )
        )
    return lines


def _run_gpt2(args: argparse.Namespace) -> int:
    """``--gpt2``: run the GPT-2 cases and print ratios and the breakdown (and JSON)."""
    _check_block(args)
    if min(args.steps, args.batch_size, args.seq_len) < 1 or args.warmup < 0:
        raise CommandError("--steps, --batch-size, --seq-len must be >= 1 and --warmup >= 0")
    _make_nvme_dir(args.nvme_path)
    report = run_gpt2(
        batch=args.batch_size,
        seq_len=args.seq_len,
        device_memory=args.device_memory,
        host_memory=args.host_memory,
        rounds=-(-args.steps // (args.block - 1)),
        warmup_rounds=-(-args.warmup // args.block),
        block=args.block,
        compare_block_size=args.compare_block_size,
        compare_sched_batch=args.compare_sched_batch,
        nvme_dir=args.nvme_path,
        progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True),
    )
    load = report["load_average"]
    print(
        f"{report['model']}, batch {report['batch']} x {report['seq_len']}, device "
        f"{report['device_memory']}, host {report['host_memory']}, NVMe; {report['rounds']} rounds "
        f"of {report['block'] - 1} timed steps; load average {min(load):.1f}-{max(load):.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    print(f"{'case':<9}{'step s':>8}{'x plain':>9}{'rounds':>13}  target")
    for case in report["cases"]:
        r = case["round_ratios"]
        limit = GPT2_TARGETS.get(case["case"])
        verdict = ""
        if limit is not None:
            verdict = f"<= {limit}: {'met' if case['vs_plain'] <= limit else 'MISSED'}"
        print(
            f"{case['case']:<9}{case['step_seconds']:>8.2f}{case['vs_plain']:>9.3f}"
            f"{f'{min(r):.2f}-{max(r):.2f}':>13}  {verdict}"
        )
    print("where the time goes (medians per step):")
    for case in report["cases"]:
        print("\n".join(_breakdown_lines(case)))
    if args.json:
        print(json.dumps(report))
    return 0
