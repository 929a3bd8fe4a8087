"""The ecosystem's training loops run an offloaded model unchanged.

``transformers.Trainer`` (default clipping at 1.0, gradient accumulation,
grad-norm logging, an LR schedule) and a plain Accelerate loop train an
offloaded Llama with ``CPUAdam``; the reference is the same loop on the plain
model with ``torch.optim.AdamW`` (single-tensor). The tolerance is measured in
the same test: how far torch's own fused AdamW lands from its single-tensor
AdamW on the same loop.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import config, global_rel_error, tiny_llama

import infinity
from infinity.optim import CPUAdam

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

VOCAB = 128
STEPS = 3
ACCUM = 2
BATCH = 2
LR = 1e-3
NOISE_MULTIPLE = 4  # the offloaded error may be a few times torch's fused-vs-single noise


def _samples(n: int = STEPS * ACCUM * BATCH, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "cpu_adam":
        return CPUAdam(model.parameters(), lr=LR, weight_decay=0.1)
    fused = kind == "fused"
    return torch.optim.AdamW(
        model.parameters(),
        lr=LR,
        weight_decay=0.1,
        fused=fused,
        foreach=False if not fused else None,
    )


def _models() -> dict[str, torch.nn.Module]:
    """The reference (single-tensor AdamW), the noise probe (fused AdamW), and ours."""
    base = tiny_llama(VOCAB, hidden=32, tie=True)
    offloaded = infinity.offload(
        copy.deepcopy(base), config(device_memory="64KiB", chunk_size="16KiB")
    )
    return {"single": base, "fused": copy.deepcopy(base), "cpu_adam": offloaded}


def _check_against_noise(models: dict[str, torch.nn.Module]) -> tuple[float, float]:
    noise = global_rel_error(models["fused"], models["single"])
    ours = global_rel_error(models["cpu_adam"], models["single"])
    assert 0 < noise < 1e-5, noise  # the probe measured something, and it is rounding
    assert ours <= NOISE_MULTIPLE * noise, (ours, noise)
    return ours, noise


def _train_with_trainer(
    model, kind: str, out_dir, steps: int = STEPS, resume: str | None = None, **kw
) -> list[float]:
    opt = _optimizer(kind, model)
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, steps)
    kw.setdefault("save_strategy", "no")
    args = transformers.TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **kw,
    )
    assert args.max_grad_norm == 1.0  # the default: clipping is on
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=_samples(steps * ACCUM * BATCH),
        optimizers=(opt, sched),
    )
    trainer.train(resume_from_checkpoint=resume)
    return [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]


def test_transformers_trainer_matches_adamw(tmp_path):
    models = _models()
    norms = {kind: _train_with_trainer(m, kind, tmp_path / kind) for kind, m in models.items()}
    assert len(norms["single"]) == STEPS
    assert any(n > 1.0 for n in norms["single"])  # the clip at 1.0 really scaled gradients
    assert norms["cpu_adam"] == pytest.approx(norms["single"], rel=1e-5)
    _check_against_noise(models)


def test_trainer_resumes_from_its_own_checkpoint_like_uninterrupted_adamw(tmp_path):
    """The Trainer's checkpoint (model.state_dict + optimizer.state_dict) keeps the
    offloaded Adam moments: resuming lands where uninterrupted AdamW does."""
    steps = 4
    models = _models()
    for kind in ("single", "fused"):
        _train_with_trainer(models[kind], kind, tmp_path / kind, steps)
    first = _models()["cpu_adam"]
    _train_with_trainer(
        first, "cpu_adam", tmp_path / "a", steps, save_strategy="steps", save_steps=2
    )
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").exists()
    _train_with_trainer(models["cpu_adam"], "cpu_adam", tmp_path / "b", steps, str(checkpoint))
    _check_against_noise(models)


def _train_without_optimizer(model, trainer_class, out_dir, **kw) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=BATCH, max_steps=STEPS,
        learning_rate=LR, weight_decay=0.1, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, save_strategy="no", **kw,
    )  # fmt: skip
    trainer_class(model=model, args=args, train_dataset=_samples()).train()


def test_our_trainer_without_an_optimizer_trains_with_cpu_adam_like_adamw(tmp_path):
    """``transformers.Trainer`` built without an optimizer made torch's AdamW, which cannot
    step an offloaded model; ours makes CPUAdam from the same arguments and param groups
    (weight decay on the matrices only). The reference is the plain model in the Trainer
    with its default (fused AdamW); the noise, its foreach AdamW against that."""
    from infinity.integrations.hf_trainer import Trainer

    models = _models()  # "single": the reference here, "fused": the noise probe
    _train_without_optimizer(models["single"], transformers.Trainer, tmp_path / "a")
    _train_without_optimizer(
        models["fused"], transformers.Trainer, tmp_path / "b", optim="adamw_torch"
    )
    _train_without_optimizer(models["cpu_adam"], Trainer, tmp_path / "c")
    _check_against_noise(models)
    with pytest.raises(ValueError, match=r"optim='adafactor'\) cannot step an offloaded model"):
        _train_without_optimizer(_models()["cpu_adam"], Trainer, tmp_path / "d", optim="adafactor")


def _train_with_accelerate(model, kind: str) -> list[float]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    opt = _optimizer(kind, model)
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, STEPS)
    loader = torch.utils.data.DataLoader(_samples(), batch_size=BATCH)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    model.train()
    norms = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            sched.step()
            opt.zero_grad()
    return norms


def test_accelerate_loop_matches_adamw():
    models = _models()
    norms = {kind: _train_with_accelerate(m, kind) for kind, m in models.items()}
    assert len(norms["single"]) == STEPS
    assert any(n > 0.5 for n in norms["single"])
    assert norms["cpu_adam"] == pytest.approx(norms["single"], rel=1e-5)
    _check_against_noise(models)


def test_gradient_checkpointing_turned_on_after_offload_is_refused_where_the_slots_are_short():
    """Turned on after offload (the Trainer does it with gradient_checkpointing=True), a
    recomputed block had no room planned: at 16 slots of 16 KiB, one short of a block
    and its gradient, backward ran out of device slots (PoolExhausted); turned on before
    offload, the same budget trains."""

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        shape = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(shape)

    budget = config(device_memory="256KiB", chunk_size="16KiB")
    kwargs = {"use_reentrant": False}
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model = infinity.offload(llama(), budget)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    with torch.no_grad():
        model(input_ids=ids)  # nothing recomputed without a backward
    with pytest.raises(infinity.ModelChangedError, match="bytes short"):
        model(input_ids=ids, labels=ids)
    first = llama()
    first.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    infinity.offload(first, budget)(input_ids=ids, labels=ids).loss.backward()


def test_trainer_with_gradient_checkpointing_on_a_model_that_had_it_before_offload(tmp_path):
    models = _models()
    kwargs = {"use_reentrant": False}
    for model in models.values():
        if model is not models["cpu_adam"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base = tiny_llama(VOCAB, hidden=32, tie=True)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    models["cpu_adam"] = infinity.offload(base, config(device_memory="64KiB", chunk_size="16KiB"))
    for kind, model in models.items():
        _train_with_trainer(
            model,
            kind,
            tmp_path / kind,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs=kwargs,
        )
    _check_against_noise(models)
