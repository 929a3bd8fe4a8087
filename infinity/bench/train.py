"""End-to-end step time of offloaded training against plain PyTorch, in one run.

Cases (same model, same batches):
  a. plain PyTorch in RAM with ``torch.optim.AdamW(fused=True)``;
  b. offloaded, device budget half the parameters, everything else in RAM;
  c. offloaded, optimizer states on NVMe (parameters and gradients on the host);
  d. offloaded, everything beyond a small host budget on NVMe.
Each offloaded step time is reported as a ratio to (a) and, for the NVMe
cases, against ``max(compute time of (a), I/O lower bound)``, the lower bound
being the NVMe bytes of one step divided by the bandwidth measured in the same
run (``infinity.bench.nvme``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import infinity
from infinity.bench.nvme import measure_engine
from infinity.config import AioConfig, Config
from infinity.models.gpt import GPT, GPTConfig, init_weights
from infinity.optim import CPUAdam
from infinity.runtime.budgets import plan_for
from infinity.runtime.params import ParamRegistry
from infinity.schedule.planner import NVME, PlanError

Progress = Callable[[str], None]


@dataclass
class CaseResult:
    """Median step time and per-step traffic of one case."""

    name: str
    description: str
    step_seconds: float
    steps: list[float] = field(default_factory=list)
    traffic: dict[str, float] = field(default_factory=dict)
    config: dict | None = None


def _batches(cfg: GPTConfig, batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g),
        )
        for _ in range(n)
    ]


def _model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    model.apply(init_weights)
    return model


def _timed(step: Callable[[tuple], None], data: list, warmup: int) -> list[float]:
    times = []
    for i, batch in enumerate(data):
        start = time.perf_counter()
        step(batch)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def run_plain(cfg: GPTConfig, data: list, warmup: int) -> CaseResult:
    """Case (a): the model and AdamW(fused=True) in RAM."""
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(batch: tuple) -> None:
        model(*batch).backward()
        opt.step()
        opt.zero_grad()

    times = _timed(step, data, warmup)
    return CaseResult("a", "plain PyTorch, AdamW(fused=True)", statistics.median(times), times)


def run_offloaded(
    name: str, description: str, cfg: GPTConfig, config: Config, data: list, warmup: int
) -> CaseResult:
    """One offloaded case; traffic is the mean per timed step."""
    model = infinity.offload(_model(cfg), config)
    opt = CPUAdam(model.parameters(), lr=1e-4)
    laps: list[dict[str, float]] = []

    def step(batch: tuple) -> None:
        model(*batch).backward()
        opt.step()
        opt.zero_grad()
        laps.append(dict(infinity.stats(model)["last_step"]))

    times = _timed(step, data, warmup)
    timed = laps[warmup:]
    traffic = {k: statistics.mean(lap.get(k, 0.0) for lap in timed) for k in timed[0]}
    model._infinity_engine.close()
    return CaseResult(name, description, statistics.median(times), times, traffic, config.to_dict())


def host_budget_for(cfg: GPTConfig, base: Config, wanted: Callable[[object], bool]) -> int:
    """The smallest host budget whose plan satisfies ``wanted(plan)`` (binary search)."""
    with torch.device("meta"):
        registry = ParamRegistry.from_model(GPT(cfg))
    lo, hi = 1 << 20, 1 << 40
    while hi - lo > 1 << 20:
        mid = (lo + hi) // 2
        try:
            ok = wanted(plan_for(registry, base.replace(host_memory=mid), torch.device("cpu")))
        except PlanError:
            ok = False
        lo, hi = (lo, mid) if ok else (mid, hi)
    return hi


def run_all(
    cfg: GPTConfig,
    *,
    batch: int,
    steps: int,
    warmup: int,
    nvme_dir: str,
    progress: Progress | None = None,
) -> dict:
    """Every case plus the NVMe bandwidth of ``nvme_dir``; a JSON-ready report."""
    note = progress or (lambda _msg: None)
    data = _batches(cfg, batch, steps + warmup)
    param_bytes = cfg.num_params * 4
    results = []
    note("a: plain PyTorch")
    plain = run_plain(cfg, data, warmup)
    results.append(plain)
    base = Config(device="cpu", dtype="fp32", device_memory=param_bytes // 2)
    note("b: device budget = half the parameters")
    results.append(
        run_offloaded("b", "offloaded, device = 1/2 params, rest in RAM", cfg, base, data, warmup)
    )
    with tempfile.TemporaryDirectory(dir=nvme_dir) as tmp:
        nvme = base.replace(nvme_path=tmp)
        optim_only = host_budget_for(
            cfg, nvme, lambda p: NVME not in p.param_home and NVME not in p.grad_home
        )
        note("c: optimizer states on NVMe")
        results.append(
            run_offloaded(
                "c",
                "offloaded, optimizer states on NVMe",
                cfg,
                nvme.replace(host_memory=optim_only),
                data,
                warmup,
            )
        )
        smallest = host_budget_for(cfg, nvme, lambda p: True)
        note("d: everything beyond a small host budget on NVMe")
        results.append(
            run_offloaded(
                "d",
                "offloaded, small host budget, rest on NVMe",
                cfg,
                nvme.replace(host_memory=int(smallest * 1.25)),
                data,
                warmup,
            )
        )
        note("NVMe bandwidth")
        size = min(1 << 30, max(256 << 20, param_bytes * 2))
        bw = measure_engine(tmp, size, AioConfig())
    read_bps, write_bps = bw.read_gbps * 1e9, bw.write_gbps * 1e9
    report = {
        "model": f"GPT {cfg.layers}x{cfg.hidden}",
        "params": cfg.num_params,
        "batch": batch,
        "seq_len": cfg.seq_len,
        "nvme_read_gbps": bw.read_gbps,
        "nvme_write_gbps": bw.write_gbps,
        "cases": [],
    }
    for r in results:
        io_bound = (
            r.traffic.get("nvme_read_bytes", 0) / read_bps
            + r.traffic.get("nvme_write_bytes", 0) / write_bps
        )
        floor = max(plain.step_seconds, io_bound)
        report["cases"].append(
            {
                "case": r.name,
                "description": r.description,
                "step_seconds": r.step_seconds,
                "vs_plain": r.step_seconds / plain.step_seconds,
                "io_lower_bound_seconds": io_bound,
                "vs_bound": r.step_seconds / floor,
                "traffic_per_step": r.traffic,
                "steps": r.steps,
            }
        )
    return report
