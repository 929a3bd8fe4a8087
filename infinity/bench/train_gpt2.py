"""GPT-2 124M step time: plain PyTorch vs infinity (default, and overlapped step).

``transformers`` ``GPT2LMHeadModel`` (fp32, the 124M default config, tied
50257 x 768 embedding), batch 4 x 256, device 512 MiB, host 1 GiB, optimizer
states and more on NVMe. Cases:

- ``plain``: the model and ``torch.optim.AdamW(fused=True)`` in RAM;
- ``default``: offloaded with the default step (NVMe-bound updates trail into
  the next forward);
- ``overlap``: offloaded with ``overlap_optimizer=True``.

Each case runs in **its own process** (spawned, so nothing is shared:
allocator, thread pools, page cache of the model), and the parent interleaves
them: each round runs one block of every case in a rotating order, and a ratio
is the median over rounds of (case / plain) within the round. The processes
not running sit blocked on their pipe (no CPU), so on this machine the case
running has the cores to itself, up to other tenants' load.

Each block also reports where the time went (see :mod:`infinity.bench.step_profile`).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

CASES = {
    "plain": "plain PyTorch in RAM, AdamW(fused=True)",
    "default": "infinity, default step (NVMe updates trail into the next forward)",
    "overlap": "infinity, overlap_optimizer=True",
}
VOCAB = 50257


def batch_of(round_index: int, position: int, batch: int, seq_len: int) -> torch.Tensor:
    """The token ids of one step: a pure function of its place in the run (same in every case)."""
    g = torch.Generator().manual_seed(round_index * 1000 + position)
    return torch.randint(0, VOCAB, (batch, seq_len), generator=g)


def _build(case: str, settings: dict[str, Any], nvme_dir: str) -> tuple[Any, Any, Any]:
    import transformers

    import infinity
    from infinity.bench.step_profile import EngineProfile
    from infinity.optim import CPUAdam

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    model.train()
    if case == "plain":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), None
    profile = EngineProfile()
    profile.install()
    config = infinity.Config(
        device="cpu",
        dtype="fp32",
        device_memory=settings["device_memory"],
        host_memory=settings["host_memory"],
        nvme_path=nvme_dir,
        overlap_optimizer=case.startswith("overlap"),
    )
    if "@" in case:  # the case with another aio.block_size
        config = config.replace(aio={**vars(config.aio), "block_size": case.split("@")[1]})
    offloaded = infinity.offload(model, config)
    return offloaded, CPUAdam(offloaded.parameters(), lr=1e-4), profile


def _block(
    model: Any, optimizer: Any, profile: Any, batches: list[torch.Tensor], batch: bool
) -> dict:
    """Consecutive steps; every step but the first is recorded (see train_cases.Runner.block)."""
    import infinity
    from infinity.bench.step_profile import batch_native_threads, cpu_delta, thread_cpu

    if batch:
        batch_native_threads()  # again each block: the Adam pool starts at the first step
    steps: list[dict[str, Any]] = []
    for position, ids in enumerate(batches):
        cpu_before = thread_cpu()
        if profile is not None:
            profile.take()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        end = time.perf_counter()
        if position == 0:
            continue
        record: dict[str, Any] = {
            "seconds": end - start,
            "fwd_bwd_seconds": middle - start,
            "step_seconds": end - middle,
            "thread_cpu": cpu_delta(cpu_before, thread_cpu()),
        }
        if profile is not None:
            record["engine"] = profile.take()
            record["traffic"] = dict(infinity.stats(model)["last_step"])
        steps.append(record)
    if profile is not None:
        from infinity.offload import engine_of

        engine_of(model).synchronize()  # one case's leftovers stay out of the next case
    return {"steps": steps}


def _worker(conn: Connection, case: str, settings: dict[str, Any]) -> None:
    """Child process: build the case, then run blocks on request until told to stop."""
    torch.set_num_threads(settings["threads"])
    with tempfile.TemporaryDirectory(dir=settings["nvme_dir"]) as tmp:
        try:
            model, optimizer, profile = _build(case, settings, tmp)
            conn.send({"ok": True})
        except Exception as exc:  # reported by the parent, with the case's name
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            return
        while True:
            message = conn.recv()
            if message is None:
                break
            round_index, n = message
            batches = [
                batch_of(round_index, i, settings["batch"], settings["seq_len"]) for i in range(n)
            ]
            conn.send(_block(model, optimizer, profile, batches, case.endswith("+batch")))
        if profile is not None:
            from infinity.offload import engine_of

            engine_of(model).close()


def _receive(conn: Connection, case: str) -> Any:
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"the process of case {case} died (see its traceback above)") from None


def _median_breakdown(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step medians of every number a case's steps recorded."""

    out: dict[str, Any] = {
        k: statistics.median(s[k] for s in steps)
        for k in ("seconds", "fwd_bwd_seconds", "step_seconds")
    }
    for section in ("thread_cpu", "engine", "traffic"):
        keys = sorted({k for s in steps for k in s.get(section, {})})
        if keys:
            out[section] = {
                k: statistics.median(s.get(section, {}).get(k, 0.0) for s in steps) for k in keys
            }
    return out


