"""Jobs a user runs on a GPU, written once for any device: the fence here, CUDA there.

``tests/fence/test_fence_product.py`` runs them on the fence device in every
``make test``; ``tests/cuda/test_cuda_product.py`` runs the same functions on a
lent GPU (``bench/gpu_check.sh``). Each is judged against plain PyTorch on the
same device, or against the same job run another way (kept activations, an
uninterrupted process). Inputs move with ``x.to(infinity.device_of(model))``,
as a user's loop does.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128


def tiny_llama(tie: bool = True, seed: int = 0) -> torch.nn.Module:
    """A two-layer ``transformers`` Llama (grouped-query attention)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=tie,
        )
    ).train()  # fmt: skip


def offloaded(model: torch.nn.Module, device: str, **kw) -> torch.nn.Module:
    """``model`` offloaded to ``device`` in fp32 with test-sized budgets (``kw`` wins)."""
    kw.setdefault("device_memory", "96KiB")
    kw.setdefault("chunk_size", "16KiB")
    return infinity.offload(model, infinity.Config(device=device, dtype="fp32", **kw))


def token_batches(n: int, batch: int = 2, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
    """``n`` host batches of token ids (the loop moves them)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor]):
    """The plain loop; every batch moved to the model's device. Returns the losses."""
    device = infinity.device_of(model)
    losses = []
    for ids in data:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def rel_error(ours: torch.nn.Module, ref: torch.nn.Module) -> float:
    """||ours - ref|| / ||ref|| over the state dicts (on the host)."""
    a, b = ours.state_dict(), ref.state_dict()
    num = sum(float((a[k].cpu().double() - v.cpu().double()).pow(2).sum()) for k, v in b.items())
    den = sum(float(v.cpu().double().pow(2).sum()) for v in b.values())
    return (num / den) ** 0.5


def generate_equals_the_plain_model(device: str, tmp_path) -> None:
    """Greedy ``generate()`` of an offloaded model (parameters partly on NVMe) gives the
    plain model's tokens on the same device."""
    base = tiny_llama()
    plain = copy.deepcopy(base).to(device)
    ours = offloaded(base, device, host_memory="128KiB", nvme_path=str(tmp_path / "nvme"))
    try:
        prompt = torch.tensor([[5, 9, 33, 7]])
        expected = plain.generate(prompt.to(device), max_new_tokens=8, do_sample=False)
        got = ours.generate(prompt.to(infinity.device_of(ours)), max_new_tokens=8, do_sample=False)
        assert got.device.type == torch.device(device).type
        assert torch.equal(got.cpu(), expected.cpu())
    finally:
        engine_of(ours).close()


def offloaded_activations_equal_kept_ones(device: str, tmp_path) -> None:
    """``activations="offload"`` through host memory and NVMe trains bit for bit as
    ``"keep"``: the saved tensors only move."""
    data = token_batches(3, batch=2, seq=32)
    states = {}
    # NOTE: 640 KiB: an eighth of host_memory is kept for saved activations, enough
    # for the two buffers that move the largest (32 KiB) to NVMe and back
    for policy, host in (("keep", "2MiB"), ("offload", "2MiB"), ("offload", "640KiB")):
        model = offloaded(
            tiny_llama(), device, host_memory=host, nvme_path=str(tmp_path / f"{policy}{host}"),
            activations=policy, activation_min_bytes=0,
        )  # fmt: skip
        try:
            train_steps(model, CPUAdam(model.parameters(), lr=3e-3), data)
            moved = infinity.stats(model).get("activations") or {}
            states[(policy, host)] = (model.state_dict(), moved)
        finally:
            engine_of(model).close()
    kept, _ = states[("keep", "2MiB")]
    _, in_ram = states[("offload", "2MiB")]
    _, spilled = states[("offload", "640KiB")]
    assert in_ram.get("host_peak_bytes", 0) > 0, in_ram
    assert spilled.get("nvme_peak_bytes", 0) > 0, spilled
    for key in (("offload", "2MiB"), ("offload", "640KiB")):
        state, _ = states[key]
        for name, value in kept.items():
            assert torch.equal(state[name], value), (key, name)


def _trainer_run(model, device: str, out_dir, optimizer: torch.optim.Optimizer) -> list[float]:
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (16,), generator=g) for _ in range(12)]
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, logging_steps=1, report_to=[], use_cpu=device == "cpu", seed=0,
        disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    assert args.device.type == torch.device(device).type, args.device
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
        optimizers=(optimizer, transformers.get_linear_schedule_with_warmup(optimizer, 1, 3)),
    )  # fmt: skip
    trainer.train()
    return [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]


