"""Optimizer-state storage (``Config(optimizer_state_dtype=...)``): NVMe bytes, step time, loss.

python bench/state_dtype.py [--steps 18 --loss-steps 300 --scale-params 2B --json]
python bench/state_dtype.py --no-nvme-case --loss-steps 0 --scale-params 2B \
    --scale-vocab 128256 --scale-dtype fp32 --scale-seq-len 16 --scale-dtypes fp32,int8

1. The NVMe case of ``infinity bench train`` (case c0: GPT 8x512, fp32,
   batch 4 x 256, optimizer states on NVMe, parameters and gradients in RAM,
   the default step) with fp32, bf16 and int8 moments, each at the smallest host
   budget that keeps parameters and gradients in RAM (so every optimizer unit
   is on NVMe). The three run in interleaved blocks; the ratios to fp32 are
   medians over rounds of paired ratios (see ``infinity.bench.train_cases``).
   It runs twice: at batch 4 x 256, where this machine's 2 cores make the step
   bound by compute (fewer disk bytes cannot show as time), and at batch 1 x 32
   (``--small-batch``), where the same model's step is bound by the disk.
   A fourth case, int8 with every state in RAM, measures the floor of int8's
   time ratio in the same run: what is left once the disk costs nothing.
2. With ``--scale-params`` (e.g. ``2B --scale-vocab 128256``, minutes per run):
   a model beyond RAM whose step is bound by the disk, ``infinity bench scale``
   once per state dtype and round, each in its own process, the dtypes in a
   rotating order; ratios to fp32 are medians over rounds of paired ratios.
   It ends with issue 26 part 4's two numbers: the int8 step against its own
   I/O bound (the time this disk needs for the step's reads and writes,
   ``infinity/bench/disk.py``), and the GB/s int8 moments move against
   fp32 ones, over the step and over the time the disk was busy
   (``nvme_busy_seconds``: a step that computes with no transfer in flight
   moves fewer GB/s without the disk being any slower). ``--scale-dtype fp32``
   keeps the compute small on a CPU without fast bf16 matmuls.
   ``--scale-device cuda`` computes on the GPU (the states beyond the budgets
   still live on the disk); ``--scale-modes default,overlap`` runs both steps,
   round 1 of each first; ``--scale-io-seconds S`` measures the disk first and
   takes the largest model (at most ``--scale-params``) whose fp32-moment step
   the planner gives an I/O bound of at most S seconds; ``--scale-budget-seconds``
   starts no round that would end past it. Each round's runs print one line
   each as the round ends. ``bench/gpu_check.sh`` runs it on a lent GPU:

   python bench/state_dtype.py --no-nvme-case --loss-steps 0 --scale-device cuda \
       --scale-params 1B --scale-io-seconds 5 --scale-dtypes fp32,int8 \
       --scale-modes default,overlap --scale-budget-seconds 170 ...
3. The demo (``infinity train``, the "small" preset: 300 steps) once per state
   dtype, each in its own process: the loss curve against fp32's.
4. With ``--anchors`` (only this part runs): the loss grid of
   ``bench/state_dtype_anchors.py`` — torch AdamW, torchao's and bitsandbytes'
   AdamW8bit, and infinity with fp32 / bf16 / int8 moments, on a GPT and a
   ``transformers`` Llama, over beta2 x learning rate; one process per cell,
   ``--jobs`` at a time (one torch thread each). ``--seeds N`` runs each cell
   with seeds 0..N-1 (initialisation and batch order, every optimizer alike) and
   judges the goal on the tail losses averaged over the seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import state_dtype_anchors as grid  # bench/ is the script's directory
import torch

from infinity.bench.train_cases import _batches, host_budget_for, offloaded_runner
from infinity.config import Config
from infinity.models.gpt import GPTConfig
from infinity.schedule.planner import NVME
from infinity.utils.sizes import format_size

DTYPES = ("fp32", "bf16", "int8")
RAM_FLOOR = "int8 RAM"


def nvme_case(args: argparse.Namespace, batch: int, tokens: int) -> dict:
    """Step time and NVMe bytes per step of case c0 for each state dtype."""
    cfg = GPTConfig(vocab_size=256, seq_len=256, layers=8, hidden=512, heads=8)
    block = 4
    rounds = -(-args.steps // (block - 1))
    warm_rounds = 1
    # NOTE: shorter sequences than the model's context: same model, same
    # bytes per step, a fraction of the compute.
    data = _batches(dataclasses.replace(cfg, seq_len=tokens), batch, (rounds + warm_rounds) * block)
    os.makedirs(args.nvme_path, exist_ok=True)
    out: dict = {
        "model": f"GPT 8x512 fp32, batch {batch} x {tokens}",
        "params": cfg.num_params,
        "cases": {},
    }
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as tmp:
        # c0 for each dtype: the smallest host budget keeping parameters and
        # gradients in RAM, so every optimizer unit is on NVMe.
        c0 = lambda p: NVME not in p.param_home + p.grad_home  # noqa: E731
        cases = [(name, f"c0 with {name} moments", name, c0) for name in DTYPES]
        # NOTE: the floor of int8's time ratio: the same step with every state in
        # RAM (no disk at all). Once int8's step no longer waits for the disk, its
        # ratio to fp32 cannot go below this one's: the rest is compute and the
        # engine's own work on the same cores.
        floor = "c0 with int8 moments, every state in RAM"
        cases.append((RAM_FLOOR, floor, "int8", lambda p: NVME not in p.optim_home))
        runners = []
        for name, description, dtype, wanted in cases:
            base = Config(
                device="cpu",
                dtype="fp32",
                device_memory=cfg.num_params * 2,
                nvme_path=tmp,
                optimizer_state_dtype=dtype,
            )
            host = host_budget_for(cfg, base, wanted)
            runners.append(offloaded_runner(name, description, cfg, base.replace(host_memory=host)))
        for r in range(rounds + warm_rounds):
            print(f"... round {r + 1} of {rounds + warm_rounds}", file=sys.stderr, flush=True)
            turn = r % len(runners)
            for runner in runners[turn:] + runners[:turn]:
                runner.block(data[r * block : (r + 1) * block], timed=r >= warm_rounds)
        r_laps = {r.name: r.laps for r in runners}
        results = {res.name: res for res in (r.result() for r in runners)}
    fp32 = results["fp32"]
    for name, res in results.items():
        nvme = res.traffic.get("nvme_read_bytes", 0) + res.traffic.get("nvme_write_bytes", 0)
        out["cases"][name] = {
            "step_seconds": res.step_seconds,
            "nvme_bytes_per_step": nvme,
            "host_memory": res.config["host_memory"],
            "time_vs_fp32": statistics.median(
                a / b for a, b in zip(res.rounds, fp32.rounds, strict=True)
            ),
            "round_ratios": [a / b for a, b in zip(res.rounds, fp32.rounds, strict=True)],
            "wait_nvme_seconds": statistics.mean(
                lap.get("wait_nvme_seconds", 0.0) for lap in r_laps[name]
            ),
        }
    base_bytes = out["cases"]["fp32"]["nvme_bytes_per_step"]
    for case in out["cases"].values():
        case["bytes_vs_fp32"] = case["nvme_bytes_per_step"] / base_bytes
    return out


def disk(report: dict) -> float:
    """NVMe bytes per step of one ``infinity bench scale`` report."""
    return report["nvme_read_bytes_per_step"] + report["nvme_write_bytes_per_step"]


def size_for_disk(args: argparse.Namespace, overlap: bool) -> dict:
    """``--scale-io-seconds``: measure this disk (``io.rates.measure_mix``, the rates the runs'
    bound is made of), then pick the largest model of the scale family, at most
    ``--scale-params``, whose fp32-moment step the planner (``Plan.traffic``) gives
    at most that I/O bound (``io_bound_seconds``); the smallest member if none does."""
    from infinity.bench.scale import parse_count
    from infinity.bench.scale_run import family, planned_nvme_bytes
    from infinity.config import AioConfig
    from infinity.io.rates import io_bound_seconds, measure_mix
    from infinity.utils.sizes import parse_size

    os.makedirs(args.nvme_path, exist_ok=True)
    rates = measure_mix(args.nvme_path, parse_size(args.scale_measure_size), AioConfig())
    print(f"disk under {args.nvme_path}: {rates.read_gbps:.2f} GB/s reading, "
          f"{rates.write_gbps:.2f} overwriting, {rates.both_gbps:.2f} doing both, "
          f"{rates.first_write_gbps:.2f} writing a fresh file (infinity/bench/disk.py, "
          f"{args.scale_measure_size} per pass)", flush=True)  # fmt: skip
    config = Config(
        dtype=args.scale_dtype,
        optimizer_state_dtype="fp32",
        overlap_optimizer=overlap,
        device=args.scale_device,
        device_memory=args.scale_device_memory,
        host_memory=args.scale_host_memory,
        nvme_path=args.nvme_path,
    )
    cap = parse_count(args.scale_params)
    members = [m for m in family(args.scale_vocab) if m.num_params <= cap]
    if not members:
        raise SystemExit(f"state_dtype: no scale model has at most {args.scale_params} parameters")

    def bound(i: int) -> tuple[float, int]:
        read_b, write_b = planned_nvme_bytes(members[i], config)
        return io_bound_seconds(read_b, write_b, rates), read_b + write_b

    # NOTE: a larger member moves more bytes per step: bisect for the largest
    # within the target (the smallest one if even it is above).
    lo, hi = 0, len(members) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bound(mid)[0] <= args.scale_io_seconds:
            lo = mid
        else:
            hi = mid - 1
    seconds, nbytes = bound(lo)
    shape = members[lo]
    print(f"sized for it: {shape.describe()}; the planner gives its fp32-moment step "
          f"{nbytes / 1e9:.2f} GB of NVMe I/O, an I/O bound of {seconds:.2f} s at these rates "
          f"(target {args.scale_io_seconds:g} s, at most {args.scale_params} parameters)",
          flush=True)  # fmt: skip
    return {
        "params": shape.num_params,
        "model": shape.describe(),
        "disk": rates.as_dict(),
        "planned_fp32_nvme_bytes": nbytes,
        "planned_fp32_io_bound_seconds": seconds,
    }


def _scale_run(args: argparse.Namespace, name: str, params: str, overlap: bool) -> dict:
    """One ``infinity bench scale`` process; its report, or a loud exit showing its stderr."""
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as tmp:
        cmd = [
            sys.executable, "-m", "infinity", "bench", "scale", "--json",
            "--nvme-path", tmp, "--params", params, "--device", args.scale_device,
            "--vocab", str(args.scale_vocab), "--optimizer-state-dtype", name,
            "--dtype", args.scale_dtype, "--device-memory", args.scale_device_memory,
            "--host-memory", args.scale_host_memory, "--steps", str(args.scale_steps),
            "--seq-len", str(args.scale_seq_len),
            "--measure-size", args.scale_measure_size,
        ]  # fmt: skip
        if overlap:
            cmd.append("--overlap-optimizer")
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-6000:])
        raise SystemExit(
            f"state_dtype: `{' '.join(cmd)}` failed (exit {done.returncode}); its stderr is above"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


RUN_HEADER = (
    f"{'step':<8}{'round':>5} {'moments':<8}{'step s':>7}{'NVMe/step':>12}{'I/O bound':>10}"
    f"{'x bound':>8}{'busy s':>8}{'GB/s':>7}{'busy GB/s':>10}{'GB/s x fp32':>12}"
    f"{'busy x fp32':>12}{'disk r/w/both GB/s':>20}"
)


def run_row(mode: str, r: int, name: str, rep: dict, fp32: dict) -> str:
    """One run's line: its step against its I/O bound, its GB/s, and its GB/s against
    the fp32 run of the same round (the disk drifts over minutes)."""
    rates = "/".join(f"{rep[f'disk_{k}_gbps']:.2f}" for k in ("read", "write", "both"))
    ratio = rep["nvme_gbps"] / fp32["nvme_gbps"] if fp32["nvme_gbps"] else float("nan")
    busy = (
        rep["nvme_busy_gbps"] / fp32["nvme_busy_gbps"] if fp32["nvme_busy_gbps"] else float("nan")
    )
    return (f"{mode:<8}{r + 1:>5} {name:<8}{rep['step_seconds']:>7.2f}{disk(rep) / 1e9:>9.2f} GB"
            f"{rep['io_bound_seconds']:>9.2f}s{rep['vs_io_bound']:>8.2f}"
            f"{rep['nvme_busy_seconds']:>8.2f}{rep['nvme_gbps']:>7.2f}"
            f"{rep['nvme_busy_gbps']:>10.2f}{ratio:>12.2f}{busy:>12.2f}{rates:>20}")  # fmt: skip


def scale_modes(args: argparse.Namespace) -> list[str]:
    """Part 2's steps: ``default`` (updates trail into the next forward) and/or
    ``overlap`` (``overlap_optimizer=True``)."""
    modes = ["overlap"] if args.scale_overlap else args.scale_modes.split(",")
    if not modes or not set(modes) <= {"default", "overlap"} or len(set(modes)) < len(modes):
        raise SystemExit(f"state_dtype: --scale-modes {args.scale_modes!r}: default and/or overlap")
    return modes


def scale_cases(args: argparse.Namespace) -> dict[str, dict]:
    """``infinity bench scale`` once per round, step mode and state dtype, each in its own
    process: the rounds of each mode in turn (round 1 of every mode first), the dtypes
    in a rotating order; each round's lines printed as it ends. The summary per mode."""
    dtypes, modes = args.scale_dtypes.split(","), scale_modes(args)
    start = time.monotonic()
    sizing = size_for_disk(args, modes[0] == "overlap") if args.scale_io_seconds else None
    params = str(sizing["params"]) if sizing else args.scale_params
    runs: dict[str, dict[str, list[dict]]] = {m: {name: [] for name in dtypes} for m in modes}
    longest = 0.0
    jobs = [(r, mode) for r in range(args.scale_rounds) for mode in modes]
    for k, (r, mode) in enumerate(jobs):
        elapsed = time.monotonic() - start
        if k and args.scale_budget_seconds and elapsed + longest > args.scale_budget_seconds:
            print(f"... stopping after {k} of {len(jobs)} rounds: one more ({longest:.0f} s, "
                  f"the longest so far) would end past --scale-budget-seconds "
                  f"{args.scale_budget_seconds:g}", file=sys.stderr, flush=True)  # fmt: skip
            break
        began = time.monotonic()
        for name in dtypes[r % len(dtypes) :] + dtypes[: r % len(dtypes)]:
            print(f"... scale, {mode} step, round {r + 1}, {name} moments", file=sys.stderr,
                  flush=True)  # fmt: skip
            rep = _scale_run(args, name, params, mode == "overlap")
            if not disk(rep):
                raise SystemExit(
                    f"state_dtype: {name} moments moved no NVMe bytes: the budgets held every "
                    "state; lower --scale-host-memory / --scale-device-memory"
                )
            runs[mode][name].append(rep)
            done = (f"... {rep['step_seconds']:.2f} s a step, {disk(rep) / 1e9:.2f} GB of NVMe "
                    f"I/O, {rep['vs_io_bound']:.2f}x its I/O bound")  # fmt: skip
            print(done, file=sys.stderr, flush=True)
        longest = max(longest, time.monotonic() - began)
        if k == 0:
            rep = runs[mode]["fp32"][0]
            print(f"{rep['model']}, {rep['dtype']} on {rep['device']}, batch 1 x "
                  f"{args.scale_seq_len}, states beyond device {args.scale_device_memory} + "
                  f"host {args.scale_host_memory} on NVMe; step s: median of steps 2-"
                  f"{args.scale_steps}; a round took {longest:.0f} s")  # fmt: skip
            print(RUN_HEADER)
        # NOTE: each round's lines as it ends: those survive a timeout's kill.
        for name in dtypes:
            print(run_row(mode, r, name, runs[mode][name][r], runs[mode]["fp32"][r]), flush=True)
    return {
        mode: summarize_scale(args, by_dtype, mode == "overlap", sizing)
        for mode, by_dtype in runs.items()
        if by_dtype["fp32"]
    }


