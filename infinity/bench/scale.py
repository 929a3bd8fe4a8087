"""``infinity bench scale``: train the largest Llama the free disk holds.

The size is picked so that the model's training states (16 bytes per bf16
parameter) fit the free space under ``--nvme-path`` minus a safety margin;
``--params`` and ``--max-disk`` cap it for a quicker run. Needs ``transformers``
(the ``hf`` extra). The model family, the pick and the run are
:mod:`infinity.bench.scale_run`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from infinity.bench.scale_run import ScaleRun, bytes_per_param, pick_shape, run_scale, usable_disk
from infinity.cli.main import CommandError
from infinity.config import AioConfig, Config, ConfigError
from infinity.devices.choice import choose_dtype, resolve_device
from infinity.utils.sizes import format_size, parse_size

_COUNT_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``infinity bench scale``."""
    parser.add_argument("--nvme-path", default=".infinity/bench", help="directory on the NVMe disk")
    parser.add_argument(
        "--params", help="at most this many parameters (e.g. 500M, 4B); default: what the disk fits"
    )
    parser.add_argument(
        "--max-disk", help="bytes of disk to size the model for (default: the free space)"
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=0.1,
        help="fraction of the free disk left untouched (default 0.1)",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=8192,
        help="vocabulary size (e.g. 128256: the embedding must fit the device budget whole)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bf16", "fp16", "fp32"),
        help="compute dtype (default auto: bf16 where the device computes it natively, else fp32)",
    )
    parser.add_argument(
        "--optimizer-state-dtype",
        default="fp32",
        choices=("fp32", "bf16", "int8"),
        help="how Adam's moments are stored (Config.optimizer_state_dtype; default fp32)",
    )
    parser.add_argument(
        "--overlap-optimizer",
        action="store_true",
        help="update each chunk as soon as its gradients are complete "
        "(Config.overlap_optimizer: gradients homed on NVMe never go to the disk)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="compute device (cuda: the GPU computes; the states beyond the device and "
        "host budgets still live on the disk; default cpu)",
    )
    parser.add_argument("--device-memory", default="1GiB", help="device budget (default 1GiB)")
    parser.add_argument("--host-memory", default="4GiB", help="host budget (default 4GiB)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (the first warms up)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--measure-size", default="1GiB", help="bytes written and read to measure the disk"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON line last")


def parse_count(text: str) -> int:
    """``"4B"``, ``"500M"``, ``"2.5e9"`` or ``"123"`` as a number of parameters."""
    raw = text.strip().upper()
    scale = _COUNT_SUFFIXES.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in _COUNT_SUFFIXES else raw
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise CommandError(f"--params {text!r} is not a count; write e.g. 500M or 4B") from None
    if value < 1:
        raise CommandError(f"--params {text!r} must be positive")
    return value


def _size(flag: str, text: str) -> int:
    try:
        return parse_size(text, name=flag)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def scale_config(args: argparse.Namespace) -> Config:
    """The offload ``Config`` of a scale run from its flags (``add_arguments``)."""
    try:
        return Config(
            dtype=args.dtype,
            optimizer_state_dtype=args.optimizer_state_dtype,
            overlap_optimizer=args.overlap_optimizer,
            device=args.device,
            device_memory=args.device_memory,
            host_memory=args.host_memory,
            nvme_path=args.nvme_path,
            aio=AioConfig(),
        )
    except ConfigError as exc:
        raise CommandError(str(exc)) from None


def table(report: dict[str, Any]) -> str:
    """The human-readable report."""
    r = report
    rss_over = r["peak_rss_bytes"] / (r["device_budget_bytes"] + r["host_budget_bytes"])
    rows = [
        f"{r['model']}, {r['dtype']} on {r['device']}: {r['params']:,} parameters",
        f"states       {format_size(r['states_bytes']):>10} ({r['bytes_per_param']:.4g} B/param, "
        f"moments {r['optimizer_state_dtype']}"
        f"{', overlapped step' if r.get('overlap_optimizer') else ''}) = "
        f"{r['states_bytes'] / r['ram_bytes']:.2f}x the RAM ({format_size(r['ram_bytes'])}); "
        f"{format_size(r['nvme_bytes'])} on the disk",
        f"peak RSS     {format_size(r['peak_rss_bytes']):>10} = {rss_over:.2f}x the budgets "
        f"(device {format_size(r['device_budget_bytes'])} + host "
        f"{format_size(r['host_budget_bytes'])}); {format_size(r['base_rss_bytes'])} before "
        "building",
        f"init         {r['construct_seconds'] + r['offload_seconds']:8.1f} s (construct "
        f"{r['construct_seconds']:.1f} s, offload {r['offload_seconds']:.1f} s); planner "
        f"{r['planner_seconds']:.2f} s",
        f"step         {r['step_seconds']:8.1f} s (median of steps 2+); I/O bound "
        f"{r['io_bound_seconds']:.1f} s for {r['nvme_read_bytes_per_step'] / 1e9:.1f} GB read and "
        f"{r['nvme_write_bytes_per_step'] / 1e9:.1f} GB written at {r['disk_read_gbps']:.2f} GB/s "
        f"reading, {r['disk_write_gbps']:.2f} overwriting, {r['disk_both_gbps']:.2f} doing both "
        f"(one after the other {r['io_serial_seconds']:.1f} s, both at full speed "
        f"{r['io_duplex_seconds']:.1f} s)",
        f"disk         busy {r['nvme_busy_seconds']:.1f} s of the step: "
        f"{r['nvme_gbps']:.2f} GB/s over the step, {r['nvme_busy_gbps']:.2f} GB/s while busy",
    ]
    if r["vs_io_bound"] is not None:
        rows.append(
            f"step / bound {r['vs_io_bound']:8.2f}x; of the step, {r['wait_nvme_seconds']:.1f} s "
            f"waiting on the disk and {r['compute_seconds']:.1f} s computing (forward, backward, "
            "Adam)"
        )
    rows.append("losses       " + " ".join(f"{x:.3f}" for x in r["losses"]))
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    """Pick the size, train it and print the report."""
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 1 or args.vocab < 2:
        raise CommandError("--steps, --batch-size and --seq-len must be >= 1, --vocab >= 2")
    if not 0 <= args.margin < 1:
        raise CommandError(f"--margin {args.margin} must be in [0, 1)")
    if args.dtype == "auto":  # NOTE [dtype auto]: the shape is sized for the dtype it runs
        args.dtype = choose_dtype(resolve_device(args.device)).dtype
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CommandError(
                "--device cuda: no CUDA GPU here (torch.cuda.is_available() is False)"
            )
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise CommandError(
            "infinity bench scale builds a transformers Llama: pip install 'infinity[hf]'"
        ) from None
    try:
        os.makedirs(args.nvme_path, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"cannot use --nvme-path {args.nvme_path!r}: {exc.strerror}") from None
    measure = _size("--measure-size", args.measure_size)
    free = shutil.disk_usage(args.nvme_path).free
    disk = _size("--max-disk", args.max_disk) if args.max_disk else free
    max_states = usable_disk(disk, args.margin, measure)
    max_params = parse_count(args.params) if args.params else None
    try:
        shape = pick_shape(
            vocab=args.vocab, dtype=args.dtype, max_states=max_states, max_params=max_params
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    states = shape.num_params * bytes_per_param(args.dtype, args.optimizer_state_dtype)
    print(
        f"{shape.describe()}: {format_size(states)} of states; disk {format_size(disk)}"
        f"{'' if args.max_disk else ' free'} under {args.nvme_path}, "
        f"{format_size(max_states)} usable",
        file=sys.stderr,
    )
    if states > free:
        raise CommandError(
            f"{format_size(states)} of states do not fit the {format_size(free)} free under "
            f"{args.nvme_path}; lower --params or --max-disk"
        )
    from tqdm import tqdm

    from infinity.schedule.planner import PlanError

    def bar(steps: int) -> Any:
        return tqdm(range(steps), desc="bench scale", unit="step", file=sys.stderr)

    scale_run = ScaleRun(
        shape, scale_config(args), args.steps, args.batch_size, args.seq_len, measure_bytes=measure
    )
    try:
        report = run_scale(scale_run, lambda m: print(f"... {m}", file=sys.stderr), bar)
    except PlanError as exc:
        raise CommandError(str(exc)) from None
    print(table(report))
    if args.json:
        print(json.dumps(report))
    return 0
