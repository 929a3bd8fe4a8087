"""``infinity bench scale``: the size it picks fits the disk, and its report agrees with
independent measurements (transformers' own parameter count, the kernel's peak RSS of
the process, bytes per parameter from the dtypes)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import psutil
import pytest
import torch

from infinity.bench.scale_run import Shape, family, pick_shape

transformers = pytest.importorskip("transformers")

# bf16 parameter + bf16 gradient + fp32 master, exp_avg and exp_avg_sq
BF16_STATE_BYTES = 2 + 2 + 4 + 4 + 4
MiB = 1 << 20


def hf_params(hidden: int, layers: int, vocab: int, intermediate: int, heads: int) -> int:
    """Parameters of the Llama ``transformers`` builds for this shape (on meta: no memory)."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


def shape_params(shape: Shape) -> int:
    return hf_params(shape.hidden, shape.layers, shape.vocab, shape.intermediate, shape.heads)


@pytest.mark.parametrize("disk", [41 * MiB, 300 * MiB, 5 << 30, 70 << 30])
def test_picked_model_fits_and_the_next_one_does_not(disk):
    shape = pick_shape(vocab=8192, dtype="bf16", max_states=disk)
    members = list(family(8192))
    bigger = members[members.index(shape) + 1]
    assert shape_params(shape) * BF16_STATE_BYTES <= disk
    assert shape_params(bigger) * BF16_STATE_BYTES > disk


def test_nothing_fits_a_tiny_disk():
    with pytest.raises(ValueError, match="smallest model"):
        pick_shape(vocab=8192, dtype="bf16", max_states=MiB)


def test_bench_scale_tiny_report_matches_independent_counts(tmp_path):
    nvme = tmp_path / "nvme"
    cmd = [
        sys.executable, "-m", "infinity", "bench", "scale",
        "--nvme-path", str(nvme), "--max-disk", "24MiB", "--margin", "0",
        "--measure-size", "4MiB", "--vocab", "256", "--seq-len", "32", "--steps", "3",
        "--device-memory", "2MiB", "--host-memory", "2MiB", "--json",
    ]  # fmt: skip
    # wait4 gives the kernel's own peak RSS of the child once it has exited.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched = psutil.Process(proc.pid)
    seen = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            seen = max(seen, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.01)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])

    # The model: what transformers builds for the reported shape, and it fits the disk.
    params = hf_params(
        report["hidden"], report["layers"], report["vocab"],
        report["intermediate"], report["heads"],
    )  # fmt: skip
    assert report["params"] == params
    assert report["states_bytes"] == params * BF16_STATE_BYTES
    usable = 24 * MiB - 4 * MiB  # --max-disk less the measurement file, no margin
    assert report["states_bytes"] <= usable
    members = list(family(256))
    picked = [m.hidden for m in members].index(report["hidden"])
    assert shape_params(members[picked + 1]) * BF16_STATE_BYTES > usable
    # The states exceed both budgets: most of them went to the disk and came back.
    assert report["states_bytes"] > report["device_budget_bytes"] + report["host_budget_bytes"]
    assert report["nvme_bytes"] > 0
    assert report["nvme_read_bytes_per_step"] > 0 and report["nvme_write_bytes_per_step"] > 0
    # Peak RSS: at most the kernel's peak of the whole run, at least what polling saw
    # (NOTE: less the little the process grows after its report, printing and exiting).
    assert seen - 4 * MiB <= report["peak_rss_bytes"] <= usage.ru_maxrss * 1024
    assert report["ram_bytes"] == psutil.virtual_memory().total
    # Step time and the I/O bound from the report's own parts.
    assert len(report["steps"]) == 3 and len(report["losses"]) == 3
    assert report["step_seconds"] == statistics.median(report["steps"][1:])
    read_b, write_b = report["nvme_read_bytes_per_step"], report["nvme_write_bytes_per_step"]
    read_s = read_b / (report["disk_read_gbps"] * 1e9)
    write_s = write_b / (report["disk_write_gbps"] * 1e9)
    # both directions at once at the measured rate of both, or one after the other
    shared = min(read_b, write_b)
    r, w = report["disk_read_gbps"] * 1e9, report["disk_write_gbps"] * 1e9
    bound = (
        min(2 * shared / (report["disk_both_gbps"] * 1e9), shared / r + shared / w)
        + (read_b - shared) / r
        + (write_b - shared) / w
    )
    assert report["io_bound_seconds"] == pytest.approx(bound, rel=1e-12)
    assert report["io_serial_seconds"] == pytest.approx(read_s + write_s, rel=1e-12)
    assert report["io_duplex_seconds"] == pytest.approx(max(read_s, write_s), rel=1e-12)
    assert report["vs_io_bound"] == pytest.approx(report["step_seconds"] / bound, rel=1e-12)
    for rate in ("read", "write", "both", "first_write"):
        measured = [m[f"{rate}_gbps"] for m in report["disk_measured"]]
        assert len(measured) == 2 and min(measured) > 0
        assert report[f"disk_{rate}_gbps"] == max(measured)
    # The disk was busy for part of each step, never longer than the longest step.
    assert 0 < report["nvme_busy_seconds"] <= max(report["steps"][1:])
    gbps = (read_b + write_b) / 1e9
    assert report["nvme_gbps"] == pytest.approx(gbps / report["step_seconds"], rel=1e-12)
    assert report["nvme_busy_gbps"] == pytest.approx(gbps / report["nvme_busy_seconds"], rel=1e-12)
    # The planner's estimate that bench/state_dtype.py --scale-io-seconds sizes a run
    # by: the same scale as what the step moved (the plan counts no cached re-reads).
    from infinity.bench.scale_run import planned_nvme_bytes
    from infinity.config import Config

    config = Config(
        dtype="bf16", device="cpu", device_memory="2MiB", host_memory="2MiB", nvme_path=str(nvme)
    )
    planned = sum(planned_nvme_bytes(Shape(report["hidden"], report["layers"], 256), config))
    assert 0.75 * planned <= read_b + write_b <= 1.1 * planned
    assert report["device"] == "cpu"
    # Training on one repeated batch: finite losses near ln(256) that fall.
    losses = report["losses"]
    assert all(x == x and 0 < x < 10 for x in losses)
    assert losses[0] > losses[1] > losses[2]
    # The swap files are gone.
    assert [p for p in nvme.rglob("*") if p.is_file()] == []


