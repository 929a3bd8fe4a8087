"""Data parallel (issue 19): step time and communication at 1 and 2 gloo ranks, in one run.

python bench/data_parallel.py [--layers 4 --hidden 512 --batch 4 --steps 5 --repeats 3 --json]

The GPT of ``infinity.models.presets`` ("tiny", widened by the flags) trains for
``--warmup`` + ``--steps`` steps at 1 rank with batch 2B and at 2 ranks with batch
B each (the same samples per step), with every state in RAM ("host": device
budget half the parameters) and beyond a small host budget on NVMe ("nvme").
Each run is a fresh set of processes; the 1- and 2-rank runs of a case alternate
``--repeats`` times and the time ratio is the median of the paired ratios, so
the machine's drift hits both alike. Per rank: median step time, bytes passed to
collectives per step (``Collectives.bytes_sent``) against the plan's estimate
(``allgather_bytes + reduce_scatter_bytes``), peak host bytes and NVMe bytes.

Budgets are per process: the device budget is the same at both world sizes (a
GPU per rank); the NVMe case's host budget is split between the ranks (the same
machine's RAM), so the per-rank host and NVMe bytes show what sharding saves.

Every process runs ``--threads`` torch threads (default 1, at both world
sizes). NOTE: on this loaded 2-core machine one rank with 2 torch threads
stepped 3-4x slower than with 1 (the threads wait on each other's preempted
cores), which would have made 2 ranks look several times faster than 1.

NOTE: the 2 ranks share this machine's cores with each other and other
tenants, so the step-time ratio measures what sharding and communication cost
here, not the speed-up of a core (or GPU) per rank; "CPU s" (process CPU
seconds per step, summed over the ranks) shows the extra work of 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

import infinity
from infinity.config import Config
from infinity.core.names import HOST, NVME
from infinity.distributed import World
from infinity.models.gpt import GPT, GPTConfig, describe, init_weights
from infinity.models.presets import preset
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.runtime.budgets import plan_for
from infinity.runtime.params import ParamRegistry
from infinity.utils.sizes import format_size

SENT = ("allgather_bytes", "reduce_scatter_bytes")
NVME_HOST_SHARE = 0.25  # the NVMe case's host budget: this share of the 1-rank states
RUN_TIMEOUT = 900.0
FOOTNOTE = """\
step s: the slowest rank's median step; CPU s: process CPU seconds per step, summed over the ranks;
in coll.: rank 0's seconds per step inside collectives (waiting for the other rank included), and
calls: how many it ran per step (gathers, reduce-scatters, and the agreement before each gather);
per rank: bytes sent to collectives per step (measured, and the plan's estimate), peak host and
NVMe bytes. NOTE: the 2 ranks share this machine's cores with each other (and other tenants):
the step ratio shows the cost of sharding and communication, not the speed-up of a core or GPU
per rank.\
"""


def _config(cfg: GPTConfig, nvme_dir: str | None, host_memory: int | None) -> Config:
    return Config(
        device="cpu",
        dtype="fp32",
        device_memory=cfg.num_params * 2,  # half the fp32 parameters
        host_memory="auto" if host_memory is None else host_memory,
        nvme_path=nvme_dir,
    )


def _states_bytes(cfg: GPTConfig, config: Config, nproc: int) -> int:
    """Bytes of one rank's homes (host + NVMe) planned for ``nproc`` ranks."""
    with torch.device("meta"):
        registry = ParamRegistry.from_model(GPT(cfg))
    plan = plan_for(registry, config, torch.device("cpu"), world=World(rank=0, size=nproc))
    return plan.home_bytes(HOST) + plan.home_bytes(NVME)


def _rank_main(rank: int, nproc: int, port: int, job: dict, out_path: str) -> None:
    """One rank: join the group (2 ranks), train, write this rank's measurements."""
    torch.set_num_threads(job["threads"])
    if nproc > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=nproc,
            timeout=timedelta(seconds=300),
        )
    try:
        result = _train(rank, nproc, job)
    finally:
        if nproc > 1:
            dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(result, f)


