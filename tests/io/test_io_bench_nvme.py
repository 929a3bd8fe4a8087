"""``infinity bench nvme`` at a tiny size: exit codes, JSON contract, plot, no leftovers."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time

import pytest
from io_helpers import REPO_ROOT, python_child, run_python

import infinity


def _run_cli(*args: str):
    code = f"import sys; from infinity.cli.main import main; sys.exit(main({list(args)!r}))"
    return run_python(code, timeout=120)


def test_tiny_sweep_json_plot_and_cleanup(tmp_path):
    out_dir = tmp_path / "bench"
    out_dir.mkdir()
    png = tmp_path / "sweep.png"
    result = _run_cli(
        "bench", "nvme", "--path", str(out_dir), "--size", "8MiB",
        "--block-sizes", "256K", "--queue-depths", "4", "--json", "--plot", str(png),
        "--repeats", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    data = json.loads(last)
    assert set(data) >= {"points", "best"}
    backends = infinity.io.available_backends()
    assert [p["backend"] for p in data["points"]] == backends  # one point per backend
    for p in data["points"]:
        assert p["block_size"] == 256 << 10 and p["queue_depth"] == 4 and p["threads"] == 1
        assert p["write_gbps"] > 0 and p["read_gbps"] > 0
        assert p["cpu_ms_per_gb"] >= 0  # rusage ticks: a tiny run may round to zero
    best = data["best"]
    assert set(best) == {"read_gbps", "write_gbps", "cpu_ms_per_gb", "aio"}

    # The recommendation: within the reported noise of the top, and no point within
    # it costs less CPU per GB.
    def total(p):
        return p["read_gbps"] + p["write_gbps"]

    top = max(total(p) for p in data["points"])
    # NOTE: no upper bound on the noise: it is the disk's, not the code's (a run
    # beside a benchmark that moved 61 GB a step measured 1.43).
    assert data["noise_measured"] and data["noise"] > 0
    assert total(best) >= top * (1 - data["noise"])
    near = [p for p in data["points"] if total(p) >= top * (1 - data["noise"])]
    assert best["cpu_ms_per_gb"] == min(p["cpu_ms_per_gb"] for p in near)
    assert total(data["fastest"]) == top
    # The aio block loads into Config unchanged.
    loaded = dataclasses.asdict(infinity.Config(aio=best["aio"]).aio)
    assert loaded == best["aio"]
    assert best["aio"]["backend"] in backends
    assert [b["block_size"] for b in data["baseline"]] == [256 << 10]
    # A real PNG, and the table on stdout.
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "aiofiles (buffered)" in result.stdout and "GB/s" in result.stdout
    assert os.listdir(out_dir) == []


def test_created_directory_is_removed_again(tmp_path):
    target = tmp_path / "made-by-bench"
    result = _run_cli(
        "bench", "nvme", "--path", str(target), "--size", "1MiB", "--block-sizes", "64K",
        "--queue-depths", "2", "--backends", "threads", "--no-baseline",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert not target.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-sizes", "3K"], "--block-sizes: 3K is not a multiple of 4K"),
        (["--block-sizes", "big"], "--block-sizes: 'big' is not a size"),
        (["--queue-depths", "0"], "--queue-depths: '0' is not an integer in 1..4096"),
        (["--size", "1000"], "--size: 1000 must be a positive multiple of 4K"),
        (["--backends", "spdk"], "--backends: unknown backend 'spdk'"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path, flags, message):
    result = _run_cli("bench", "nvme", "--path", str(tmp_path), "--size", "1MiB", *flags)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("infinity: error: ") and message in lines[0]
    assert result.stdout == ""
    assert os.listdir(tmp_path) == []


def test_uncreatable_path_exits_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = _run_cli("bench", "nvme", "--path", str(blocker / "sub" / "dir"), "--size", "1MiB")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--path: cannot create" in lines[0], result.stderr
    assert "is not an existing directory" in lines[0]


def _default_signals() -> None:
    """In the child: SIGINT and SIGHUP as a terminal would deliver them.

    NOTE: a test run started in the background (``cmd &``, ``nohup``) inherits
    them ignored, and Python then installs no Ctrl-C handler at all.
    """
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def test_ctrl_c_removes_files(tmp_path):
    """SIGINT in the middle of a point exits 130 and leaves nothing behind."""
    out_dir = tmp_path / "bench"
    out_dir.mkdir()
    args = [
        "bench", "nvme", "--path", str(out_dir), "--size", "2GiB", "--block-sizes", "64K",
        "--queue-depths", "2", "--backends", "threads", "--no-baseline",
    ]  # fmt: skip
    code = f"import sys; from infinity.cli.main import main; sys.exit(main({args!r}))"
    command, env = python_child(code)
    proc = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_signals,
    )
    try:
        deadline = time.monotonic() + 20
        while not os.listdir(out_dir):  # the swap file's private directory appears
            assert proc.poll() is None, "the benchmark ended before it could be interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # let transfers start
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "infinity: interrupted" in stderr
    assert os.listdir(out_dir) == []
