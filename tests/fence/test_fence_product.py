"""The product on the fence device: the main job, fine-tuning, the ecosystem's loops.

Each job runs on the fence (the stand-in for a GPU) and is compared with an
independent run: the same command on the CPU backend (the fence computes with
the CPU's kernels, so the two agree bit for bit), or plain PyTorch on the host.
A batch, a prompt or a weight left on the host anywhere fails here with CUDA's
"Expected all tensors to be on the same device".
"""

from __future__ import annotations

import json

import device_jobs
import pytest
import torch

from infinity.cli.main import main

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


def test_two_processes_on_the_fence_train_as_two_on_the_cpu(capfd, tmp_path):
    """`infinity train --nproc 2`: each rank's batches reach its device, the shards'
    collectives cross gloo (on host copies of the fence tensors)."""
    runs = {}
    for device in ("cpu", "fence"):
        runs[device] = _train_cli(
            capfd, "--nproc", "2", "--preset", "tiny", "--steps", "3", "--batch-size", "4",
            "--eval-batches", "1", "--device", device, "--plot", "none",
            "--nvme-path", str(tmp_path / device / "nvme"),
            "--checkpoint-dir", str(tmp_path / device / "ckpt"),
        )  # fmt: skip
    assert runs["fence"]["losses"] == runs["cpu"]["losses"]
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
        d: transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d / "tuned") for d in runs
    }
    for (name, a), b in zip(
        tuned["cpu"].state_dict().items(), tuned["fence"].state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("job", device_jobs.JOBS, ids=lambda job: job.__name__)
def test_a_gpu_job_on_the_fence(job, tmp_path, monkeypatch):
    """The jobs ``tests/cuda/test_cuda_product.py`` runs on a GPU (device_jobs.py)."""
    # NOTE: Accelerate (so the Trainer) picks cuda on a GPU machine; it knows no fence.
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", str(FENCE))
    job("fence", tmp_path)
