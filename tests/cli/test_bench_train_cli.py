"""``infinity bench train`` at tiny size: every case runs and the report is complete."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_train_tiny(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "infinity",
            "bench",
            "train",
            "--layers",
            "4",
            "--hidden",
            "64",
            "--heads",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--block",
            "2",
            "--nvme-path",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    cases = {c["case"]: c for c in report["cases"]}
    assert set(cases) == {"a", "b", "c", "c0", "d", "d0"}
    assert cases["a"]["vs_plain"] == 1.0
    assert all(len(c["steps"]) == 2 for c in cases.values())
    # Paired ratios: one per round (block 2 times one step, so two rounds).
    assert all(len(c["round_ratios"]) == 2 for c in cases.values())
    assert cases["a"]["round_ratios"] == [1.0, 1.0]
    b = cases["b"]
    assert min(b["round_ratios"]) <= b["vs_plain"] <= max(b["round_ratios"])
    for name in ("c", "d"):
        case = cases[name]
        # Against max(plain, I/O bound) per round, never more than against plain.
        assert len(case["bound_round_ratios"]) == 2
        pairs = zip(case["bound_round_ratios"], case["round_ratios"], strict=True)
        assert all(x <= y + 1e-12 for x, y in pairs)
        assert min(case["bound_round_ratios"]) <= case["vs_bound"]
        assert case["vs_bound"] <= max(case["bound_round_ratios"])
    table = out.stdout
    for name in ("b", "c", "d"):
        row = next(line for line in table.splitlines() if line.startswith(f"{name} "))
        assert "of 2 rounds" in row, row
    assert cases["b"]["traffic_per_step"]["h2d_bytes"] > 0
    assert cases["b"]["traffic_per_step"]["nvme_write_bytes"] == 0
    for name in ("c0", "d", "d0"):
        traffic = cases[name]["traffic_per_step"]
        assert traffic["nvme_read_bytes"] > 0 and traffic["nvme_write_bytes"] > 0
        assert cases[name]["io_lower_bound_seconds"] > 0
    # c has c0's host budget, overlapped: its gradients leave the host first (the
    # step uses them from staging, never from disk), so it moves fewer disk bytes.
    for direction in ("nvme_read_bytes", "nvme_write_bytes"):
        assert (
            cases["c"]["traffic_per_step"][direction] < cases["c0"]["traffic_per_step"][direction]
        )
    assert report["nvme_read_gbps"] > 0
    assert list(tmp_path.iterdir()) == []  # swap and bench files removed
    bad = subprocess.run(
        [sys.executable, "-m", "infinity", "bench", "train", "--hidden", "30", "--heads", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "divisible" in bad.stderr
    # Two layers this narrow leave the device budget (half the parameters)
    # smaller than one module's chunks: a clear error, not a traceback.
    small = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "16"]
    bad = subprocess.run(
        [sys.executable, "-m", "infinity", "bench", "train", *small, "--nvme-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "too small for the bench" in bad.stderr and "Traceback" not in bad.stderr
    assert list(tmp_path.iterdir()) == []
    bad = subprocess.run(
        [sys.executable, "-m", "infinity", "bench", "train", "--block", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--block" in bad.stderr
