"""``infinity train`` end to end at the tiny preset: learning, resume, Ctrl-C, bad flags.

Every check compares against something the command under test does not
produce itself: an uninterrupted run, a checkpoint loaded by the library into a
fresh model, the files on disk, the process's exit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import infinity
from infinity.cli.main import main
from infinity.cli.train.loop import EVAL_SEED_OFFSET
from infinity.data import Batches, load_corpus
from infinity.models.gpt import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[2]
TINY = ["train", "--preset", "tiny"]
WATCHDOG_SECONDS = 240


def _paths(tmp: Path) -> list[str]:
    return [
        "--nvme-path", str(tmp / "nvme"), "--checkpoint-dir", str(tmp / "ckpt"),
        "--plot", str(tmp / "timeline.png"),
    ]  # fmt: skip


def _events(text: str) -> list[dict]:
    """Parse --json output: every line of stdout must be one JSON object."""
    return [json.loads(line) for line in text.splitlines()]


def _summary(events: list[dict]) -> dict:
    (summary,) = [e for e in events if e["event"] == "summary"]
    return summary


def _train_in_process(capsys, *flags: str) -> tuple[int, list[dict]]:
    code = main([*TINY, "--json", *flags])
    return code, _events(capsys.readouterr().out)


def _subprocess(*flags: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout, not an installed copy
    proc = subprocess.Popen(
        [sys.executable, "-m", "infinity", *TINY, *flags],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # NOTE: a watchdog, so a hung run fails the test instead of blocking a read forever.
    watchdog = threading.Timer(WATCHDOG_SECONDS, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    return proc


def _load_into_fresh_model(path: Path, tmp: Path) -> GPT:
    """The library loads the checkpoint into a model offloaded with other budgets."""
    settings = json.loads((path / "trainer.json").read_text())["settings"]
    with torch.device("meta"):
        model = GPT(GPTConfig(**settings["model"]))
    cfg = infinity.Config(device_memory="4MiB", host_memory="64MiB", dtype=settings["dtype"])
    model = infinity.offload(model, cfg)
    opt = infinity.optim.CPUAdam(model.parameters(), lr=1e-3)
    infinity.load_checkpoint(path, model, opt)  # checks every file's CRC
    return model


def _only_run(ckpt: Path) -> Path:
    """The one run directory in ``ckpt`` (every run saves into its own ``run-<id>``)."""
    (run,) = ckpt.iterdir()
    assert run.name.startswith("run-") and run.is_dir(), run
    return run


def _no_swap_files(nvme: Path) -> bool:
    return not nvme.exists() or not any(p.is_file() for p in nvme.rglob("*"))


def test_tiny_run_learns_and_writes_plot_and_checkpoint(tmp_path):
    proc = _subprocess("--steps", "30", "--json", *_paths(tmp_path), cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    events = _events(out)
    summary = _summary(events)
    losses = [summary["losses"][str(s)] for s in range(1, 31)]
    assert losses[0] > 5.0  # bytes start near ln(256) = 5.55
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    assert summary["eval_after"] < summary["eval_before"] - 1.5
    # Every tier in use, within its budget, with states beyond device and host budgets.
    stats = summary["stats"]
    assert stats["device_peak_bytes"] <= stats["device_budget_bytes"]
    assert stats["host_peak_bytes"] <= stats["host_budget_bytes"]
    assert stats["nvme_read_bytes"] > 0 and stats["nvme_write_bytes"] > 0
    states = GPTConfig(256, 64, 2, 128, 4).num_params * 16
    assert states > stats["host_budget_bytes"] > stats["device_budget_bytes"]
    # Every byte of the budgets in a named line, each within its limit, over the steps;
    # the forecast of the steps' peak made at the start.
    memory = stats["memory"]
    for tier in ("host", "device"):
        lines = memory[tier]["lines"]
        assert lines and all(line["peak"] <= line["limit"] for line in lines.values()), lines
        assert sum(line["limit"] for line in lines.values()) <= memory[tier]["budget_bytes"]
    forecast = memory["forecast"]
    assert forecast["tokens"] == 8 * 64 and forecast["working_set"]["peak"] > 0
    assert forecast["resident_peak"] > forecast["baseline"] + stats["host_budget_bytes"] // 2
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _no_swap_files(tmp_path / "nvme")
    # The checkpoint holds the trained model: its held-out loss, computed here with
    # a fresh model, equals the one the run reported.
    ckpt = Path(summary["checkpoint"])
    assert ckpt == _only_run(tmp_path / "ckpt") / "step-00000030"
    model = _load_into_fresh_model(ckpt, tmp_path)
    held_out = Batches(load_corpus().eval, 64, 8, EVAL_SEED_OFFSET)
    with torch.no_grad():
        loss = sum(model(*held_out.get(i)).item() for i in range(4)) / 4
    assert loss == pytest.approx(summary["eval_after"], abs=1e-5)


def test_resume_continues_the_same_loss_curve(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = ["--steps", "6", "--eval-batches", "0", "--plot", "none"]
    nvme = ["--nvme-path", str(tmp_path / "nvme")]
    code, events = _train_in_process(capsys, *common, *nvme, "--checkpoint-dir", "none")
    assert code == 0
    reference = _summary(events)["losses"]
    assert sorted(reference, key=int) == [str(s) for s in range(1, 7)]

    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    code, events = _train_in_process(
        capsys, *common, *nvme, *ckpt, "--checkpoint-every", "2", "--stop-after", "4"
    )
    assert code == 0
    first = _summary(events)
    assert first["status"] == "stopped" and first["last_step"] == 4
    run = _only_run(tmp_path / "ckpt")
    assert sorted(p.name for p in run.iterdir()) == ["step-00000002", "step-00000004"]
    code, events = _train_in_process(capsys, "--resume", "--eval-batches", "0", *nvme, *ckpt)
    assert code == 0
    second = _summary(events)
    assert second["first_step"] == 5 and second["last_step"] == 6
    assert {**first["losses"], **second["losses"]} == reference  # exactly equal floats
    assert _only_run(tmp_path / "ckpt") == run  # the same run, continued in place
    assert sorted(p.name for p in run.iterdir()) == ["step-00000004", "step-00000006"]


def test_damaged_newest_checkpoint_is_refused_naming_the_older_one(tmp_path, capsys):
    flags = ["--nvme-path", str(tmp_path / "nvme"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    quiet = ["--eval-batches", "0", "--plot", "none", "--quiet"]
    assert main([*TINY, "--steps", "4", "--checkpoint-every", "2", *flags, *quiet]) == 0
    run = _only_run(tmp_path / "ckpt")
    params = run / "step-00000004" / "param.bin"
    data = bytearray(params.read_bytes())
    data[len(data) // 2] ^= 0xFF
    params.write_bytes(bytes(data))
    capsys.readouterr()
    assert main([*TINY, "--resume", "--steps", "6", *flags, *quiet]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "step-00000004" in err and str(run / "step-00000002") in err


def test_ctrl_c_stops_with_a_loadable_checkpoint_and_no_swap_files(tmp_path):
    proc = _subprocess(
        "--steps", "100000", "--checkpoint-every", "3", "--json", *_paths(tmp_path), cwd=tmp_path
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if json.loads(line).get("step", 0) >= 4 and '"event": "step"' in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "last complete checkpoint" in err
    events = _events("".join(seen) + out)
    last_step = max(e["step"] for e in events if e["event"] == "step")
    assert last_step >= 4
    saved = [Path(e["path"]) for e in events if e["event"] == "checkpoint"]
    run = _only_run(tmp_path / "ckpt")
    assert saved[-1] == run / f"step-{last_step:08d}"  # the step it finished
    assert str(saved[-1]) in err
    # No half-written checkpoint, the newest is complete and loads (CRC-checked).
    names = sorted(p.name for p in run.iterdir())
    assert all(n.startswith("step-") for n in names), names
    _load_into_fresh_model(saved[-1], tmp_path)
    assert _no_swap_files(tmp_path / "nvme")


# NOTE: 0.8 s lands the second Ctrl-C after the run has stopped, while the
# process winds down: it must not turn the clean stop into a death by signal.
@pytest.mark.parametrize("gap_s", [0.05, 0.8])
def test_second_ctrl_c_abandons_the_step_and_keeps_checkpoints_whole(tmp_path, gap_s):
    proc = _subprocess(
        "--steps", "100000", "--checkpoint-every", "2", "--json", *_paths(tmp_path), cwd=tmp_path
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if '"event": "checkpoint"' in line:
            break
    proc.send_signal(signal.SIGINT)
    time.sleep(gap_s)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert "checkpoint: " in err
    run = _only_run(tmp_path / "ckpt")
    names = sorted(p.name for p in run.iterdir())
    assert names and all(n.startswith("step-") for n in names), names
    _load_into_fresh_model(run / names[-1], tmp_path)
    assert _no_swap_files(tmp_path / "nvme")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--layers", "0"], "--layers"),
        (["--hidden", "100", "--heads", "3"], "--heads"),
        (["--device-memory", "lots"], "--device-memory"),
        (["--device-memory", "4KiB"], "Raise --device-memory to at least"),
        (["--host-memory", "64KiB", "--nvme-path", "none"], "Raise --host-memory to at least"),
        (["--chunk-size", "5000"], "--chunk-size"),
        (["--resume"], "--resume"),
        (["--config", "missing.json"], "--config"),
        (["--lr", "-1"], "--lr"),
        (["--seq-len", "100000"], "--seq-len"),
        (["--device", "tpu"], "--device 'tpu' must be"),
        (["--output", "out"], "drop --output"),  # was ignored without --model
        (["--data", "missing.txt"], "--data"),
        pytest.param(
            ["--device", "cuda"],
            "there is no CUDA GPU here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, monkeypatch, flags, needle):
    monkeypatch.chdir(tmp_path)
    code = main([*TINY, *flags, "--checkpoint-dir", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("infinity: error:") and needle in err
    assert not (tmp_path / ".infinity").exists()  # the default NVMe directory was removed


def test_the_built_in_gpt_trains_on_the_given_text_and_resumes_only_on_it(
    tmp_path, capsys, monkeypatch
):
    """``--data`` was ignored without ``--model``: the GPT trained on the standard
    library. A text of one repeated 4-byte word is learned to a loss far below
    any the standard library's sources reach in a few steps (the held-out split of a
    single file is its tail: the same word)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "word.txt").write_text("abcd" * 20_000)
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "20"]
    flags = ["--steps", "40", "--plot", "none", "--nvme-path", str(tmp_path / "nvme"), *ckpt]
    code, events = _train_in_process(capsys, "--data", "word.txt", "--lr", "3e-3", *flags)
    assert code == 0
    summary = _summary(events)
    assert summary["eval_after"] < 0.5 < 5.0 < summary["eval_before"]
    (step_20,) = _only_run(tmp_path / "ckpt").glob("step-00000020")
    settings = json.loads((step_20 / "trainer.json").read_text())["settings"]
    assert settings["data"] == str(tmp_path / "word.txt")
    (tmp_path / "other.txt").write_text("wxyz" * 20_000)
    code = main([*TINY, "--resume", str(step_20), "--data", "other.txt", *flags])
    assert code == 2 and "the checkpoint trained on" in capsys.readouterr().err


def test_malformed_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--steps", "many"])
    assert exc.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_int8_states_resume_without_the_flag(tmp_path, capsys, monkeypatch):
    """The run remembers --optimizer-state-dtype: a resume without it continues in int8,
    on the same loss curve as an uninterrupted int8 run."""
    monkeypatch.chdir(tmp_path)
    common = ["--steps", "4", "--eval-batches", "0", "--plot", "none"]
    nvme = ["--nvme-path", str(tmp_path / "nvme")]
    int8 = ["--optimizer-state-dtype", "int8"]
    code, events = _train_in_process(capsys, *common, *nvme, *int8, "--checkpoint-dir", "none")
    assert code == 0
    (start,) = [e for e in events if e["event"] == "start"]
    assert any("int8 moments" in line for line in start["lines"])
    assert any("optimizer states: int8" in line for line in start["lines"])
    reference = _summary(events)["losses"]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    code, events = _train_in_process(capsys, *common, *nvme, *int8, *ckpt, "--stop-after", "2")
    assert code == 0
    first = _summary(events)
    code, events = _train_in_process(capsys, "--resume", "--eval-batches", "0", *nvme, *ckpt)
    assert code == 0
    assert {**first["losses"], **_summary(events)["losses"]} == reference