def test_overlap_and_device_flags_reach_the_config(tmp_path):
    from infinity.bench.scale import add_arguments, scale_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags, overlap in (([], False), (["--overlap-optimizer"], True)):
        args = parser.parse_args(["--nvme-path", str(tmp_path), *flags])
        assert scale_config(args).overlap_optimizer is overlap
        assert scale_config(args).device == "cpu"
    args = parser.parse_args(["--nvme-path", str(tmp_path), "--device", "cuda"])
    assert scale_config(args).device == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
def test_device_cuda_without_a_gpu_is_a_one_line_error(tmp_path):
    from infinity.bench.scale import add_arguments, run
    from infinity.cli.main import CommandError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--nvme-path", str(tmp_path), "--device", "cuda"])
    with pytest.raises(CommandError, match="--device cuda: no CUDA GPU here"):
        run(args)


@pytest.mark.parametrize(
    ("read_b", "write_b", "both", "expected"),
    [
        # a disk that reads and writes at full speed at once: the slower direction
        (2e9, 2e9, 2.0, 2.0),
        (3e9, 1e9, 2.0, 3.0),
        (1e9, 3e9, 2.0, 3.0),
        # one that serialises them: the two directions one after the other
        (2e9, 2e9, 1.0, 4.0),
        (3e9, 1e9, 1.0, 4.0),
        # one slower at both at once than one after the other: one after the other
        (2e9, 2e9, 0.5, 4.0),
        # in between
        (2e9, 2e9, 1.6, 2.5),
        # nothing to write
        (3e9, 0.0, 1.0, 3.0),
    ],
)
def test_io_bound_between_full_duplex_and_one_after_the_other(read_b, write_b, both, expected):
    from infinity.io.rates import DiskMix, io_bound_seconds

    disk = DiskMix(read_gbps=1.0, write_gbps=1.0, first_write_gbps=0.5, both_gbps=both)
    assert io_bound_seconds(read_b, write_b, disk) == pytest.approx(expected, rel=1e-12)


def test_measure_mix_rates_and_cleanup(tmp_path):
    from infinity.config import AioConfig
    from infinity.io.rates import DiskMix, faster, measure_mix

    disk = measure_mix(str(tmp_path), 8 * MiB, AioConfig(block_size="1MiB", queue_depth=4))
    assert all(rate > 0 for rate in disk.as_dict().values())
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    slow = DiskMix(1.0, 1.0, 1.0, 1.0)
    assert faster(slow, DiskMix(2.0, 0.5, 3.0, 0.1)) == DiskMix(2.0, 1.0, 3.0, 1.0)
    with pytest.raises(ValueError, match="multiple of 4096"):
        measure_mix(str(tmp_path), 4096 + 1, AioConfig())