def trainer_trains_like_adamw(device: str, tmp_path) -> None:
    """``transformers.Trainer`` (clipping at 1.0, accumulation, a schedule) moves the
    batches to the device and trains the offloaded model as it trains the plain one
    there with single-tensor ``torch.optim.AdamW``, within torch's own fused-vs-single
    noise (the Trainer must pick ``device``: Accelerate's ``ACCELERATE_TORCH_DEVICE``
    tells it about the fence)."""
    accelerate = pytest.importorskip("accelerate")
    reset = accelerate.state.AcceleratorState._reset_state
    base = tiny_llama()
    models = {kind: copy.deepcopy(base).to(device) for kind in ("single", "fused")}
    models["ours"] = offloaded(copy.deepcopy(base), device)
    norms = {}
    try:
        for kind, model in models.items():
            reset(reset_partial_state=True)
            if kind == "ours":
                opt: torch.optim.Optimizer = CPUAdam(model.parameters(), lr=1e-3)
            else:
                fused = kind == "fused"
                opt = torch.optim.AdamW(
                    model.parameters(), lr=1e-3, fused=fused, foreach=False if not fused else None
                )
            norms[kind] = _trainer_run(model, device, tmp_path / kind, opt)
        noise = rel_error(models["fused"], models["single"])
        assert 0 < noise < 1e-4, noise
        assert rel_error(models["ours"], models["single"]) <= 4 * max(noise, 1e-6)
        assert norms["ours"] == pytest.approx(norms["single"], rel=1e-4)
    finally:
        reset(reset_partial_state=True)
        engine_of(models["ours"]).close()


_RESUME_CHILD = """
import json, sys, torch
import infinity
from device_jobs import offloaded, tiny_llama, token_batches, train_steps
device, nvme, ckpt, mode = sys.argv[1:5]
if device == "fence":
    from infinity.devices import fence
    fence.load()
if device.startswith("cuda"):
    torch.use_deterministic_algorithms(True, warn_only=True)  # compared bit for bit
model = offloaded(tiny_llama(), device, host_memory="200KiB", nvme_path=nvme)
opt = infinity.optim.CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
data = token_batches(6)
if mode == "first":
    losses = train_steps(model, opt, data[:3])
    infinity.save_checkpoint(ckpt, model, opt)
else:
    infinity.load_checkpoint(ckpt, model, opt)
    losses = train_steps(model, opt, data[3:])
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, ckpt + "-resumed.pt")
print(json.dumps(losses))
"""


def resume_in_a_fresh_process_equals_uninterrupted(device: str, tmp_path) -> None:
    """A checkpoint saved by one process (states on NVMe) and loaded by a new one
    continues exactly as a run that never stopped, in this process."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)]),
        "INFINITY_FENCE_TESTS": "1",
    }
    ckpt = str(tmp_path / "ckpt")
    losses = []
    for mode in ("first", "resume"):
        done = subprocess.run(
            [sys.executable, "-c", _RESUME_CHILD, device, str(tmp_path / mode), ckpt, mode],
            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        losses += json.loads(done.stdout.strip().splitlines()[-1])
    model = offloaded(tiny_llama(), device, host_memory="200KiB", nvme_path=str(tmp_path / "one"))
    try:
        opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
        assert train_steps(model, opt, token_batches(6)) == losses
        resumed = torch.load(ckpt + "-resumed.pt")
        for name, value in model.state_dict().items():
            assert torch.equal(resumed[name], value.cpu()), name
        assert infinity.stats(model)["placement"]["optim"]["nvme"] > 0
    finally:
        engine_of(model).close()


def lora_trains_the_adapters_of_a_frozen_base_on_nvme(device: str, tmp_path) -> None:
    """``peft`` LoRA over a base whose frozen parameters live on NVMe trains the
    adapters as plain PyTorch does on the same device; the base is untouched."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    def wrapped() -> torch.nn.Module:
        torch.manual_seed(1)  # the same adapters each time
        return peft.get_peft_model(tiny_llama(), lora)

    ref = wrapped().to(device)
    ours = offloaded(wrapped(), device, host_memory="128KiB", nvme_path=str(tmp_path / "nvme"))
    try:
        assert infinity.stats(ours)["placement"]["param"]["nvme"] > 0
        ref_opt = torch.optim.AdamW(
            [p for p in ref.parameters() if p.requires_grad], lr=3e-3, foreach=False
        )
        opt = CPUAdam([p for p in ours.parameters() if p.requires_grad], lr=3e-3)
        data = token_batches(3)
        ref_losses = train_steps(ref, ref_opt, data)
        assert train_steps(ours, opt, data) == pytest.approx(ref_losses, rel=1e-5)
        assert rel_error(ours, ref) < 1e-5
        base = tiny_llama().state_dict()
        for name, value in ours.state_dict().items():
            if "lora_" not in name:
                key = name.replace("base_model.model.", "").replace(".base_layer", "")
                assert torch.equal(value.cpu(), base[key]), name
    finally:
        engine_of(ours).close()


# Every job, in the order the tests run them (test ids are the function names).
JOBS = (
    generate_equals_the_plain_model,
    offloaded_activations_equal_kept_ones,
    trainer_trains_like_adamw,
    lora_trains_the_adapters_of_a_frozen_base_on_nvme,
    resume_in_a_fresh_process_equals_uninterrupted,
)
