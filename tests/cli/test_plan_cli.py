"""``infinity plan``: the plan printed for a model and budgets, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infinity", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plan_puts_optimizer_state_on_nvme_first(tmp_path):
    small = ("--model", "small", "--device-memory", "512MiB", "--host-memory", "512MiB")
    small += ("--dtype", "bf16")  # the budgets are sized for 16-bit parameters
    out = _plan(*small, "--nvme-path", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    homes = plan["homes"]
    assert (
        homes["optim"].count("nvme") >= homes["grad"].count("nvme") >= homes["param"].count("nvme")
    )
    assert "nvme" in homes["optim"]
    assert plan["host_bytes"] <= 512 << 20 and plan["device_bytes"] <= 512 << 20
    assert plan["traffic_per_step"]["nvme_write_bytes"] > 0
    assert "nvme" in homes["grad"]
    # How each home's bytes travel (chunks/movers.py): NVMe homes through host staging.
    assert plan["routes"]["flush from nvme"] == "device -> staging -> nvme"
    assert plan["routes"]["step from nvme"] == "nvme -> staging"
    assert plan["routes"]["step from host"] == "host (in place)"
    # Overlapped, the gradients homed on NVMe are neither written nor read back:
    # they leave the host first, and optimizer units stay home instead.
    out = _plan(*small, "--nvme-path", str(tmp_path), "--overlap-optimizer", "--json")
    assert out.returncode == 0, out.stderr
    overlapped = json.loads(out.stdout.strip().splitlines()[-1])
    moved = overlapped["homes"]
    assert moved["grad"].count("nvme") > homes["grad"].count("nvme")
    assert moved["optim"].count("nvme") < homes["optim"].count("nvme")
    before, after = plan["traffic_per_step"], overlapped["traffic_per_step"]
    for direction in ("nvme_read_bytes", "nvme_write_bytes"):
        assert after[direction] < before[direction]
    assert after["h2d_bytes"] == before["h2d_bytes"]
    assert list(tmp_path.iterdir()) == []  # planning creates no files


def test_plan_table_and_errors(tmp_path):
    out = _plan("--model", "tiny", "--device-memory", "8MiB", "--host-memory", "64MiB")
    assert out.returncode == 0, out.stderr
    assert "parameters" in out.stdout and "bytes moved per step" in out.stdout
    assert "compute from host       host -> device" in out.stdout
    assert "from nvme" not in out.stdout  # no NVMe tier, no route from it
    bad = _plan("--model", "small", "--device-memory", "1GiB", "--host-memory", "1GiB")
    assert bad.returncode == 2
    assert "set nvme_path" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    unknown = _plan("--model", "huge")
    assert unknown.returncode == 2 and "unknown preset" in unknown.stderr
    size = _plan("--device-memory", "lots")
    assert size.returncode == 2 and "device_memory='lots'" in size.stderr


def test_plan_shows_the_bytes_of_each_optimizer_state_dtype(capsys):
    from infinity.cli.main import main  # in-process: three plans of a small model in a second

    args = ["plan", "--model", "small", "--layers", "2", "--dtype", "fp32"]
    args += ["--host-memory", "2GiB", "--device-memory", "512MiB"]
    units = {}
    for name in ("fp32", "bf16", "int8"):
        assert main([*args, "--optimizer-state-dtype", name, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert plan["optimizer_state_dtype"] == name
        units[name] = plan["optim_bytes"]
    assert main([*args, "--optimizer-state-dtype", "int8"]) == 0
    assert "optimizer states: int8" in capsys.readouterr().out
    # fp32 compute has no master: 8 bytes a parameter, 4 in bf16, 2 + 4/256 in int8
    # (within 2%: chunk tails, int8's block-aligned tensors, and oversize chunks
    # padded to int8's span granule of 262144 elements, see chunks/pools.py)
    assert 0.5 <= units["bf16"] / units["fp32"] <= 0.505
    assert (2 + 4 / 256) / 8 <= units["int8"] / units["fp32"] <= (2 + 4 / 256) / 8 * 1.02


def test_gpt2_config_plans_on_768mib_and_names_both_minimums(tmp_path):
    """A ``transformers`` GPT-2 124M (tied 50257 x 768 embedding) on 512 MiB of device
    and 768 MiB of host: it plans, and the table says why the device cannot shrink
    below the embedding while the host could go far lower."""
    transformers = pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257).to_json_file(
        config
    )
    budgets = ("--device-memory", "512MiB", "--host-memory", "768MiB", "--dtype", "fp32")
    args = ("--model", str(config), *budgets, "--nvme-path", str(tmp_path / "swap"))
    out = _plan(*args)
    assert out.returncode == 0, out.stderr
    assert "must be whole on the device" in out.stdout and "host minimum" in out.stdout
    plan = json.loads(_plan(*args, "--json").stdout.strip().splitlines()[-1])
    assert plan["host_bytes"] <= 768 << 20
    assert 0 < plan["min_host_bytes"] < 147 << 20  # below the embedding's own 147 MiB
    assert plan["staging_bytes"] <= 16 * plan["chunk_size"]


def test_plan_for_a_smaller_optimizer_moves_fewer_bytes(tmp_path):
    # The homes the optimizer constructed over the model gets (NOTE [homes planned for
    # the optimizer]): Lion keeps one state slot, Adafactor none in the chunks.
    small = ("--model", "small", "--device-memory", "512MiB", "--host-memory", "512MiB")
    small += ("--dtype", "bf16")  # the budgets are sized for 16-bit parameters
    plans = {}
    for name in ("adamw", "lion", "adafactor"):
        out = _plan(*small, "--nvme-path", str(tmp_path), "--optimizer", name, "--json")
        assert out.returncode == 0, out.stderr
        plans[name] = json.loads(out.stdout.strip().splitlines()[-1])
        assert plans[name]["optimizer"] == name
    moved = {
        n: sum(p["traffic_per_step"][k] for k in ("nvme_read_bytes", "nvme_write_bytes"))
        for n, p in plans.items()
    }
    assert moved["adafactor"] < moved["lion"] < moved["adamw"]
    assert plans["adafactor"]["optim_bytes"] < plans["lion"]["optim_bytes"]
    assert plans["lion"]["optim_bytes"] < plans["adamw"]["optim_bytes"]
    bad = _plan("--model", "tiny", "--optimizer", "sgd", "--optimizer-state-dtype", "int8")
    assert bad.returncode == 2 and "--optimizer sgd" in bad.stderr and "int8" in bad.stderr


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--seq-len", "-1"], "argument --seq-len: must be a positive whole number, got '-1'"),
        (["--layers", "0"], "argument --layers: must be a positive whole number"),
        (["--batch-size", "0"], "argument --batch-size: must be a positive whole number, got '0'"),
        (["--model", "missing/config.json"], "'missing/config.json': no such file"),
    ],
)
def test_bad_model_flags_are_named(capsys, flags, needle):
    """``--seq-len -1`` ended in a traceback (a tensor of negative size), ``--layers 0``
    printed a plan of no blocks, ``--batch-size 0`` was called a number of processes and
    a missing config.json reached transformers' hub check ("Repo id must be ...")."""
    from infinity.cli.main import main

    try:
        code = main(["plan", *flags])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err


def test_a_saved_models_folder_plans_like_its_config(tmp_path, capsys):
    from infinity.cli.main import main

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    outs = []
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        assert main(["plan", "--model", model, "--device", "cpu", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0]["homes"] == outs[1]["homes"] and outs[0]["homes"]
