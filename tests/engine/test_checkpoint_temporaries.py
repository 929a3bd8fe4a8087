"""Checkpoint temporaries carry their owner's PID and are reclaimed once it is gone, never before.

The names are built here from the documented format
(``.NAME.partial-<crc32 of hostname>-<pid>-<start time>-<hex>``), and the
owners are real processes: this one, a sleeping child, a finished child, and a
child killed with SIGKILL in the middle of a save.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import zlib
from pathlib import Path

from engine_helpers import config, tiny_gpt

import infinity

NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]


def _start(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _temp(directory: Path, name: str, pid: int, start: int, kind: str = "partial") -> Path:
    host = f"{zlib.crc32(socket.gethostname().encode()):08x}"
    path = directory / f".{name}.{kind}-{host}-{pid}-{start}-c0ffee"
    path.mkdir()
    (path / "param.bin").write_bytes(b"half")
    return path


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _model():
    return infinity.offload(tiny_gpt(), config(device_memory="1MiB", host_memory="64MiB"))


def test_dead_owners_temporaries_are_reclaimed_and_live_ones_kept(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        me = os.getpid()
        dead = _temp(tmp_path, "ckpt", _dead_pid(), 12345)
        recycled = _temp(tmp_path, "ckpt", me, _start(me) + 1)  # same PID, another process
        mine = _temp(tmp_path, "ckpt", me, _start(me))
        living = _temp(tmp_path, "ckpt", sleeper.pid, _start(sleeper.pid))
        foreign = _temp(tmp_path, "other", _dead_pid(), 1)
        os.chown(foreign, NOBODY, NOBODY)
        stranded = _temp(tmp_path, "lost", _dead_pid(), 1, kind="old")  # died between renames
        infinity.save_checkpoint(tmp_path / "ckpt", _model())
        assert not dead.exists() and not recycled.exists()
        assert mine.is_dir() and living.is_dir() and foreign.is_dir()
        assert not stranded.exists() and (tmp_path / "lost" / "param.bin").read_bytes() == b"half"
    finally:
        sleeper.kill()
        sleeper.wait()


_KILLED_MID_SAVE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from engine_helpers import config, tiny_gpt
import infinity, infinity.checkpoint.temporaries as temporaries
model = infinity.offload(tiny_gpt(), config(device_memory="1MiB", host_memory="64MiB"))
temporaries.replace_dir = lambda new, target: os.kill(os.getpid(), signal.SIGKILL)
infinity.save_checkpoint({target!r}, model)
"""


def test_save_killed_with_sigkill_leaves_a_temporary_the_next_save_reclaims(tmp_path):
    code = _KILLED_MID_SAVE.format(tests=str(REPO / "tests" / "engine"), target=str(tmp_path / "a"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert result.returncode == -9, result.stderr
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".a.partial-") and (left / "meta.json").is_file()
    infinity.save_checkpoint(tmp_path / "b", _model())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


_FILE_SIZE_LIMIT = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
from engine_helpers import config, tiny_gpt
import infinity
model = infinity.offload(tiny_gpt(), config(device_memory="1MiB", host_memory="64MiB"))
infinity.save_checkpoint({target!r}, model)
with open({target!r} + "/param.bin", "rb") as f:
    before = f.read()
model.load_state_dict({{k: v + 1 for k, v in model.state_dict().items()}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # NOTE: the write then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    infinity.save_checkpoint({target!r}, model)
except OSError as exc:
    print(type(exc).__name__, exc.errno, exc)
with open({target!r} + "/param.bin", "rb") as f:
    print("unchanged" if f.read() == before else "changed")
"""


def test_a_write_the_kernel_refuses_keeps_the_previous_checkpoint_and_no_temporary(tmp_path):
    """The same path as a full disk: the error names the checkpoint, nothing half-written stays."""
    target = str(tmp_path / "ckpt")
    code = _FILE_SIZE_LIMIT.format(tests=str(REPO / "tests" / "engine"), target=target)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    error, verdict = result.stdout.strip().splitlines()
    assert error.startswith(f"OSError {errno.EFBIG} ")
    assert f"cannot save checkpoint {target}" in error
    assert verdict == "unchanged"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
