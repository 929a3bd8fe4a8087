"""The product on the fence device: the main job, fine-tuning, the ecosystem's loops.

Each job runs on the fence (the stand-in for a GPU) and is compared with an
independent run: the same command on the CPU backend (the fence computes with
the CPU's kernels, so the two agree bit for bit), or plain PyTorch on the host.
A batch, a prompt or a weight left on the host anywhere fails here with CUDA's
"Expected all tensors to be on the same device".
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from engine_helpers import batches, gpt_loss, global_rel_error, reference_pair, tiny_gpt, train

import infinity
from infinity.cli.main import main
from infinity.offload import engine_of
from infinity.optim import CPUAdam

FENCE = torch.device("fence", 0)
transformers = pytest.importorskip("transformers")


def _train_cli(capsys, *flags: str) -> dict:
    code = main(["train", "--json", *flags])
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0, events[-3:]
    (summary,) = [e for e in events if e["event"] == "summary"]
    start = next(e for e in events if e["event"] == "start")
    return {**summary, "header": start["lines"][0]}


@pytest.mark.parametrize("activations", ["keep", "offload"])
def test_the_main_job_on_the_fence_equals_the_cpu(capsys, tmp_path, activations):
    """`infinity train` with every batch and held-out batch moved to the device
    (before issue 40 they never were: the job died on a GPU before its first step)."""
    runs = {}
    for device in ("cpu", "fence"):
        runs[device] = _train_cli(
            capsys, "--preset", "tiny", "--steps", "3", "--eval-batches", "2",
            "--activations", activations, "--device", device, "--plot", "none",
            "--nvme-path", str(tmp_path / device / "nvme"),
            "--checkpoint-dir", str(tmp_path / device / "ckpt"),
        )  # fmt: skip
    assert "device fence" in runs["fence"]["header"] and "(auto: " in runs["fence"]["header"]
    assert runs["fence"]["losses"] == runs["cpu"]["losses"]
    assert runs["fence"]["eval_before"] == runs["cpu"]["eval_before"]
    assert runs["fence"]["eval_after"] == runs["cpu"]["eval_after"]


def test_fine_tuning_a_transformers_model_on_the_fence_equals_the_cpu(capsys, tmp_path):
    source = tmp_path / "tiny-llama"
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    text = tmp_path / "text"
    text.mkdir()
    for i in range(20):
        (text / f"part{i:02d}.txt").write_text("pack my box with five dozen jugs. " * 8)
    runs = {}
    for device in ("cpu", "fence"):
        runs[device] = _train_cli(
            capsys, "--model", str(source), "--data", str(text), "--steps", "2",
            "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--device", device,
            "--activations", "offload", "--plot", "none",
            "--output", str(tmp_path / device / "tuned"),
            "--nvme-path", str(tmp_path / device / "nvme"),
            "--checkpoint-dir", str(tmp_path / device / "ckpt"),
        )  # fmt: skip
    assert runs["fence"]["losses"] == runs["cpu"]["losses"]
    assert runs["fence"]["eval_after"] == runs["cpu"]["eval_after"]
    tuned = {
        d: transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d / "tuned")
        for d in runs
    }
    for (name, a), b in zip(
        tuned["cpu"].state_dict().items(), tuned["fence"].state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def _tiny_llama(tie: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=tie,
        )
    )  # fmt: skip


def _on_fence(model: torch.nn.Module, tmp_path, **kw) -> torch.nn.Module:
    kw.setdefault("device_memory", "96KiB")
    kw.setdefault("chunk_size", "16KiB")
    return infinity.offload(model, infinity.Config(device="fence", dtype="fp32", **kw))


def test_generate_on_the_fence_equals_the_plain_model(tmp_path):
    base = _tiny_llama()
    ours = _on_fence(copy.deepcopy(base), tmp_path, host_memory="128KiB", nvme_path=str(tmp_path))
    try:
        prompt = torch.tensor([[5, 9, 33, 7]])
        expected = base.generate(prompt, max_new_tokens=8, do_sample=False)
        got = ours.generate(prompt.to(infinity.device_of(ours)), max_new_tokens=8, do_sample=False)
        assert got.device == FENCE
        assert torch.equal(got.cpu(), expected)
    finally:
        engine_of(ours).close()


def _samples(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 128, (16,), generator=g) for _ in range(n)]
    return [{"input_ids": ids, "labels": ids.clone()} for ids in rows]


def _trainer(model, out_dir, *, on_fence: bool, steps: int = 3) -> list[float]:
    """`transformers.Trainer` with CPUAdam (ours) or single-tensor AdamW (the reference)."""
    if on_fence:
        opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=steps, logging_steps=1, report_to=[], use_cpu=not on_fence, seed=0,
        disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_samples(4 * steps),
        optimizers=(opt, transformers.get_linear_schedule_with_warmup(opt, 1, steps)),
    )  # fmt: skip
    if on_fence:
        assert args.device == FENCE  # Accelerate moves every batch to the fence
    trainer.train()
    return [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]


def test_the_trainer_on_the_fence_trains_like_adamw_on_the_host(tmp_path, monkeypatch):
    """Accelerate picks cuda on a GPU machine; it knows no fence, so it is told by its
    own setting (``ACCELERATE_TORCH_DEVICE``), after the reference ran on the host."""
    accelerate = pytest.importorskip("accelerate")
    reset = accelerate.state.AcceleratorState._reset_state
    base = _tiny_llama()
    ref = copy.deepcopy(base)
    ours = _on_fence(copy.deepcopy(base), tmp_path)
    try:
        reset(reset_partial_state=True)
        ref_norms = _trainer(ref, tmp_path / "ref", on_fence=False)
        reset(reset_partial_state=True)
        monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", str(FENCE))
        norms = _trainer(ours, tmp_path / "ours", on_fence=True)
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert global_rel_error(ours, ref) < 1e-5
    finally:
        reset(reset_partial_state=True)
        engine_of(ours).close()


def test_lora_on_the_fence_trains_the_adapters_of_a_frozen_base_on_nvme(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    def wrapped() -> torch.nn.Module:
        torch.manual_seed(1)
        return peft.get_peft_model(_tiny_llama(), lora)

    ref, ours = wrapped(), wrapped()
    ours = _on_fence(ours, tmp_path, host_memory="128KiB", nvme_path=str(tmp_path))
    try:
        assert infinity.stats(ours)["placement"]["param"]["nvme"] > 0
        opts = [
            torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3,
                              foreach=False),
            CPUAdam([p for p in ours.parameters() if p.requires_grad], lr=3e-3),
        ]  # fmt: skip
        for sample in _samples(3):
            ids = sample["input_ids"].view(1, -1)
            for model, opt in zip((ref, ours), opts, strict=True):
                x = ids.to(infinity.device_of(model))
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
        assert global_rel_error(ours, ref) < 1e-5
    finally:
        engine_of(ours).close()


def test_a_checkpoint_saved_on_the_fence_resumes_like_an_uninterrupted_run(tmp_path):
    data = [(x.to(FENCE), y.to(FENCE)) for x, y in batches(4)]

    def offloaded(where: str):
        model = _on_fence(
            tiny_gpt(), tmp_path, host_memory="160KiB", nvme_path=str(tmp_path / where)
        )
        return model, CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)

    first, first_opt = offloaded("first")
    train(first, first_opt, data[:2])
    infinity.save_checkpoint(tmp_path / "ckpt", first, first_opt)
    engine_of(first).close()
    resumed, resumed_opt = offloaded("resumed")
    infinity.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    train(resumed, resumed_opt, data[2:])
    ref, ref_opt = reference_pair(tiny_gpt())
    train(ref, ref_opt, [(x.cpu(), y.cpu()) for x, y in data], loss_fn=gpt_loss)
    try:
        assert infinity.stats(resumed)["placement"]["optim"]["nvme"] > 0
        assert global_rel_error(resumed, ref) < 1e-5
    finally:
        engine_of(resumed).close()
