"""``infinity train --optimizer {adamw,lion,sgd,adafactor}``: each one trains, the reports
and the checkpoints name it, and a resume cannot switch to another one; Adafactor's
limits (fp32 states, one process) are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infinity.checkpoint.format import read_meta
from infinity.cli.main import main

TINY = ["train", "--preset", "tiny", "--json", "--eval-batches", "0", "--plot", "none"]
STEPS = 8


def _events(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _only(events: list[dict], kind: str) -> dict:
    (event,) = [e for e in events if e["event"] == kind]
    return event


@pytest.mark.parametrize(
    ("optimizer", "label", "front_end"),
    [
        ("lion", "Lion lr 0.001 ", "CPULion"),
        ("sgd", "SGD (momentum 0.9) lr 0.09 ", "CPUSGD"),
        ("adafactor", "Adafactor lr 0.09 ", "CPUAdafactor"),
    ],
)
def test_trains_with_the_optimizer_and_names_it(
    tmp_path, capsys, monkeypatch, optimizer, label, front_end
):
    monkeypatch.chdir(tmp_path)
    flags = ["--steps", str(STEPS), "--optimizer", optimizer, "--nvme-path", str(tmp_path / "n")]
    assert main([*TINY, *flags, "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    events = _events(capsys)
    # The header names it with its default LR (the tiny preset's 3e-3, scaled).
    header = _only(events, "start")["lines"]
    assert any(label in line for line in header)
    summary = _only(events, "summary")
    assert summary["optimizer"] == optimizer
    # Adafactor's factors live in host memory beside the chunks: said, and counted.
    per_tensor = summary["stats"]["optimizer_tensor_state_bytes"]
    assert any(line.startswith("+ per tensor") for line in header) == (optimizer == "adafactor")
    assert (per_tensor > 0) == (optimizer == "adafactor")
    losses = [summary["losses"][str(step)] for step in range(1, STEPS + 1)]
    assert losses[0] > 5.0  # bytes start near ln(256) = 5.55
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    # The checkpoint records it twice: the run's settings and the engine's optimizer.
    checkpoint = Path(summary["checkpoint"])
    settings = json.loads((checkpoint / "trainer.json").read_text())["settings"]
    assert settings["optimizer"] == optimizer
    assert read_meta(checkpoint)["chunk_optimizer"]["front_end"].endswith(front_end)


def test_resume_with_another_optimizer_is_an_error_naming_both(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = ["--nvme-path", str(tmp_path / "n"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main([*TINY, "--steps", "4", "--stop-after", "2", "--optimizer", "lion", *paths]) == 0
    capsys.readouterr()
    assert main([*TINY, "--resume", "--optimizer", "sgd", *paths]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("infinity: error: --optimizer sgd:") and len(err.splitlines()) == 1
    assert "trained with --optimizer lion" in err
    # Without the flag (or with the same one) the run continues with its own.
    assert main([*TINY, "--resume", *paths]) == 0
    summary = _only(_events(capsys), "summary")
    assert summary["optimizer"] == "lion" and summary["last_step"] == 4


def test_sgd_refuses_int8_states(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--optimizer", "sgd", "--optimizer-state-dtype", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer sgd" in err and "fp32 or bf16" in err


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_adafactor_refuses_16_and_8_bit_states_naming_the_fix(tmp_path, capsys, monkeypatch, dtype):
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--optimizer", "adafactor", "--optimizer-state-dtype", dtype]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("infinity: error: --optimizer adafactor keeps its factored")
    assert f"fp32 only, not --optimizer-state-dtype {dtype}" in err
    assert "pass --optimizer-state-dtype fp32" in err
    # The same from a --config file (which the flag overrides).
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"optimizer_state_dtype": dtype}))
    assert main([*TINY, "--optimizer", "adafactor", "--config", str(config)]) == 2
    assert f"optimizer_state_dtype {dtype} in {config}" in capsys.readouterr().err


def test_adafactor_resumes_on_the_same_loss_curve(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = [*TINY, "--steps", "4", "--nvme-path", str(tmp_path / "n")]
    assert main([*run, "--optimizer", "adafactor", "--checkpoint-dir", "none"]) == 0
    reference = _only(_events(capsys), "summary")["losses"]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main([*run, *ckpt, "--optimizer", "adafactor", "--stop-after", "2"]) == 0
    first = _only(_events(capsys), "summary")
    # Resumed without the flag: it keeps Adafactor, its factors restored from the checkpoint.
    assert main([*run, *ckpt, "--resume"]) == 0
    second = _only(_events(capsys), "summary")
    assert second["optimizer"] == "adafactor" and second["first_step"] == 3
    assert {**first["losses"], **second["losses"]} == reference  # exactly equal floats
