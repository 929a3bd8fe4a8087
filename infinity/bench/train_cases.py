"""End-to-end step time of offloaded training against plain PyTorch, in one run.

Cases (same model, same batches, same optimizer: ``--optimizer``, Adam by default):
  a. plain PyTorch in RAM with ``torch.optim.AdamW(fused=True)`` (or torch's
     counterpart of the chosen optimizer);
  b. offloaded, device budget half the parameters, everything else in RAM;
  c. offloaded, optimizer states on NVMe (parameters and gradients on the host);
  d. offloaded, everything beyond a small host budget (15% of the states) on NVMe.
c and d run with ``overlap_optimizer=True`` (this loop steps after every
backward, without clipping; at c's budget the planner then sends gradients to
NVMe instead, used from staging, and keeps optimizer states home); c0 and d0
are the same without it (the default:
the step's NVMe-bound updates trail into the next forward).
Each offloaded step time is reported as a ratio to (a) and, for the NVMe
cases, against ``max(compute time of (a), I/O lower bound)``, the lower bound
being the NVMe bytes of one step divided by the bandwidth measured in the same
run (``infinity.bench.disk``).

Ratios are *paired*: each round runs one block of every case, and the
reported ratio is the median over rounds of (case / plain) within a round.
This machine's speed drifts by 20% within a minute under other tenants'
load; cases a few seconds apart see the same drift, a median over the whole
run does not.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import infinity
from infinity.bench.disk import measure_engine
from infinity.config import AioConfig, Config
from infinity.core.plan import Plan
from infinity.models.gpt import GPT, GPTConfig, init_weights
from infinity.offload import engine_of
from infinity.optim import CPUSGD, CPUAdafactor, CPUAdam, CPULion
from infinity.runtime.budgets import plan_for
from infinity.runtime.params import ParamRegistry
from infinity.schedule.planner import NVME, PlanError

Progress = Callable[[str], None]
MakeOptimizer = Callable[[Any], torch.optim.Optimizer]


@dataclass
class CaseResult:
    """Median step time and per-step traffic of one case."""

    name: str
    description: str
    step_seconds: float
    steps: list[float] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)  # median step time of each round
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


class Runner:
    """One case, able to run one training step at a time (so cases can be interleaved)."""

    def __init__(
        self,
        name: str,
        description: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Config | None,
    ) -> None:
        self.name, self.description = name, description
        self.model, self.optimizer, self.config = model, optimizer, config
        self.times: list[float] = []
        self.rounds: list[float] = []
        self.laps: list[dict[str, float | str]] = []

    def block(self, batches: list[tuple], timed: bool) -> None:
        """Consecutive training steps; all but the first are recorded if ``timed``.

        NOTE: an offloaded step leaves writes in flight and updates queued for
        the next forward. Inside a block each recorded step pays exactly the
        leftovers of the step before it, as in a real training loop; the first
        step only sets that up, and the wait at the end (untimed) keeps one
        case's leftovers out of the next case's steps.
        """
        before = len(self.times)
        for position, batch in enumerate(batches):
            start = time.perf_counter()
            self.model(*batch).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            elapsed = time.perf_counter() - start
            if timed and position > 0:
                self.times.append(elapsed)
                if self.config is not None:
                    self.laps.append(dict(infinity.stats(self.model)["last_step"]))
        if len(self.times) > before:
            self.rounds.append(statistics.median(self.times[before:]))
        if self.config is not None:
            engine_of(self.model).synchronize()

    def result(self) -> CaseResult:
        """Median step time and mean traffic of the timed steps; releases the model."""
        traffic = {}
        if self.laps:
            numbers = [k for k, v in self.laps[0].items() if isinstance(v, float | int)]
            traffic = {
                k: statistics.mean(float(lap.get(k, 0.0)) for lap in self.laps) for k in numbers
            }
        if self.config is not None:
            engine_of(self.model).close()
        return CaseResult(
            self.name,
            self.description,
            statistics.median(self.times),
            self.times,
            self.rounds,
            traffic,
            self.config.to_dict() if self.config is not None else None,
        )


# --optimizer: name -> (the infinity optimizer, plain PyTorch's, its description).
# torch has no Lion: the plain case then runs AdamW, which costs about the same.
OPTIMIZERS: dict[str, tuple[MakeOptimizer, MakeOptimizer, str]] = {
    "adam": (
        lambda ps: CPUAdam(ps, lr=1e-4),
        lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
        "AdamW(fused=True)",
    ),
    "adafactor": (
        lambda ps: CPUAdafactor(ps, lr=1e-2),
        lambda ps: torch.optim.Adafactor(ps, lr=1e-2, foreach=True),
        "Adafactor(foreach=True)",
    ),
    "lion": (
        lambda ps: CPULion(ps, lr=3e-5),
        lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
        "AdamW(fused=True)",
    ),
    "sgd": (
        lambda ps: CPUSGD(ps, lr=1e-2, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
        "SGD(foreach=True)",
    ),
}


def plain_runner(cfg: GPTConfig, optimizer: str = "adam") -> Runner:
    """Case (a): the model and torch's optimizer (AdamW(fused=True) for Adam) in RAM."""
    model = _model(cfg)
    _ours, make, label = OPTIMIZERS[optimizer]
    return Runner("a", f"plain PyTorch, {label}", model, make(model.parameters()), None)


