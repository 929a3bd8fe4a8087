"""``infinity bench train --gpt2``: GPT-2 124M, plain vs infinity, where the time goes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from infinity.bench.train_gpt2 import run_gpt2
from infinity.cli.main import CommandError
from infinity.utils.sizes import format_size

TARGETS = {"default": 1.15, "overlap": 1.10}  # x plain, issue 18 part 4


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


def run_gpt2_cases(args: argparse.Namespace) -> int:
    """Run the GPT-2 cases and print ratios and the breakdown (and JSON)."""
    if args.block < 2:
        raise CommandError(f"--block {args.block} must be >= 2 (a block's first step is untimed)")
    if min(args.steps, args.batch_size, args.seq_len) < 1 or args.warmup < 0:
        raise CommandError("--steps, --batch-size, --seq-len must be >= 1 and --warmup >= 0")
    try:
        os.makedirs(args.nvme_path, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"cannot use --nvme-path {args.nvme_path!r}: {exc.strerror}") from None
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
        limit = TARGETS.get(case["case"])
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
