"""Nothing left behind: a dropped model frees its threads and its swap file."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import batches, config, nvme_pair, param_bytes, tiny_gpt

import infinity
from infinity.optim import CPUAdam


def native_threads() -> list[str]:
    """Names of this process's threads started by infinity's native code (``inf-*``)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:
            continue  # the thread ended while we listed
        if name.startswith("inf-"):
            names.append(name)
    return sorted(names)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_dropped_models_free_threads_and_swap_dirs(tmp_path, overlap):
    gc.collect()  # garbage of earlier tests must not be freed during the measurement
    baseline = native_threads()
    x, y = batches(1)[0]
    for _ in range(5):
        model, optimizer, _, _ = nvme_pair(tmp_path, overlap_optimizer=overlap)
        assert len(native_threads()) > len(baseline)
        assert os.listdir(tmp_path), "the states should be on NVMe"
        model(x, y).backward()
        optimizer.step()  # with NVMe states the update trails into the next forward
        optimizer.zero_grad()
        del model, optimizer
        gc.collect()
        assert os.listdir(tmp_path) == []
        assert native_threads() == baseline


REPO_ROOT = Path(__file__).resolve().parents[2]

OFFLOAD_AND_WAIT = """
import sys, time
sys.path.insert(0, 'tests/engine')
from engine_helpers import nvme_pair
model, optimizer, _, _ = nvme_pair(sys.argv[1])
print('ready', flush=True)
time.sleep(120)
"""


def _default_signals() -> None:
    """In the child: SIGINT and SIGHUP as a terminal would deliver them.

    NOTE: a test run started in the background (``cmd &``, ``nohup``) inherits
    them ignored, and Python then installs no Ctrl-C handler at all.
    """
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


@contextlib.contextmanager
def child(code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A Python subprocess running ``code`` that has printed 'ready'; killed at the end."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_signals,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.poll() is not None else line
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), read independently."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[19])


def test_swap_dir_of_a_killed_process_is_reclaimed_by_the_next_offload(tmp_path):
    with child(OFFLOAD_AND_WAIT, str(tmp_path)) as proc:
        (owned,) = os.listdir(tmp_path)
        assert owned.startswith(f"infinity-chunks-{proc.pid}-{start_time(proc.pid)}-")
        directory = tmp_path / owned
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        (swap,) = directory.iterdir()
        assert stat.S_IMODE(swap.stat().st_mode) == 0o600 and swap.stat().st_size > 0
        # Never while the owner lives: another run in the same place leaves it.
        model, _, _, _ = nvme_pair(tmp_path)
        assert directory.exists() and len(os.listdir(tmp_path)) == 2
        del model
        gc.collect()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    assert os.listdir(tmp_path) == [owned]  # SIGKILL: nothing could clean up
    model, _, _, _ = nvme_pair(tmp_path)
    (mine,) = os.listdir(tmp_path)
    assert mine.startswith(f"infinity-chunks-{os.getpid()}-")
    del model
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_a_reused_pid_is_not_taken_for_the_owner(tmp_path):
    # The PID is alive (this process) but started at another time: the owner is gone.
    pid, start = os.getpid(), start_time(os.getpid())
    stale = tmp_path / f"infinity-chunks-{pid}-{start + 1}-abcd1234"
    stale.mkdir(mode=0o700)
    (stale / "chunks.bin").write_bytes(b"x" * 4096)
    other = tmp_path / "unrelated"  # not ours by name: never touched
    other.mkdir()
    model, _, _, _ = nvme_pair(tmp_path)
    names = os.listdir(tmp_path)
    assert stale.name not in names and "unrelated" in names and len(names) == 2
    del model
    gc.collect()
    assert os.listdir(tmp_path) == ["unrelated"]


BENCH_FILE_AND_WAIT = """
import sys, time
from infinity.io import SwapFile
swap = SwapFile(sys.argv[1], '1MiB', name='bench')
print('ready', flush=True)
time.sleep(120)
"""