def summarize_scale(
    args: argparse.Namespace, runs: dict[str, list[dict]], overlap: bool, sizing: dict | None
) -> dict:
    """Medians over one step mode's rounds; ratios to fp32 are medians of paired ratios."""
    first = runs["fp32"][0]
    out: dict = {
        "model": f"{first['model']}, batch 1 x {args.scale_seq_len}",
        "device": first["device"],
        "dtype": args.scale_dtype,
        "overlap_optimizer": overlap,
        "sizing": sizing,
        "runs": runs,
        "cases": {},
    }
    for name, reports in runs.items():
        pairs = list(zip(reports, runs["fp32"], strict=True))
        out["cases"][name] = {
            "step_seconds": [rep["step_seconds"] for rep in reports],
            "nvme_bytes_per_step": statistics.median(disk(rep) for rep in reports),
            "wait_nvme_seconds": statistics.median(rep["wait_nvme_seconds"] for rep in reports),
            "io_bound_seconds": statistics.median(rep["io_bound_seconds"] for rep in reports),
            "vs_io_bound": statistics.median(rep["vs_io_bound"] for rep in reports),
            "nvme_busy_seconds": statistics.median(rep["nvme_busy_seconds"] for rep in reports),
            "nvme_gbps": statistics.median(rep["nvme_gbps"] for rep in reports),
            "nvme_busy_gbps": statistics.median(rep["nvme_busy_gbps"] for rep in reports),
            "disk_gbps": {  # read, overwrite, both at once: medians over this dtype's runs
                rate: statistics.median(rep[f"disk_{rate}_gbps"] for rep in reports)
                for rate in ("read", "write", "both")
            },
            "time_vs_fp32": statistics.median(
                a["step_seconds"] / b["step_seconds"] for a, b in pairs
            ),
            "bytes_vs_fp32": statistics.median(disk(a) / disk(b) for a, b in pairs),
            # NOTE: the rates in paired rounds (same round, one after the other):
            # the disk drifts over minutes, so a ratio within a round is steadier.
            "gbps_vs_fp32": statistics.median(a["nvme_gbps"] / b["nvme_gbps"] for a, b in pairs),
            "busy_gbps_vs_fp32": statistics.median(
                a["nvme_busy_gbps"] / b["nvme_busy_gbps"] for a, b in pairs
            ),
        }
    return out


