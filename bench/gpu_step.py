"""Step time on a GPU: infinity with states on host and on NVMe against plain PyTorch, in one run.

python bench/gpu_step.py [--layers 16 --hidden 1024 --vocab 32000 --batch 4 --seq 512
                          --steps 4 --warmup 2 --nvme-path /tmp/infinity-gpu-step --json]
                         [--rows host,nvme+overlap,host+overlap@params+half] [--clip 1.0]
                         [--state-dtype fp32] [--device cpu]  (cpu: a smoke run, no GPU)

Needs a CUDA GPU (issue 29 part 4: run where one is lent). A ``transformers``
Llama (bf16 compute) trains ``--warmup`` + ``--steps`` steps three ways on the
same batches:

- ``plain``: the model in fp32 on the GPU, ``torch.autocast`` bf16, fused
  ``torch.optim.AdamW`` on the GPU (what a user runs when the model fits);
- ``host``: infinity with every state in pinned host memory, ``CPUAdam`` on the host;
- ``nvme``: the same with ``host_memory`` a quarter of the host states, the
  rest on NVMe under ``--nvme-path``.

An offloaded row may add ``+overlap`` (``overlap_optimizer``), ``+eager`` and/or
``+noclip`` (no clipping in that row, whatever ``--clip`` says: what clipping costs,
issue 43 part 3), then ``@BUDGET``, its ``device_memory`` (issue 43 part 5; none: ``quarter``):

- ``quarter``: a quarter of the bf16 parameters (beyond the GPU's memory);
- ``params+half``: the bf16 parameters plus half the optimizer states' bytes
  (AdamW's fp32 master and two moments in ``--state-dtype``, as the engine sizes them);
- ``all-but-opt``: the bf16 parameters and their gradients, everything but the optimizer;
- ``all``: room for every chunk homed on the device, optimizer states too (a slot for
  every copy, the homes, and their update's scratch): what plain training holds;

where room beyond a slot for every chunk copy homes chunks on the device, stepped there
(NOTE [chunks homed on the device]; the row's ``on device`` says how many);

each at least three times the embedding (the largest module with its gradient
and the next block's chunks). ``--clip`` clips the gradients by their global
norm in every row (``torch.nn.utils.clip_grad_norm_``, ``optimizer.clip_grad_norm_``
for infinity), except where the engine refuses it: ``overlap_optimizer`` steps
chunks during backward, so its rows say ``off`` in the clip column.

Per row: the median step time (``torch.cuda.synchronize`` around each step) and
its ratio to ``plain``; for infinity, the device budget, the bound of the step
(``infinity.stats(model)["last_step"]``: the slowest resource's seconds, which one,
and step / bound, medians over the timed steps; every part in ``--json``), the bytes
copied host->device and device->host per step (``infinity.stats``) against the
plan's estimate (``Plan.traffic``, what ``infinity plan`` prints), NVMe bytes per
step, peak GPU memory (``torch.cuda.max_memory_allocated``) and the final loss
against ``plain``'s (the rows must train alike).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.optim.cpu_adam import ADAM
from infinity.utils.sizes import format_size

LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1
COUNTERS = ("h2d_bytes", "d2h_bytes", "nvme_read_bytes", "nvme_write_bytes")
BUDGETS = ("quarter", "params+half", "all-but-opt", "all")
# what infinity.stats(model)["last_step"] says of the step's bound (issue 43 part 1):
# seconds per resource, the largest, which resource it is, and the step over it
BOUND_KEYS = (
    "device_compute_seconds",
    "host_optimizer_seconds",
    "h2d_seconds",
    "d2h_seconds",
    "nvme_read_seconds",
    "nvme_write_seconds",
    "bound_seconds",
    "step_over_bound",
)
DASH = "\u2013"  # what the table prints for a value the engine does not report


@dataclass(frozen=True)
class Row:
    """One offloaded row: ``tier[+overlap][+eager][+noclip][@budget]``."""

    name: str
    nvme: bool
    overlap: bool
    eager: bool
    budget: str
    noclip: bool = False

    @classmethod
    def parse(cls, text: str) -> Row:
        """The row ``text`` names; ``ValueError`` saying what is wrong."""
        spec, _, budget = text.partition("@")
        tier, *mods = spec.split("+")
        if tier not in ("host", "nvme") or not set(mods) <= {"overlap", "eager", "noclip"}:
            raise ValueError(f"{text!r} is not host or nvme with +overlap, +eager or +noclip")
        budget = budget or "quarter"
        if budget not in BUDGETS:
            raise ValueError(f"{text!r}: the budget after @ is one of {', '.join(BUDGETS)}")
        return cls(
            text, tier == "nvme", "overlap" in mods, "eager" in mods, budget, "noclip" in mods
        )


def state_bytes(n: int, state_dtype: str) -> int:
    """Bytes of AdamW's states for ``n`` bf16 parameters as the engine sizes a unit:
    the fp32 master and both moments stored as ``state_dtype`` (12 bytes a parameter
    for fp32)."""
    return ADAM.with_state_dtype(state_dtype).unit_bytes(n, has_master=True)


def device_budget(args: argparse.Namespace, n: int, budget: str) -> int:
    """``device_memory`` of a row with ``budget`` for a model of ``n`` parameters."""
    params = n * 2  # bf16
    if budget == "quarter":
        size = params // 4
    elif budget == "params+half":
        size = params + state_bytes(n, args.state_dtype) // 2
    elif budget == "all-but-opt":  # the parameters and their (bf16) gradients
        size = params + n * 2
    else:  # all: slots for every copy (4 bytes a parameter), then every chunk homed
        size = 4 * n + 4 * n + state_bytes(n, args.state_dtype) + (64 << 20)
    # room for the largest module (the embedding or the head) with its gradient and
    # the next block's chunks
    return max(size, 3 * args.vocab * args.hidden * 2)


def medians(laps: list[dict]) -> dict:
    """The bound keys of ``laps`` (``last_step`` after each timed step): the median of
    each number, the most common ``bound_by``; None where no lap has the key."""
    out: dict = {}
    for key in BOUND_KEYS:
        values = [lap[key] for lap in laps if lap.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    names = [lap["bound_by"] for lap in laps if lap.get("bound_by") is not None]
    out["bound_by"] = collections.Counter(names).most_common(1)[0][0] if names else None
    return out


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The Llama, seeded, in fp32 on the CPU."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """Token ids of every step, on the compute device."""
    g = torch.Generator().manual_seed(1)
    shape = (args.batch, args.seq)
    n = args.warmup + args.steps
    return [torch.randint(0, args.vocab, shape, generator=g).to(args.device) for _ in range(n)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int:
    # NOTE: the CPU smoke run has no allocator statistics; 0 reads as "not measured".
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


def _timed(
    step: Callable[[torch.Tensor], float],
    data: list[torch.Tensor],
    warmup: int,
    device: str,
    after: Callable[[], None] | None = None,
):
    """Run ``step`` on each batch; the median time of those after ``warmup`` and
    every loss. ``after`` runs after each timed step, outside its time."""
    times, losses = [], []
    for k, ids in enumerate(data):
        _sync(device)
        start = time.perf_counter()
        losses.append(step(ids))
        _sync(device)
        if k >= warmup:
            times.append(time.perf_counter() - start)
            if after is not None:
                after()
    return (statistics.median(times) if times else float("nan")), losses


# Host calls that wait for the GPU: where one sits on a hook's path, the GPU idles.
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpy",
)


@contextlib.contextmanager
def _profiled(args: argparse.Namespace, row: str) -> Iterator[None]:
    """With ``--profile DIR``: torch.profiler over the row's timed steps. Written to
    ``DIR/profile_<row>.txt``: the top ops by host time, on CUDA by device time too,
    and the Python stacks of the host calls that wait for the GPU (:data:`SYNC_CALLS`)."""
    if not args.profile:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, with_stack=True) as prof:
        yield
    averages = prof.key_averages()
    parts = [
        f"# {row}: top ops by host time",
        averages.table(sort_by="self_cpu_time_total", row_limit=40),
    ]
    if args.device == "cuda":
        parts += [
            "# by device time",
            averages.table(sort_by="self_device_time_total", row_limit=25),
        ]
        waits = [e for e in prof.key_averages(group_by_stack_n=8) if e.key in SYNC_CALLS]
        waits.sort(key=lambda e: e.cpu_time_total, reverse=True)
        parts.append("# host calls that wait for the GPU, by Python stack")
        for e in waits[:15]:
            stack = "\n    ".join(e.stack)
            parts.append(f"{e.key}: {e.count} calls, {e.cpu_time_total / 1e3:.1f} ms\n    {stack}")
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{row}.txt").write_text("\n\n".join(parts) + "\n")


def run_plain(args: argparse.Namespace, data: list[torch.Tensor]) -> dict:
    """fp32 weights on the GPU, bf16 autocast, fused AdamW on the GPU."""
    model = build(args).to(args.device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True
    )

    def step(ids: torch.Tensor) -> float:
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    _reset_peak(args.device)
    seconds, losses = _timed(step, data, args.warmup, args.device)
    return {
        "seconds": seconds,
        "loss": losses[-1],
        "gpu_peak": _peak(args.device),
        "clip": args.clip if args.clip > 0 else None,
    }


def run_offloaded(args: argparse.Namespace, data: list[torch.Tensor], row: Row) -> dict:
    """infinity on the GPU: states on host, or beyond a small host budget on NVMe;
    ``overlap``: each chunk's update runs during backward (``overlap_optimizer``);
    ``eager``: host-homed updates run inside ``optimizer.step()`` rather than
    behind the next forward (NOTE [host updates behind the forward]), for an A/B
    in one run; ``budget``: the row's ``device_memory`` (:func:`device_budget`)."""
    model = build(args)
    n = sum(p.numel() for p in model.parameters())
    # bf16 parameter and gradient, then AdamW's master and moments
    host_states = n * (2 + 2) + state_bytes(n, args.state_dtype)
    if row.nvme:
        Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="gpu-step-", dir=args.nvme_path) if row.nvme else None
    device_memory = device_budget(args, n, row.budget)
    cfg = infinity.Config(
        device=args.device,
        dtype="bf16",
        device_memory=device_memory,
        host_memory=host_states // 4 if row.nvme else "auto",
        nvme_path=folder,
        overlap_optimizer=row.overlap,
        optimizer_state_dtype=args.state_dtype,
    )
    _reset_peak(args.device)
    model = infinity.offload(model, cfg)
    engine = engine_of(model)
    if row.eager:
        engine.queue.defer_host = False
    opt = CPUAdam(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    # NOTE: overlap_optimizer steps each chunk during backward, before any global norm:
    # the engine refuses clipping there (check_not_stepped_early), so those rows run
    # without it and say so.
    clip = args.clip if args.clip > 0 and not (row.overlap or row.noclip) else None

    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    laps: list[dict] = []

    def lap() -> None:
        stats = infinity.stats(model)
        laps.append({**stats["last_step"], "bound_by": stats["last_step_bound_by"]})

    try:
        _timed(step, data[: args.warmup], args.warmup, args.device)
        before = infinity.stats(model)
        label = row.name.replace("+", "_").replace("@", "_at_")
        with _profiled(args, label):
            seconds, losses = _timed(step, data[args.warmup :], 0, args.device, after=lap)
        after = infinity.stats(model)
        per_step = {k: (after[k] - before[k]) / args.steps for k in COUNTERS}
        return {
            "seconds": seconds,
            "loss": losses[-1],
            "gpu_peak": _peak(args.device),
            "clip": clip,
            "budget": row.budget,
            "device_memory": device_memory,
            # medians over the timed steps of what the engine says bounds the step
            "bound": medians(laps),
            "measured": per_step,
            "estimate": dict(engine.plan.traffic),
            "placement": after["placement"],
            # the last step's split: seconds waiting on device copies / NVMe, the rest
            "last_step": {k: v for k, v in after["last_step"].items() if k.endswith("seconds")},
        }
    finally:
        engine.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """Run the three rows and print the table (or JSON)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--rows",
        default="host,nvme",
        help="offloaded rows beside plain: host or nvme, then +overlap, +eager, +noclip, then "
        f"@budget, one of {', '.join(BUDGETS)} (default quarter) "
        "(e.g. host,host+eager,nvme+overlap,host+overlap@params+half)",
    )
    p.add_argument(
        "--clip",
        type=float,
        default=1.0,
        help="clip gradients to this global norm in every row (0: off; not with +overlap, "
        "which the engine refuses)",
    )
    p.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="how infinity stores Adam's moments (Config.optimizer_state_dtype)",
    )
    p.add_argument("--profile", default="", help="folder for torch.profiler tables of each row")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA GPU here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    try:
        offloaded = [Row.parse(text) for text in args.rows.split(",")]
    except ValueError as e:
        p.error(f"--rows: {e}")
    data = batches(args)
    n = sum(p.numel() for p in build(args).parameters())
    rows = {"plain": run_plain(args, data)}
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the plain model's memory, before infinity's peak is read
    for row in offloaded:
        rows[row.name] = run_offloaded(args, data, row)
    if args.json:
        print(json.dumps({"params": n, "args": vars(args), "rows": rows}, indent=1))
        return 0
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"{where}: Llama {n / 1e6:.0f}M params, "
        f"batch {args.batch} x {args.seq}, median of {args.steps} steps, "
        f"states {args.state_dtype}"
    )
    base = rows["plain"]["seconds"]
    width = max(len(name) for name in rows)
    print(
        f"{'row':<{width}} {'step s':>8} {'x plain':>8} {'loss':>8} {'GPU peak':>10} "
        f"{'device budget':<22} {'clip':>4} {'bound s':>8} {'bound by':<16} {'step/bd':>7}  "
        "PCIe/step (plan)"
    )
    for name, row in rows.items():
        line = (
            f"{name:<{width}} {row['seconds']:8.3f} {row['seconds'] / base:8.2f} "
            f"{row['loss']:8.4f} {format_size(row['gpu_peak']):>10} "
        )
        budget = (
            f"{row['device_memory'] / 2**30:.3g} GiB {row['budget']}"
            if "budget" in row
            else "all (plain)"
        )
        clip = f"{row['clip']:g}" if row["clip"] is not None else "off"
        bound = row.get("bound", {})
        seconds, by, over = (bound.get(k) for k in ("bound_seconds", "bound_by", "step_over_bound"))
        line += (
            f"{budget:<22} {clip:>4} "
            f"{f'{seconds:.3f}' if seconds is not None else DASH:>8} "
            f"{by if by is not None else DASH:<16} "
            f"{f'{over:.2f}' if over is not None else DASH:>7}"
        )
        if "measured" in row:
            m, e = row["measured"], row["estimate"]
            line += (
                f"  h2d {format_size(int(m['h2d_bytes']))} ({format_size(e['h2d_bytes'])}), "
                f"d2h {format_size(int(m['d2h_bytes']))} ({format_size(e['d2h_bytes'])}), "
                f"nvme r/w {format_size(int(m['nvme_read_bytes']))}/"
                f"{format_size(int(m['nvme_write_bytes']))}"
            )
            t = row["last_step"]
            homed = row["placement"]["optim"]
            line += (
                f"; on device {homed.get('device', 0)} of {sum(homed.values())} chunks"
                f"; waits: device {t.get('wait_device_seconds', 0.0):.3f} s, "
                f"nvme {t.get('wait_nvme_seconds', 0.0):.3f} s; "
                f"hooks {t.get('hook_seconds', 0.0):.3f} s, "
                f"host optimizer {t.get('host_optimizer_seconds', 0.0):.3f} s"
            )
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