def test_bench_nvme_reclaims_the_files_of_a_killed_run(tmp_path):
    with child(BENCH_FILE_AND_WAIT, str(tmp_path)) as proc:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert len(os.listdir(tmp_path)) == 1
    code = (
        "import sys; from infinity.cli.main import main; sys.exit(main(['bench', 'nvme', "
        f"'--path', {str(tmp_path)!r}, '--size', '1MiB', '--block-sizes', '64K', "
        "'--queue-depths', '2', '--backends', 'threads']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_remove_swap_files_and_still_kill(tmp_path, signum):
    with child(OFFLOAD_AND_WAIT, str(tmp_path)) as proc:
        assert len(os.listdir(tmp_path)) == 1
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == -signum  # died by the signal (143 in a shell)
    assert os.listdir(tmp_path) == []


USER_HANDLER_THEN_TRAIN = """
import signal, sys, time
sys.path.insert(0, 'tests/engine')
from engine_helpers import nvme_pair, train_pair_error
calls = []
signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
pair = nvme_pair(sys.argv[1])
print('ready', flush=True)
while not calls:
    time.sleep(0.01)
print('handled', calls, flush=True)
sys.stdin.readline()  # the test looks at the directory meanwhile
# The unlinked swap file still works through its open descriptor.
print(train_pair_error(*pair, steps=3), flush=True)
"""


def test_a_user_handler_is_chained_and_may_keep_the_process_alive(tmp_path):
    with child(USER_HANDLER_THEN_TRAIN, str(tmp_path)) as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "handled [15]"  # called once, the process lives
        assert os.listdir(tmp_path) == []  # removed before the user's handler ran
        proc.stdin.write("go\n")
        proc.stdin.flush()
        error = float(proc.stdout.readline())  # relative to plain PyTorch + AdamW
        assert proc.wait(timeout=60) == 0
    assert error < 1e-5


HANDLERS_FOLLOW_ENGINES = """
import gc, signal, sys
from engine_helpers import config, nvme_pair, tiny_gpt
import infinity
from infinity.optim import CPUAdam

signal.signal(signal.SIGHUP, signal.SIG_IGN)
before = signal.getsignal(signal.SIGTERM)
host_only = infinity.offload(tiny_gpt(), config())
assert signal.getsignal(signal.SIGTERM) is before, "no swap file: nothing to remove"
model, _, _, _ = nvme_pair(sys.argv[1])
assert signal.getsignal(signal.SIGTERM) is not before, "a swap file: a handler"
assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, "an ignored signal stays so"
del model
gc.collect()
assert signal.getsignal(signal.SIGTERM) is before, "the last swap file gone: handler back"
print("ok")
"""


def test_handlers_only_while_an_engine_with_swap_files_lives(tmp_path):
    # NOTE: in a fresh interpreter: an engine another test left alive (an autograd
    # graph cut by an exception can hold one from C++) would keep the handler.
    result = subprocess.run(
        [sys.executable, "-c", HANDLERS_FOLLOW_ENGINES, str(tmp_path)],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests' / 'engine'}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_failed_lay_out_frees_what_it_made_while_the_model_lives(tmp_path, monkeypatch):
    from infinity.runtime import engine as engine_module

    def no_memory(*args, **kwargs):
        raise MemoryError("injected: cannot allocate the slabs")

    gc.collect()
    baseline = native_threads()
    monkeypatch.setattr(engine_module, "ChunkManager", no_memory)
    model = tiny_gpt()  # kept alive: its finalizer cannot be what cleans up
    pbytes = param_bytes(model, 4)
    budgets = {"device_memory": pbytes * 6 // 10, "host_memory": pbytes * 2}
    infinity.offload(model, config(nvme_path=str(tmp_path), chunk_size="24KiB", **budgets))
    # NOTE [the layout is decided once, late]: the optimizer's construction allocates.
    with pytest.raises(MemoryError, match="injected"):
        CPUAdam(model.parameters())
    assert os.listdir(tmp_path) == []
    assert native_threads() == baseline
    # every later use names the failure, never computes with half-written chunks
    with pytest.raises(RuntimeError, match="could not be laid out.*MemoryError.*injected"):
        model(torch.zeros((1, 4), dtype=torch.long))


def test_no_handler_is_installed_from_another_thread(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    made = []
    worker = threading.Thread(target=lambda: made.append(nvme_pair(tmp_path)[0]))
    worker.start()
    worker.join()
    assert made and os.listdir(tmp_path)  # offloaded with a swap file, from that thread
    assert signal.getsignal(signal.SIGTERM) is before
    made.clear()
    gc.collect()
    assert os.listdir(tmp_path) == [] and signal.getsignal(signal.SIGTERM) is before