def _print_scale(scale: dict) -> None:
    """The table of part 2 and the two numbers of issue 26 part 4."""
    step = "overlapped step" if scale["overlap_optimizer"] else "default step"
    rounds = len(scale["runs"]["fp32"])
    print(f"{scale['model']}, {scale['dtype']} on {scale['device']}, {step}: medians over "
          f"{rounds} round{'s' if rounds != 1 else ''}")  # fmt: skip
    print(f"{'moments':<9}{'steps s':>16}{'x fp32':>8}{'NVMe wait':>10}{'NVMe/step':>12}"
          f"{'x fp32':>8}{'I/O bound':>10}{'x bound':>8}{'busy s':>8}{'GB/s':>7}"
          f"{'busy GB/s':>10}")  # fmt: skip
    for name, c in scale["cases"].items():
        steps = " ".join(f"{x:.2f}" for x in c["step_seconds"])
        print(f"{name:<9}{steps:>16}{c['time_vs_fp32']:>8.2f}{c['wait_nvme_seconds']:>10.2f}"
              f"{c['nvme_bytes_per_step'] / 1e9:>9.2f} GB{c['bytes_vs_fp32']:>8.2f}"
              f"{c['io_bound_seconds']:>9.2f}s{c['vs_io_bound']:>8.2f}"
              f"{c['nvme_busy_seconds']:>8.2f}{c['nvme_gbps']:>7.2f}"
              f"{c['nvme_busy_gbps']:>10.2f}")  # fmt: skip
    rates = scale["cases"]["fp32"]["disk_gbps"]
    print(f"(the disk in the fp32 runs: {rates['read']:.2f} GB/s reading, {rates['write']:.2f} "
          f"overwriting, {rates['both']:.2f} doing both; GB/s: NVMe bytes over the step, and over "
          "the time the disk had a transfer of the step in flight)")  # fmt: skip
    int8 = scale["cases"].get("int8")
    if int8 is not None:
        print(f"int8 step / its I/O bound: {int8['vs_io_bound']:.2f}x "
              f"({statistics.median(int8['step_seconds']):.2f} s against "
              f"{int8['io_bound_seconds']:.2f} s)")  # fmt: skip
        fp32 = scale["cases"]["fp32"]
        busy = (int8["nvme_busy_gbps"], fp32["nvme_busy_gbps"])
        print(f"int8 GB/s / fp32 GB/s: {int8['gbps_vs_fp32']:.2f} over the step "
              f"({int8['nvme_gbps']:.2f} against {fp32['nvme_gbps']:.2f} GB/s), "
              f"{int8['busy_gbps_vs_fp32']:.2f} while the disk is busy "
              f"({busy[0]:.2f} against {busy[1]:.2f} GB/s)")  # fmt: skip