def offloaded_runner(
    name: str, description: str, cfg: GPTConfig, config: Config, optimizer: str = "adam"
) -> Runner:
    """One offloaded case, stepped by the infinity optimizer named ``optimizer``."""
    model = infinity.offload(_model(cfg), config)
    opt = OPTIMIZERS[optimizer][0](model.parameters())
    return Runner(name, description, model, opt, config)


def host_budget_for(cfg: GPTConfig, base: Config, wanted: Callable[[Plan], bool]) -> int:
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


def nvme_budgets(cfg: GPTConfig, nvme: Config) -> tuple[int, int]:
    """The host budgets of cases c/c0 and d/d0: the smallest that keeps parameters
    and gradients in RAM (optimizer states on NVMe), and the "small" one, 15% of
    AdamW's model states (at least what staging needs)."""
    optim_only = host_budget_for(
        cfg, nvme, lambda p: NVME not in p.param_home and NVME not in p.grad_home
    )
    small = max(host_budget_for(cfg, nvme, lambda p: True), cfg.num_params * 16 * 15 // 100)
    return optim_only, small


def run_all(
    cfg: GPTConfig,
    *,
    batch: int,
    steps: int,
    warmup: int,
    nvme_dir: str,
    block: int = 4,
    progress: Progress | None = None,
    optimizer: str = "adam",
) -> dict:
    """Every case plus the NVMe bandwidth of ``nvme_dir``; a JSON-ready report.

    The cases run in interleaved blocks of ``block`` consecutive steps
    (a, b, c, d, then b, c, d, a, ...: the order rotates so that no case
    always follows the same one) so that a burst of load from elsewhere on
    the machine hits every case alike, while inside a block each step
    overlaps its own successor as in a real training loop (see
    :meth:`Runner.block`); a block times ``block - 1`` steps. Ratios are
    paired per round (see the module note). ``optimizer`` names the optimizer of
    every case (:data:`OPTIMIZERS`); the budgets are the same for all of them.
    """
    note = progress or (lambda _msg: None)
    if block < 2:
        raise ValueError(f"block={block} must be >= 2 (the first step of a block is not timed)")
    rounds = -(-steps // (block - 1))
    warm_rounds = -(-warmup // block) if warmup else 0
    data = _batches(cfg, batch, (rounds + warm_rounds) * block)
    param_bytes = cfg.num_params * 4
    base = Config(device="cpu", dtype="fp32", device_memory=param_bytes // 2)
    with tempfile.TemporaryDirectory(dir=nvme_dir) as tmp:
        nvme = base.replace(nvme_path=tmp)
        optim_only, small = nvme_budgets(cfg, nvme)
        overlap = {"overlap_optimizer": True}  # the loop below steps after every backward
        note("building the cases")
        offloaded = [
            ("b", "offloaded, device = 1/2 params, rest in RAM", base),
            (
                "c",
                "c0's host budget, optimizer overlapped with backward (gradients leave first)",
                nvme.replace(host_memory=optim_only, **overlap),
            ),
            ("c0", "as c, step after backward (default)", nvme.replace(host_memory=optim_only)),
            (
                "d",
                "small host budget, rest on NVMe, optimizer overlapped",
                nvme.replace(host_memory=small, **overlap),
            ),
            ("d0", "as d, step after backward (default)", nvme.replace(host_memory=small)),
        ]
        runners = [plain_runner(cfg, optimizer)] + [
            offloaded_runner(name, about, cfg, conf, optimizer) for name, about, conf in offloaded
        ]
        for r in range(rounds + warm_rounds):
            warm = r < warm_rounds
            note(f"round {r + 1} of {rounds + warm_rounds}" + (" (warm-up)" if warm else ""))
            turn = r % len(runners)
            for runner in runners[turn:] + runners[:turn]:
                runner.block(data[r * block : (r + 1) * block], timed=not warm)
        results = [r.result() for r in runners]
        plain = results[0]
        note("NVMe bandwidth")
        size = min(1 << 30, max(256 << 20, param_bytes * 2))
        bw = measure_engine(tmp, size, AioConfig())
    read_bps, write_bps = bw.read_gbps * 1e9, bw.write_gbps * 1e9
    report: dict[str, Any] = {
        "model": f"GPT {cfg.layers}x{cfg.hidden}",
        "optimizer": optimizer,
        "params": cfg.num_params,
        "batch": batch,
        "seq_len": cfg.seq_len,
        "nvme_read_gbps": bw.read_gbps,
        "nvme_write_gbps": bw.write_gbps,
        "cases": [],
    }
    for case in results:
        io_bound = (
            case.traffic.get("nvme_read_bytes", 0) / read_bps
            + case.traffic.get("nvme_write_bytes", 0) / write_bps
        )
        pairs = list(zip(case.rounds, plain.rounds, strict=True))
        bound_ratios = [mine / max(p, io_bound) for mine, p in pairs]
        report["cases"].append(
            {
                "case": case.name,
                "description": case.description,
                "step_seconds": case.step_seconds,
                "vs_plain": statistics.median(mine / p for mine, p in pairs),
                "io_lower_bound_seconds": io_bound,
                "vs_bound": statistics.median(bound_ratios),
                "round_ratios": [mine / p for mine, p in pairs],
                "bound_round_ratios": bound_ratios,
                "traffic_per_step": case.traffic,
                "steps": case.steps,
            }
        )
    return report
