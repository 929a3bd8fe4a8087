"""A ``transformers.Trainer`` job on an offloaded Llama, as a user runs it (``torchrun`` or not).

``python trainer_job.py OUT --batch B --accumulation A [--steps 3] [--nvme DIR]``, alone or
under ``torchrun --nproc-per-node N``: the Trainer (clipping at 0.5, a linear
schedule, ``CPUAdam``) trains ``--steps`` steps of a small ``transformers`` Llama that
``infinity.offload`` holds; rank 0 saves the fp32 weights (the masters) and the
logged losses to OUT (``torch.save``). Used by ``test_trainer_torchrun.py``.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from engine_helpers import tiny_llama

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.runtime.state_access import read_params

VOCAB, STEPS, SEQ = 128, 3, 16


def samples(n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` random token rows (the same on every rank and every run)."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(n)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def main() -> None:
    """Train, then save rank 0's weights and losses."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--accumulation", type=int, required=True)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--nvme", default=None)
    args = p.parse_args()
    model = tiny_llama(VOCAB, hidden=32)  # seeded: the same weights in every run
    training = transformers.TrainingArguments(
        output_dir=args.out + ".trainer",
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        max_grad_norm=0.5,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
    )
    # NOTE: after TrainingArguments, as a user writes it: under torchrun that is
    # what initialises the process group, and offload() then shards over it.
    budget = {"host_memory": "96KiB", "nvme_path": args.nvme} if args.nvme else {}
    model = infinity.offload(
        model, infinity.Config(device="cpu", dtype="fp32", chunk_size="16KiB", **budget)
    )
    opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = transformers.get_linear_schedule_with_warmup(
        opt, 1, STEPS
    )  # same lr per step whatever --steps
    world = max(1, training.world_size)
    trainer = transformers.Trainer(
        model=model,
        args=training,
        train_dataset=samples(args.steps * args.batch * args.accumulation * world),
        optimizers=(opt, sched),
    )
    trainer.train()
    engine = engine_of(model)
    state = {e.name: v for e, v in read_params(engine, engine.registry.entries, master=True)}
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    if training.process_index == 0:
        torch.save({"state": state, "losses": losses, "world": world}, args.out)
    engine.close()


if __name__ == "__main__":
    main()
