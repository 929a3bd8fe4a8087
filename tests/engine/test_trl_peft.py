"""Where fine-tuning happens: TRL's ``SFTTrainer`` and ``peft`` LoRA on an offloaded model.

Every run is compared with the same job on the plain model in the same test:
``torch.optim.AdamW`` (single-tensor) is the reference, and the tolerance is how
far torch's own fused AdamW lands from it on the same job. ``SFTTrainer``
computes its loss with a fused LM head that reads ``lm_head.weight`` without
calling the head (``runtime/hooks.py``): before that was handled, the
weight was a placeholder and the first gradient norm was NaN.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import tiny_llama

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

VOCAB, STEPS, LR = 128, 3, 3e-3


def _tokenizer():
    """A word-level tokenizer over tokens ``t0`` .. ``t127`` (no download)."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2"
    )


def _dataset():
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, VOCAB, (16,), generator=g).tolist() for _ in range(16)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def _sft(model, opt, out_dir, **overrides) -> list[float]:
    args = trl.SFTConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        max_grad_norm=0.5,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        max_length=32,
        **overrides,
    )
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, STEPS)
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        optimizers=(opt, sched),
    )
    trainer.train()
    return [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]


def _adamw(model, fused: bool = False) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=LR, fused=fused, foreach=False if not fused else None)


def _rel(ours: torch.nn.Module, ref: torch.nn.Module) -> float:
    a, b = ours.state_dict(), ref.state_dict()
    num = sum(float((a[k].double() - v.double()).pow(2).sum()) for k, v in b.items())
    return (num / sum(float(v.double().pow(2).sum()) for v in b.values())) ** 0.5


def _config(tmp_path, **kw) -> infinity.Config:
    kw.setdefault("chunk_size", "16KiB")
    return infinity.Config(device="cpu", dtype="fp32", device_memory="96KiB", **kw)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sft_trainer_full_fine_tuning_matches_plain_pytorch(tmp_path, tied):
    base = tiny_llama(VOCAB, hidden=32, tie=tied)
    ref, probe = copy.deepcopy(base), copy.deepcopy(base)
    ours = infinity.offload(copy.deepcopy(base), _config(tmp_path))
    try:
        ref_norms = _sft(ref, _adamw(ref), tmp_path / "ref")
        _sft(probe, _adamw(probe, fused=True), tmp_path / "probe")
        norms = _sft(ours, CPUAdam(ours.parameters(), lr=LR), tmp_path / "ours")
        noise = _rel(probe, ref)
        assert 0 < noise < 1e-5, noise
        assert _rel(ours, ref) <= 4 * noise, (_rel(ours, ref), noise)
        assert norms == pytest.approx(ref_norms, rel=1e-5)  # finite, and the same
    finally:
        engine_of(ours).close()


def test_sft_trainer_trains_lora_adapters_over_a_frozen_base_on_nvme(tmp_path):
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    base = tiny_llama(VOCAB, hidden=32)

    def wrapped() -> torch.nn.Module:
        torch.manual_seed(1)  # the same adapter initialisation each time
        return peft.get_peft_model(copy.deepcopy(base), lora)

    ref, probe, ours = wrapped(), wrapped(), wrapped()
    cfg = _config(tmp_path, host_memory="128KiB", nvme_path=str(tmp_path / "nvme"))
    ours = infinity.offload(ours, cfg)
    try:
        placement = infinity.stats(ours)["placement"]["param"]
        assert placement["nvme"] > 0  # the frozen base lives on NVMe
        # SFTConfig's default activation checkpointing is on for all three.
        _sft(ref, _adamw(ref), tmp_path / "ref")
        _sft(probe, _adamw(probe, fused=True), tmp_path / "probe")
        opt = CPUAdam([p for p in ours.parameters() if p.requires_grad], lr=LR)
        _sft(ours, opt, tmp_path / "ours")
        noise = _rel(probe, ref)
        assert 0 < noise < 1e-5, noise
        assert _rel(ours, ref) <= 4 * noise, (_rel(ours, ref), noise)
        frozen = {k: v for k, v in base.state_dict().items()}
        state = ours.state_dict()
        for name, value in state.items():
            if "lora_" not in name:  # the base is untouched, bit for bit
                key = name.replace("base_model.model.", "").replace(".base_layer", "")
                assert torch.equal(value, frozen[key]), name
    finally:
        engine_of(ours).close()


def test_generate_and_evaluate_equal_the_plain_model(tmp_path):
    base = tiny_llama(VOCAB, hidden=32, tie=True)
    ours = infinity.offload(copy.deepcopy(base), _config(tmp_path))
    try:
        prompt = torch.tensor([[5, 9, 33, 7]])
        expected = base.generate(prompt, max_new_tokens=8, do_sample=False)
        assert torch.equal(ours.generate(prompt, max_new_tokens=8, do_sample=False), expected)
        rows = [{"input_ids": r, "labels": list(r)} for r in _dataset()["input_ids"]]
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "eval"), per_device_eval_batch_size=4, report_to=[],
            use_cpu=True, disable_tqdm=True,
        )  # fmt: skip
        losses = [
            transformers.Trainer(model=m, args=args, eval_dataset=rows).evaluate()["eval_loss"]
            for m in (base, ours)
        ]
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    finally:
        engine_of(ours).close()


def _with_checkpointing(base, lora: bool, reentrant: bool):
    model = copy.deepcopy(base)
    if lora:
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if lora:
        model.enable_input_require_grads()
    return model.train()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_activation_checkpointing_gives_plain_pytorch_gradients(lora, reentrant):
    """Found with SFTConfig's default checkpointing: a block's recomputation in
    backward read parameters the engine had already pointed back at their
    placeholders (frozen ones; any under use_reentrant=True), so gradients were
    NaN. The reference: the same model with the same checkpointing, not offloaded."""
    base = tiny_llama(VOCAB, hidden=32)
    ref = _with_checkpointing(base, lora, reentrant)
    ours = infinity.offload(
        _with_checkpointing(base, lora, reentrant), infinity.Config(device="cpu", dtype="fp32")
    )
    try:
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        ref(input_ids=ids, labels=ids).loss.backward()
        ours(input_ids=ids, labels=ids).loss.backward()
        grads = infinity.gradients(ours)
        expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert set(grads) == set(expected) and expected
        for name, grad in expected.items():
            assert torch.allclose(grads[name], grad, rtol=1e-5, atol=1e-7), name
    finally:
        engine_of(ours).close()
