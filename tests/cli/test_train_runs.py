"""``infinity train`` checkpoints belong to their run: no false saves, no foreign deletes.

References: the bytes of other runs' checkpoints before and after, the files
and owners on disk, the events the command reports, and its exit code.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import infinity.checkpoint.save as save_mod
from infinity.cli.main import main
from infinity.cli.train.checkpoints import RunDirectory

REPO = Path(__file__).resolve().parents[2]
TINY = ["train", "--preset", "tiny", "--json", "--eval-batches", "0", "--plot", "none"]
NOBODY = 65534


def _train(capsys, tmp: Path, *flags: str) -> tuple[int, list[dict], str]:
    code = main([*TINY, "--nvme-path", str(tmp / "nvme"), *flags])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def _saved(events: list[dict]) -> list[Path]:
    return [Path(e["path"]) for e in events if e["event"] == "checkpoint"]


def _notes(events: list[dict]) -> str:
    return "\n".join(e["text"] for e in events if e["event"] == "note")


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _seed(checkpoint: Path) -> int:
    return json.loads((checkpoint / "trainer.json").read_text())["settings"]["seed"]


def test_second_run_saves_its_own_checkpoints_and_keeps_the_first_runs(tmp_path, capsys):
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    code, first_events, _ = _train(capsys, tmp_path, "--steps", "2", "--seed", "1", *ckpt)
    assert code == 0
    first = _saved(first_events)
    before = _tree(tmp_path / "ckpt")
    code, second_events, _ = _train(capsys, tmp_path, "--steps", "2", "--seed", "2", *ckpt)
    assert code == 0
    assert "earlier runs (kept)" in _notes(second_events)
    second = _saved(second_events)
    assert [p.name for p in second] == ["step-00000001", "step-00000002"]
    assert {p.parent for p in second}.isdisjoint({p.parent for p in first})
    for path in second:  # what was reported is on disk, and is this run's
        assert _seed(path) == 2
        assert (path / "param.bin").read_bytes() != (first[-1] / "param.bin").read_bytes()
    after = _tree(tmp_path / "ckpt")
    assert {k: v for k, v in after.items() if k in before} == before  # first run untouched


def test_checkpoint_planted_by_another_user_is_never_reported_or_resumed(tmp_path, capsys):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: world-writable with the sticky bit
    planted = shared / "step-00000002"
    planted.mkdir()
    (planted / "trainer.json").write_text("{}")
    os.chown(planted, NOBODY, NOBODY)
    flags = ["--checkpoint-dir", str(shared), "--steps", "2"]
    code, _events, err = _train(capsys, tmp_path, "--resume", *flags)
    assert code == 2 and "no complete checkpoint" in err  # the planted one is not ours
    code, events, _ = _train(capsys, tmp_path, "--checkpoint-every", "2", *flags)
    assert code == 0
    (saved,) = set(_saved(events))
    assert saved.parent.parent == shared and saved.parent.name.startswith("run-")
    assert saved.stat().st_uid == os.geteuid() and _seed(saved) == 0
    assert (planted / "trainer.json").read_text() == "{}"


def _refused(kind: str, tmp: Path) -> Path:
    target = tmp / "dir"
    if kind == "a file":
        target.write_text("x")
    else:
        target.mkdir()
        if kind == "world-writable":
            os.chmod(target, 0o777)
        else:
            os.chown(target, NOBODY, NOBODY)
    return target


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("a file", "is not a directory"),
        ("world-writable", "writable by everyone without the sticky bit"),
        ("another user's", "not to you"),
    ],
)
def test_checkpoint_dir_it_cannot_own_is_refused_before_training(tmp_path, capsys, kind, needle):
    target = _refused(kind, tmp_path)
    code, events, err = _train(capsys, tmp_path, "--checkpoint-dir", str(target))
    assert code == 2
    assert err.startswith("infinity: error: --checkpoint-dir") and needle in err, err
    assert len(err.strip().splitlines()) == 1
    assert events == []  # refused at start-up: not a single step
    assert not target.is_dir() or list(target.iterdir()) == []


def test_full_disk_at_save_is_a_clear_error_and_no_checkpoint(tmp_path, capsys, monkeypatch):
    real_stream, calls = save_mod._stream, []

    def disk_full_on_second_save(engine, kind, chunks, file, *rest):
        calls.append(file)
        if len(calls) > 2:  # two files per save: the second save fails
            file.write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_stream(engine, kind, chunks, file, *rest)

    monkeypatch.setattr(save_mod, "_stream", disk_full_on_second_save)
    ckpt = tmp_path / "ckpt"
    flags = ["--steps", "6", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt)]
    code, events, err = _train(capsys, tmp_path, *flags)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "No space left on device" in err and "step 4" in err
    (saved,) = _saved(events)  # only the save that happened is reported
    assert saved.name == "step-00000002" and saved.is_dir()
    assert str(saved) in err  # where to resume from
    assert sorted(p.name for p in saved.parent.iterdir()) == ["step-00000002"]  # no partial


def test_resuming_a_run_another_process_holds_forks_a_new_run(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    code, events, _ = _train(capsys, tmp_path, "--steps", "2", *flags)
    assert code == 0
    run = _saved(events)[-1].parent
    before = _tree(run)
    holder = RunDirectory.resume(run)  # as a live process training this run would
    assert holder is not None
    try:
        code, events, _ = _train(capsys, tmp_path, "--resume", "--steps", "3", *flags)
    finally:
        holder.close()
    assert code == 0 and "saving as a new run" in _notes(events)
    assert {p.parent for p in _saved(events)} != {run}
    assert _tree(run) == before


def test_resuming_an_older_checkpoint_keeps_the_newer_ones(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    code, events, _ = _train(capsys, tmp_path, "--steps", "2", *flags)
    assert code == 0
    older = _saved(events)[0]
    before = _tree(older.parent)
    code, events, _ = _train(capsys, tmp_path, "--resume", str(older), "--steps", "2", *flags)
    assert code == 0
    assert _saved(events)[-1].parent != older.parent
    assert _tree(older.parent) == before


def _subprocess(*flags: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "infinity", *TINY, *flags],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(240, proc.kill)  # NOTE: a hung run fails, never blocks
    watchdog.daemon = True
    watchdog.start()
    return proc


def test_two_runs_at_once_in_one_working_directory(tmp_path):
    """Both use the default checkpoint directory; neither fails or deletes the other's."""
    flags = ["--steps", "3", "--checkpoint-every", "1"]
    procs = [
        _subprocess(*flags, "--seed", str(seed), "--nvme-path", f"nvme{seed}", cwd=tmp_path)
        for seed in (1, 2)
    ]
    for seed, proc in zip((1, 2), procs, strict=True):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        saved = _saved([json.loads(line) for line in out.splitlines()])
        assert [p.name for p in saved] == [f"step-{s:08d}" for s in range(1, 4)]
        run = tmp_path / saved[-1].parent
        assert sorted(p.name for p in run.iterdir()) == ["step-00000002", "step-00000003"]
        assert all(_seed(run / name) == seed for name in ("step-00000002", "step-00000003"))
    runs = list((tmp_path / ".infinity" / "checkpoints").iterdir())
    assert len(runs) == 2


def test_second_sigterm_abandons_the_step_with_exit_143(tmp_path):
    proc = _subprocess(
        "--steps", "100000", "--checkpoint-every", "2", "--nvme-path", "nvme",
        "--checkpoint-dir", "ckpt", cwd=tmp_path,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if '"event": "checkpoint"' in line:
            break
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "last complete checkpoint" in err


@pytest.mark.parametrize(
    "change",
    [
        lambda state: [],
        lambda state: {**state, "rng": "AAAA"},
        lambda state: {**state, "scheduler": {"last_epoch": "x"}},
        lambda state: {**state, "step": -3},
    ],
)
def test_damaged_trainer_json_is_refused_in_one_line(tmp_path, capsys, change):
    flags = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "2"]
    code, events, _ = _train(capsys, tmp_path, *flags)
    assert code == 0
    trainer = _saved(events)[-1] / "trainer.json"
    trainer.write_text(json.dumps(change(json.loads(trainer.read_text()))))
    code, _events, err = _train(capsys, tmp_path, "--resume", *flags[:2], "--steps", "4")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("infinity: error: --resume")
    assert "is damaged" in err or "not an infinity train checkpoint" in err