def _train(rank: int, nproc: int, job: dict) -> dict:
    cfg = GPTConfig(**job["cfg"])
    torch.manual_seed(0)
    model = GPT(cfg)
    model.apply(init_weights)
    config = _config(cfg, job["nvme_dir"], job["host_memory"])
    model = infinity.offload(model, config)
    optimizer = CPUAdam(model.parameters(), lr=1e-4)
    engine = engine_of(model)
    waited = _time_collectives(engine.collectives)
    g = torch.Generator().manual_seed(1)
    per_rank = job["global_batch"] // nproc
    times, cpu, sent, in_collectives, calls = [], [], [], [], []
    for step in range(job["warmup"] + job["steps"]):
        ids = torch.randint(0, cfg.vocab_size, (job["global_batch"], cfg.seq_len), generator=g)
        ids = ids[rank * per_rank : (rank + 1) * per_rank]
        before, before_wait, before_calls = engine.collectives.bytes_sent, waited[0], waited[1]
        start, start_cpu = time.perf_counter(), time.process_time()
        model(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= job["warmup"]:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            in_collectives.append(waited[0] - before_wait)
            calls.append(waited[1] - before_calls)
            sent.append(engine.collectives.bytes_sent - before)
    stats = infinity.stats(model)
    result = {
        "step_seconds": statistics.median(times),
        "cpu_seconds": statistics.median(cpu),
        "collective_seconds": statistics.median(in_collectives),
        "collective_calls": statistics.median(calls),
        "sent_per_step": statistics.median(sent),
        "estimate": sum(engine.plan.traffic.get(key, 0) for key in SENT),
        "host_peak_bytes": stats["host_peak_bytes"],
        "nvme_peak_bytes": engine.manager.nvme_account.peak,
    }
    engine.close()
    return result


def _time_collectives(collectives: object) -> list[float]:
    """Wrap the collectives a step runs to add their wall seconds (waiting for the
    other rank included) and their count to the returned ``[seconds, calls]``."""
    total = [0.0, 0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - start
                total[1] += 1

        return wrapper

    for name in ("all_gather_in_place", "reduce_scatter_mean", "any"):
        setattr(collectives, name, timed(getattr(collectives, name)))
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(nproc: int, job: dict) -> list[dict]:
    """``nproc`` fresh rank processes training ``job``; each rank's measurements."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        paths = [os.path.join(out_dir, f"rank{r}.json") for r in range(nproc)]
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, nproc, port, job, paths[r]))
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + RUN_TIMEOUT
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"{nproc}-rank run: ranks {failed} failed (their errors are above)")
        results = []
        for path in paths:
            with open(path) as f:
                results.append(json.load(f))
        return results


def measure(args: argparse.Namespace) -> dict:
    """Every case at 1 and 2 ranks, alternating; a JSON-ready report."""
    cfg = preset(
        "tiny", layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len
    )
    os.makedirs(args.nvme_path, exist_ok=True)
    report: dict = {
        "model": describe(cfg),
        "batch_per_rank": args.batch,
        "threads": args.threads,
        "cases": {},
    }
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme_dir:
        whole = _states_bytes(cfg, _config(cfg, None, None), 1)
        host = int(whole * NVME_HOST_SHARE)
        cases = {"host": (None, {1: None, 2: None}), "nvme": (nvme_dir, {1: host, 2: host // 2})}
        for name, (nvme, hosts) in cases.items():
            runs: dict[int, list[list[dict]]] = {1: [], 2: []}
            for repeat in range(args.repeats):
                order = (1, 2) if repeat % 2 == 0 else (2, 1)
                for nproc in order:
                    print(f"... {name}, {nproc} rank(s), repeat {repeat + 1}", file=sys.stderr)
                    job = {
                        "cfg": asdict(cfg),
                        "nvme_dir": nvme,
                        "host_memory": hosts[nproc],
                        "global_batch": 2 * args.batch,
                        "warmup": args.warmup,
                        "steps": args.steps,
                        "threads": args.threads,
                    }
                    runs[nproc].append(run(nproc, job))
            report["cases"][name] = _summarise(runs, 2 * args.batch, hosts)
    return report


def _summarise(runs: dict[int, list[list[dict]]], global_batch: int, hosts: dict) -> dict:
    """Per world size: medians over repeats of the slowest rank's step and of rank 0's
    bytes; the 2-rank figures as ratios of the 1-rank ones."""
    out: dict = {}
    for nproc, repeats in runs.items():
        steps = [max(rank["step_seconds"] for rank in ranks) for ranks in repeats]
        cpu = [sum(rank["cpu_seconds"] for rank in ranks) for ranks in repeats]
        last = repeats[-1][0]
        out[nproc] = {
            "host_memory": hosts[nproc],
            "step_seconds": statistics.median(steps),
            "samples_per_second": global_batch / statistics.median(steps),
            "cpu_seconds": statistics.median(cpu),
            "collective_seconds": statistics.median(r[0]["collective_seconds"] for r in repeats),
            "collective_calls": last["collective_calls"],
            "sent_per_step": last["sent_per_step"],
            "estimate": last["estimate"],
            "host_peak_bytes": max(ranks[0]["host_peak_bytes"] for ranks in repeats),
            "nvme_peak_bytes": max(ranks[0]["nvme_peak_bytes"] for ranks in repeats),
            "repeat_steps": steps,
        }
    one, two = out[1], out[2]
    ratios = [
        max(r["step_seconds"] for r in b) / max(r["step_seconds"] for r in a)
        for a, b in zip(runs[1], runs[2], strict=True)
    ]
    two["time_vs_1"] = statistics.median(ratios)
    two["time_ratios"] = ratios
    two["cpu_vs_1"] = statistics.median(
        sum(r["cpu_seconds"] for r in b) / sum(r["cpu_seconds"] for r in a)
        for a, b in zip(runs[1], runs[2], strict=True)
    )
    two["host_vs_1"] = two["host_peak_bytes"] / one["host_peak_bytes"]
    if one["nvme_peak_bytes"]:
        two["nvme_vs_1"] = two["nvme_peak_bytes"] / one["nvme_peak_bytes"]
    return out


def print_table(report: dict) -> None:
    """The report as a table."""
    print(
        f"{report['model']}, fp32, {report['batch_per_rank']} x 2 samples per step, "
        f"{report['threads']} torch thread(s) per rank"
    )
    print(
        f"{'case':<6}{'ranks':>6}{'step s':>8}{'x 1 rank':>10}{'rounds':>11}{'samples/s':>10}"
        f"{'CPU s':>7}{'x 1':>6}{'in coll.':>9}{'calls':>6}"
        f"{'sent/step':>12}{'estimate':>11}{'host peak':>12}{'x 1':>6}{'NVMe':>11}{'x 1':>6}"
    )
    for name, case in report["cases"].items():
        for nproc, r in case.items():
            ratio = f"{r['time_vs_1']:.2f}" if "time_vs_1" in r else "1"
            spread = (
                f"{min(r['time_ratios']):.2f}-{max(r['time_ratios']):.2f}"
                if "time_ratios" in r
                else ""
            )
            print(
                f"{name:<6}{nproc:>6}{r['step_seconds']:>8.3f}{ratio:>10}{spread:>11}"
                f"{r['samples_per_second']:>10.1f}"
                f"{r['cpu_seconds']:>7.2f}{r.get('cpu_vs_1', 1):>6.2f}"
                f"{r['collective_seconds']:>9.3f}{r['collective_calls']:>6.0f}"
                f"{format_size(r['sent_per_step']):>12}"
                f"{format_size(r['estimate']):>11}{format_size(r['host_peak_bytes']):>12}"
                f"{r.get('host_vs_1', 1):>6.2f}{format_size(r['nvme_peak_bytes']):>11}"
                f"{r.get('nvme_vs_1', 1):>6.2f}"
            )
    print(FOOTNOTE)


def main() -> int:
    """Parse flags, run every case, print the table (and JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="B: per-rank batch at 2 ranks")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3, help="1- and 2-rank runs per case")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank (the same at 1 and 2 ranks; see this file's docstring)",
    )
    parser.add_argument("--nvme-path", default=".infinity/bench", help="directory on the NVMe disk")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args()
    for flag in ("batch", "steps", "repeats", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    report = measure(args)
    print_table(report)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
