"""``transformers.Trainer`` checkpoints of an offloaded model, streamed (issue 28).

``infinity.integrations.hf_trainer.Trainer`` writes each ``checkpoint-N`` with
``infinity.save_pretrained`` (weights ``transformers`` loads) and
``infinity.save_checkpoint`` (masters, moments), and resumes from them. The
reference for "resumes exactly" is the same job run without interruption:
the weights after 4 steps must be bit-identical whether the run stopped after
step 2 and resumed from ``checkpoint-2`` or not.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import tiny_llama

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.runtime.state_access import read_params

transformers = pytest.importorskip("transformers")
hf_trainer = pytest.importorskip("infinity.integrations.hf_trainer")

VOCAB, STEPS = 128, 4


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True  # as if the job were killed after its save


def _samples() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (16,), generator=g) for _ in range(STEPS * 4)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _run(model, out, resume: str | None = None, stop: int | None = None, **kw):
    opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, STEPS)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=STEPS, max_grad_norm=0.5, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, logging_steps=1, **kw,
    )  # fmt: skip
    trainer = hf_trainer.Trainer(
        model=model,
        args=args,
        train_dataset=_samples(),
        optimizers=(opt, sched),
        callbacks=[_StopAt(stop)] if stop else [],
    )
    trainer.train(resume_from_checkpoint=resume)
    engine = engine_of(model)
    return {e.name: v for e, v in read_params(engine, engine.registry.entries, master=True)}


def _offloaded(base, tmp_path, name):
    cfg = infinity.Config(
        device="cpu", dtype="bf16", chunk_size="16KiB", device_memory="96KiB",
        host_memory="160KiB", nvme_path=str(tmp_path / f"nvme-{name}"),
    )  # fmt: skip
    return infinity.offload(copy.deepcopy(base), cfg)


def test_streamed_checkpoint_resumes_bit_exactly(tmp_path):
    base = tiny_llama(VOCAB, hidden=32, tie=True)
    whole = _run(_offloaded(base, tmp_path, "whole"), tmp_path / "whole", save_strategy="no")
    first = _offloaded(base, tmp_path, "first")
    stopped = _run(first, tmp_path / "run", stop=2, save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "infinity" / "meta.json").exists()
    assert not (checkpoint / "optimizer.pt").exists()  # no copy of the moments in RAM
    # The weights in the checkpoint folder load in transformers, as the Trainer's do.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    for name, value in loaded.state_dict().items():
        if name in stopped:
            assert torch.equal(value, stopped[name].to(value.dtype)), name
    resumed = _run(
        _offloaded(base, tmp_path, "resumed"), tmp_path / "run", resume=str(checkpoint),
        save_strategy="no",
    )  # fmt: skip
    moved = max(float((whole[k] - stopped[k]).abs().max()) for k in whole)
    assert moved > 0  # steps 3 and 4 changed the weights
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name


def test_final_save_model_streams_into_a_folder_that_holds_other_files(tmp_path):
    base = tiny_llama(VOCAB, hidden=32)
    model = _offloaded(base, tmp_path, "m")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("kept")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    trainer = hf_trainer.Trainer(model=model, args=args)
    trainer.save_model()
    assert (tmp_path / "out" / "notes.txt").read_text() == "kept"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ours = model.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, ours[name].to(value.dtype)), name
