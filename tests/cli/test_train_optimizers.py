"""``infinity train --optimizer {adamw,lion,sgd}``: each one trains, the reports and the
checkpoints name it, and a resume cannot switch to another one."""

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
    [("lion", "Lion lr 0.001 ", "CPULion"), ("sgd", "SGD (momentum 0.9) lr 0.09 ", "CPUSGD")],
)
def test_trains_with_the_optimizer_and_names_it(
    tmp_path, capsys, monkeypatch, optimizer, label, front_end
):
    monkeypatch.chdir(tmp_path)
    flags = ["--steps", str(STEPS), "--optimizer", optimizer, "--nvme-path", str(tmp_path / "n")]
    assert main([*TINY, *flags, "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    events = _events(capsys)
    # The header names it with its default LR (the tiny preset's 3e-3, scaled).
    assert any(label in line for line in _only(events, "start")["lines"])
    summary = _only(events, "summary")
    assert summary["optimizer"] == optimizer
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
