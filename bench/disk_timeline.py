"""Where in a step the disk works: forward, backward and ``optimizer.step()``, each against its
disk busy time.

python bench/disk_timeline.py --nvme-path DIR [--params 2B --vocab 128256 --dtype fp32
    --optimizer-state-dtype int8 --seq-len 16 --steps 4]

The model and budgets of ``infinity bench scale`` (a ``transformers`` Llama of
:mod:`infinity.bench.scale_run` built under ``init_empty``, states beyond
RAM on NVMe), trained with one repeated batch. At each phase boundary it reads
the engine's counters: NVMe bytes, the time spent waiting on NVMe, and the
swap file's busy clock (``nvme_busy_seconds``: the time a transfer was in
flight). A phase whose busy time is far below its wall time computes while the
disk idles; one whose busy time is close to it is bound by the disk.

NOTE: with the default step, ``optimizer.step()`` only queues the updates of
chunks whose states are on NVMe; they run in the next forward, as its hooks
first touch each chunk (``runtime/update_queue.py``), so "forward" holds the
updates' reads, Adam and write-backs too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import infinity
from infinity.bench.scale import parse_count, scale_config
from infinity.bench.scale_run import _init_weights, pick_shape
from infinity.bench.step_profile import cpu_delta, thread_cpu
from infinity.offload import engine_of
from infinity.optim import CPUAdam

PHASES = ("forward", "backward", "step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--params", default="2B")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--optimizer-state-dtype", default="int8", choices=("fp32", "bf16", "int8"))
    parser.add_argument("--overlap-optimizer", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--device-memory", default="3GiB")
    parser.add_argument("--host-memory", default="4GiB")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="steps (the first warms up)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import transformers

    shape = pick_shape(vocab=args.vocab, dtype=args.dtype, max_params=parse_count(args.params))
    config = scale_config(args)
    print(f"... building and offloading {shape.describe()}", file=sys.stderr, flush=True)
    with infinity.init_empty():
        model = transformers.LlamaForCausalLM(shape.llama_config(args.seq_len))
    model = infinity.offload(model, config, init=_init_weights(model))
    engine = engine_of(model)
    traffic = engine.manager.traffic
    optimizer = CPUAdam(model.parameters(), lr=1e-4)
    tokens = torch.randint(
        0, shape.vocab, (1, args.seq_len), generator=torch.Generator().manual_seed(0)
    ).to(config.device)

    def mark() -> dict[str, float]:
        if config.device.startswith("cuda"):
            torch.cuda.synchronize()  # the phase's GPU work belongs to the phase
        return {"t": time.perf_counter(), **traffic.snapshot()}

    steps = []
    try:
        for i in range(args.steps):
            print(f"... step {i + 1} of {args.steps}", file=sys.stderr, flush=True)
            cpu0 = thread_cpu()
            marks = [mark()]
            loss = model(input_ids=tokens, labels=tokens).loss
            marks.append(mark())
            loss.backward()
            marks.append(mark())
            optimizer.step()
            optimizer.zero_grad()
            marks.append(mark())
            step = {"loss": float(loss.detach()), "cpu_seconds": cpu_delta(cpu0, thread_cpu())}
            for name, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True):
                step[name] = {
                    "seconds": b["t"] - a["t"],
                    "busy_seconds": b["nvme_busy_seconds"] - a["nvme_busy_seconds"],
                    "wait_nvme_seconds": b["wait_nvme_seconds"] - a["wait_nvme_seconds"],
                    "read_bytes": b["nvme_read_bytes"] - a["nvme_read_bytes"],
                    "write_bytes": b["nvme_write_bytes"] - a["nvme_write_bytes"],
                }
            steps.append(step)
    finally:
        engine.close()
    timed = steps[1:] or steps
    print(
        f"{shape.describe()}, {args.dtype}, moments {args.optimizer_state_dtype}"
        f"{', overlapped step' if args.overlap_optimizer else ''}, batch 1 x {args.seq_len}: "
        f"median of steps 2-{len(steps)}"
    )
    print(f"{'phase':<10}{'wall s':>8}{'disk busy s':>13}{'idle s':>8}{'NVMe wait s':>13}"
          f"{'read GB':>9}{'written GB':>12}{'GB/s busy':>11}")  # fmt: skip
    for name in (*PHASES, "total"):

        def med(key: str, name: str = name) -> float:
            if name == "total":
                return statistics.median(sum(s[p][key] for p in PHASES) for s in timed)
            return statistics.median(s[name][key] for s in timed)

        wall, busy = med("seconds"), med("busy_seconds")
        read, written = med("read_bytes") / 1e9, med("write_bytes") / 1e9
        # NOTE: bytes count when a transfer starts: a phase of a few ms that
        # starts reads (step() prefetching) has no meaningful rate.
        rate = f"{(read + written) / busy:.2f}" if busy >= 0.1 else "-"
        wait = med("wait_nvme_seconds")
        print(f"{name:<10}{wall:>8.2f}{busy:>13.2f}{wall - busy:>8.2f}"
              f"{wait:>13.2f}{read:>9.2f}{written:>12.2f}{rate:>11}")  # fmt: skip
    cpu = {
        k: statistics.median(s["cpu_seconds"].get(k, 0.0) for s in timed)
        for k in timed[0]["cpu_seconds"]
    }
    print("CPU seconds per step by thread: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
    if args.json:
        print(json.dumps({"model": shape.describe(), "args": vars(args), "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