def run_gpt2(
    *,
    batch: int = 4,
    seq_len: int = 256,
    device_memory: str = "512MiB",
    host_memory: str = "1GiB",
    rounds: int = 5,
    warmup_rounds: int = 1,
    block: int = 4,
    threads: int | None = None,
    compare_block_size: str | None = None,
    compare_sched_batch: bool = False,
    nvme_dir: str,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the three cases interleaved, one process each; a JSON-ready report.

    ``compare_block_size`` (e.g. ``"1M"``) adds a fourth case, ``default@1M``:
    the default step with that ``aio.block_size``. ``compare_sched_batch`` adds
    ``default+batch``: the default case with the engine's native threads under
    ``SCHED_BATCH`` (see :func:`~infinity.bench.step_profile.batch_native_threads`).
    """
    note = progress or (lambda _msg: None)
    if block < 2:
        raise ValueError(f"block={block} must be >= 2 (the first step of a block is not timed)")
    settings = {
        "batch": batch,
        "seq_len": seq_len,
        "device_memory": device_memory,
        "host_memory": host_memory,
        "nvme_dir": nvme_dir,
        "threads": threads or torch.get_num_threads(),
    }
    cases = dict(CASES)
    if compare_block_size is not None:
        cases[f"default@{compare_block_size}"] = f"as default, aio.block_size={compare_block_size}"
    if compare_sched_batch:
        cases["default+batch"] = "as default, native threads SCHED_BATCH"
    ctx = mp.get_context("spawn")
    workers: dict[str, tuple[Any, Connection]] = {}
    try:
        for case in cases:
            note(f"building case {case} in its own process")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, case, settings), daemon=True)
            proc.start()
            child.close()
            reply = _receive(parent, case)
            if not reply["ok"]:
                raise RuntimeError(f"case {case} failed to build: {reply['error']}")
            workers[case] = (proc, parent)
        names = list(cases)
        per_round: dict[str, list[float]] = {c: [] for c in names}
        steps: dict[str, list[dict]] = {c: [] for c in names}
        load: list[float] = []
        for r in range(warmup_rounds + rounds):
            warm = r < warmup_rounds
            note(f"round {r + 1} of {warmup_rounds + rounds}" + (" (warm-up)" if warm else ""))
            turn = r % len(names)
            for case in names[turn:] + names[:turn]:
                conn = workers[case][1]
                conn.send((r, block))
                result = _receive(conn, case)
                if not warm:
                    per_round[case].append(statistics.median(s["seconds"] for s in result["steps"]))
                    steps[case].extend(result["steps"])
            if not warm:
                with open("/proc/loadavg") as f:
                    load.append(float(f.read().split()[0]))
    finally:
        for _proc, conn in workers.values():
            try:
                conn.send(None)
            except OSError:
                pass
        for proc, _conn in workers.values():
            proc.join(timeout=120)
            if proc.is_alive():
                proc.terminate()
    plain = per_round["plain"]
    report: dict[str, Any] = {
        "model": "transformers GPT2LMHeadModel 124M (fp32)",
        "batch": batch,
        "seq_len": seq_len,
        "device_memory": device_memory,
        "host_memory": host_memory,
        "rounds": rounds,
        "block": block,
        "torch_threads": settings["threads"],
        "load_average": load,
        "cases": [],
    }
    for case in names:
        ratios = [mine / p for mine, p in zip(per_round[case], plain, strict=True)]
        report["cases"].append(
            {
                "case": case,
                "description": cases[case],
                "step_seconds": statistics.median(s["seconds"] for s in steps[case]),
                "vs_plain": statistics.median(ratios),
                "round_ratios": ratios,
                "breakdown": _median_breakdown(steps[case]),
            }
        )
    return report