def demo_losses(args: argparse.Namespace) -> dict:
    """The demo's loss per step for each state dtype (each run in its own process)."""
    curves = {}
    for name in DTYPES:
        print(f"... demo, {name} moments", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=args.nvme_path) as tmp:
            cmd = [
                sys.executable, "-m", "infinity", "train", "--json",
                "--steps", str(args.loss_steps), "--optimizer-state-dtype", name,
                "--checkpoint-dir", "none", "--plot", "none", "--nvme-path", tmp,
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        curves[name] = [e["loss"] for e in events if e["event"] == "step"]
    return curves


def _tail(losses: list[float], n: int = 20) -> float:
    """Mean loss of the last ``n`` steps (one step's loss is one batch's: noisy)."""
    return sum(losses[-n:]) / len(losses[-n:])


def _print_case(case: dict) -> None:
    print(f"{case['model']} ({case['params'] / 1e6:.1f}M parameters), optimizer states on NVMe")
    print(
        f"{'moments':<9}{'step s':>8}{'x fp32':>8}{'rounds':>12}{'NVMe wait':>10}"
        f"{'NVMe/step':>12}{'x fp32':>8}{'host':>11}"
    )
    for name, c in case["cases"].items():
        spread = f"{min(c['round_ratios']):.2f}-{max(c['round_ratios']):.2f}"
        print(
            f"{name:<9}{c['step_seconds']:>8.3f}{c['time_vs_fp32']:>8.2f}{spread:>12}"
            f"{c['wait_nvme_seconds']:>10.3f}"
            f"{format_size(c['nvme_bytes_per_step']):>12}{c['bytes_vs_fp32']:>8.2f}"
            f"{format_size(c['host_memory']):>11}"
        )
    if RAM_FLOOR in case["cases"]:
        print(f"({RAM_FLOOR}: int8 with every state in RAM, no disk: the floor of int8's x fp32)")


def anchors_grid(args: argparse.Namespace) -> dict:
    """Part 4: every cell in its own process, ``args.jobs`` at a time; prints the table."""
    missing = grid.missing_anchors()
    for name, package in missing.items():
        print(f"anchor {name} skipped: `pip install {package}` (bench only; not a dependency)")
    cells = [
        grid.Cell(model, opt, lr, beta2, args.anchor_steps, args.anchor_compute, seed=seed)
        for model in args.anchor_models.split(",")
        for beta2 in (float(x) for x in args.anchor_beta2s.split(","))
        for lr in (float(x) for x in args.anchor_lrs.split(","))
        for seed in range(args.seeds)
        for opt in grid.OPTIMIZERS
        if opt not in missing and opt in args.anchor_optimizers.split(",")
    ]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "state_dtype_anchors.py")
    results: dict[str, dict] = {}
    pending = list(cells)
    running: list[tuple[subprocess.Popen, str]] = []
    while pending or running:
        while pending and len(running) < args.jobs:
            cell = pending.pop(0)
            cmd = [sys.executable, script, cell.key()]
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            running.append((proc, cell.key()))
        proc, key = running.pop(0)
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"cell {key} failed (exit {proc.returncode})")
        results[key] = json.loads(out.strip().splitlines()[-1])
        done = f"{grid.tail(results[key]['losses']):.4f}, {results[key]['step_seconds']:.2f} s/step"
        print(f"... {key}: {done}", file=sys.stderr, flush=True)
    print(
        f"mean loss of the last {grid.TAIL} of {args.anchor_steps} steps, batch 8 x 128 bytes, "
        f"infinity computing in {args.anchor_compute}"
        + (f", seeds 0..{args.seeds - 1}" if args.seeds > 1 else "")
    )
    for line in grid.table(results, cells):
        print(line)
    return results


