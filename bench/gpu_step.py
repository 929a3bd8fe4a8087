"""Step time on a GPU: infinity with states on host and on NVMe against plain PyTorch, in one run.

python bench/gpu_step.py [--layers 16 --hidden 1024 --vocab 32000 --batch 4 --seq 512
                          --steps 4 --warmup 2 --nvme-path /tmp/infinity-gpu-step --json]
                         [--device cpu]  (a smoke run of the script itself, no GPU)

Needs a CUDA GPU (issue 29 part 4: run where one is lent). A ``transformers``
Llama (bf16 compute) trains ``--warmup`` + ``--steps`` steps three ways on the
same batches:

- ``plain``: the model in fp32 on the GPU, ``torch.autocast`` bf16, fused
  ``torch.optim.AdamW`` on the GPU (what a user runs when the model fits);
- ``host``: infinity with ``device_memory`` a quarter of the bf16 parameters (at least
  three times the embedding)
  and every state in pinned host memory, ``CPUAdam`` on the host;
- ``nvme``: the same with ``host_memory`` a quarter of the host states, the
  rest on NVMe under ``--nvme-path``.

Per row: the median step time (``torch.cuda.synchronize`` around each step) and
its ratio to ``plain``; for infinity, the bytes copied host->device and
device->host per step (``infinity.stats``) against the plan's estimate
(``Plan.traffic``, what ``infinity plan`` prints), NVMe bytes per step, peak GPU
memory (``torch.cuda.max_memory_allocated``) and the final loss against
``plain``'s (the three must train alike).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.utils.sizes import format_size

LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1
COUNTERS = ("h2d_bytes", "d2h_bytes", "nvme_read_bytes", "nvme_write_bytes")


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
    step: Callable[[torch.Tensor], float], data: list[torch.Tensor], warmup: int, device: str
):
    times, losses = [], []
    for k, ids in enumerate(data):
        _sync(device)
        start = time.perf_counter()
        losses.append(step(ids))
        _sync(device)
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return (statistics.median(times) if times else float("nan")), losses


@contextlib.contextmanager
def _profiled(args: argparse.Namespace, row: str) -> Iterator[None]:
    """With ``--profile DIR``: torch.profiler over the row's timed steps, its top ops to a file."""
    if not args.profile:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        yield
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    Path(args.profile, f"profile_{row}.txt").write_text(table)


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
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    _reset_peak(args.device)
    seconds, losses = _timed(step, data, args.warmup, args.device)
    return {"seconds": seconds, "loss": losses[-1], "gpu_peak": _peak(args.device)}


def run_offloaded(
    args: argparse.Namespace,
    data: list[torch.Tensor],
    nvme: bool,
    overlap: bool = False,
    eager: bool = False,
) -> dict:
    """infinity on the GPU: states on host, or beyond a small host budget on NVMe;
    ``overlap``: each chunk's update runs during backward (``overlap_optimizer``);
    ``eager``: host-homed updates run inside ``optimizer.step()`` rather than
    behind the next forward (NOTE [host updates behind the forward]), for an A/B
    in one run."""
    model = build(args)
    n = sum(p.numel() for p in model.parameters())
    # bf16 parameter and gradient, fp32 master and two fp32 moments
    host_states = n * (2 + 2 + 4 + 8)
    folder = tempfile.mkdtemp(prefix="gpu-step-", dir=args.nvme_path) if nvme else None
    cfg = infinity.Config(
        device=args.device,
        dtype="bf16",
        # a quarter of the parameters, but room for the largest module (the
        # embedding or the head) with its gradient and the next block's chunks
        device_memory=max(n * 2 // 4, 3 * args.vocab * args.hidden * 2),
        host_memory=host_states // 4 if nvme else "auto",
        nvme_path=folder,
        overlap_optimizer=overlap,
    )
    _reset_peak(args.device)
    model = infinity.offload(model, cfg)
    engine = engine_of(model)
    if eager:
        engine.queue.defer_host = False
    opt = CPUAdam(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)

    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    try:
        _timed(step, data[: args.warmup], args.warmup, args.device)
        before = infinity.stats(model)
        label = ("nvme" if nvme else "host") + ("_overlap" if overlap else "")
        with _profiled(args, label + ("_eager" if eager else "")):
            seconds, losses = _timed(step, data[args.warmup :], 0, args.device)
        after = infinity.stats(model)
        per_step = {k: (after[k] - before[k]) / args.steps for k in COUNTERS}
        return {
            "seconds": seconds,
            "loss": losses[-1],
            "gpu_peak": _peak(args.device),
            "measured": per_step,
            "estimate": dict(engine.plan.traffic),
            "placement": after["placement"],
            # the last step's split: seconds waiting on device copies / NVMe, the rest
            "last_step": {k: v for k, v in after["last_step"].items() if k.endswith("seconds")},
        }
    finally:
        engine.close()
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
        help="offloaded rows beside plain: host or nvme, then +overlap and/or +eager "
        "(e.g. host,host+eager,nvme+overlap)",
    )
    p.add_argument("--profile", default="", help="folder for torch.profiler tables of each row")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA GPU here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    data = batches(args)
    n = sum(p.numel() for p in build(args).parameters())
    rows = {"plain": run_plain(args, data)}
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the plain model's memory, before infinity's peak is read
    for row in args.rows.split(","):
        tier, *mods = row.split("+")
        if tier not in ("host", "nvme") or not set(mods) <= {"overlap", "eager"}:
            p.error(f"--rows: {row!r} is not host or nvme with +overlap and/or +eager")
        rows[row] = run_offloaded(
            args, data, nvme=tier == "nvme", overlap="overlap" in mods, eager="eager" in mods
        )
    if args.json:
        print(json.dumps({"params": n, "args": vars(args), "rows": rows}, indent=1))
        return 0
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"{where}: Llama {n / 1e6:.0f}M params, "
        f"batch {args.batch} x {args.seq}, median of {args.steps} steps"
    )
    base = rows["plain"]["seconds"]
    print(
        f"{'row':<20} {'step s':>8} {'x plain':>8} {'loss':>8} {'GPU peak':>10}  PCIe/step (plan)"
    )
    for name, row in rows.items():
        line = (
            f"{name:<20} {row['seconds']:8.3f} {row['seconds'] / base:8.2f} {row['loss']:8.4f} "
            f"{format_size(row['gpu_peak']):>10}"
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
            line += (
                f"; waits: device {t.get('wait_device_seconds', 0.0):.3f} s, "
                f"nvme {t.get('wait_nvme_seconds', 0.0):.3f} s"
            )
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