def main() -> int:
    """Run the parts asked for and print the tables (and JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=18, help="timed steps per dtype (part 1)")
    parser.add_argument("--loss-steps", type=int, default=300, help="demo steps (part 3; 0 skips)")
    parser.add_argument("--nvme-path", default=".infinity/bench", help="directory on the NVMe disk")
    parser.add_argument(
        "--nvme-case",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run part 1 (--no-nvme-case: only the parts asked for beside it)",
    )
    parser.add_argument(
        "--small-batch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the disk-bound shape (batch 1 x 32)",
    )
    parser.add_argument("--scale-params", help="also part 2 at this size (e.g. 2B; minutes)")
    parser.add_argument("--scale-vocab", type=int, default=8192, help="part 2's vocabulary")
    parser.add_argument("--scale-rounds", type=int, default=2, help="part 2's rounds")
    parser.add_argument(
        "--scale-seq-len", type=int, default=256, help="part 2's tokens per step (batch 1)"
    )
    parser.add_argument(
        "--scale-overlap", action="store_true",
        help="part 2 with overlap_optimizer=True only (= --scale-modes overlap)",
    )  # fmt: skip
    parser.add_argument(
        "--scale-modes", default="default",
        help="part 2's steps, rounds of each in turn: default (updates trail into the next "
        "forward) and/or overlap (overlap_optimizer=True), e.g. default,overlap",
    )  # fmt: skip
    parser.add_argument(
        "--scale-dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
        help="part 2's compute dtype (fp32: the least compute on a CPU without bf16 matmuls)",
    )  # fmt: skip
    parser.add_argument(
        "--scale-dtypes", default=",".join(DTYPES), help="part 2's state dtypes (fp32 among them)"
    )
    parser.add_argument(
        "--scale-device", default="cpu", choices=("cpu", "cuda"),
        help="part 2's compute device (cuda: the GPU computes, the states beyond the budgets "
        "still live on the disk)",
    )  # fmt: skip
    parser.add_argument(
        "--scale-io-seconds", type=float, default=0.0,
        help="part 2: measure the disk first and take the largest model (at most "
        "--scale-params) whose fp32-moment step the planner gives this I/O bound at most "
        "(0: --scale-params as it is)",
    )  # fmt: skip
    parser.add_argument(
        "--scale-budget-seconds", type=float, default=0.0,
        help="part 2: start no round that would end past this many seconds, going by the "
        "longest round so far (at least one round; 0: all --scale-rounds)",
    )  # fmt: skip
    parser.add_argument("--scale-device-memory", default="2GiB", help="part 2's device budget")
    parser.add_argument("--scale-host-memory", default="4GiB", help="part 2's host budget")
    parser.add_argument("--scale-steps", type=int, default=4, help="part 2's steps (1 warms up)")
    parser.add_argument(
        "--scale-measure-size", default="1GiB", help="part 2's disk measurement (each pass)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--anchors", action="store_true", help="only part 4: the loss grid")
    parser.add_argument("--anchor-steps", type=int, default=150, help="part 4: steps per cell")
    parser.add_argument("--anchor-lrs", default="2e-3,6e-4", help="part 4: learning rates")
    parser.add_argument("--anchor-models", default="gpt,llama", help="part 4: gpt and/or llama")
    parser.add_argument("--anchor-beta2s", default="0.95,0.999", help="part 4: beta2 values")
    parser.add_argument(
        "--anchor-optimizers",
        default=",".join(grid.OPTIMIZERS),
        help="part 4: a subset of " + ",".join(grid.OPTIMIZERS),
    )
    parser.add_argument(
        "--anchor-compute",
        choices=("bf16", "fp32"),
        default="bf16",
        help="part 4: Config.dtype of the infinity cells (bf16: the default users get)",
    )
    parser.add_argument(
        "--seeds", type=int, default=1,
        help="part 4: seeds 0..N-1 per cell (initialisation and batches); with N > 1 a row "
        "per seed and the goal judged on the means over the seeds",
    )  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="part 4: cells run at once")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    torch.manual_seed(0)
    report: dict = {}
    if args.anchors:
        report["anchors"] = anchors_grid(args)
        if args.json:
            print(json.dumps(report))
        return 0
    if args.scale_params and "fp32" not in args.scale_dtypes.split(","):
        parser.error("--scale-dtypes must include fp32 (the ratios are to it)")
    if args.scale_params and args.scale_device == "cuda" and not torch.cuda.is_available():
        parser.error("--scale-device cuda: no CUDA GPU here (torch.cuda.is_available() is False)")
    shapes = {"nvme": (4, 256), "nvme_small_batch": (1, 32)}
    if not args.small_batch:
        shapes.pop("nvme_small_batch")
    if not args.nvme_case:
        shapes = {}
    for key, (batch, tokens) in shapes.items():
        report[key] = nvme_case(args, batch, tokens)
        _print_case(report[key])
    if args.scale_params:
        report["scale"] = scale_cases(args)
        for scale in report["scale"].values():
            _print_scale(scale)
    if args.loss_steps:
        curves = demo_losses(args)
        report["demo_losses"] = curves
        ref = _tail(curves["fp32"])
        print(f"demo ({args.loss_steps} steps): mean loss of the last 20 steps")
        for name, losses in curves.items():
            marks = ", ".join(f"{losses[i]:.3f}" for i in range(0, len(losses), 50))
            change = _tail(losses) / ref - 1
            print(f"{name:<6}{_tail(losses):8.4f}  ({change:+.2%})  every 50: {marks}")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
