"""Bad ``Config`` inputs and config files give a ``ConfigError`` naming the field or path."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import config, param_bytes, tiny_gpt

import infinity
from infinity.cli.main import main as cli_main

BAD_VALUES = [
    ("host_memory", "9" * 400, r"host_memory='9+\.\.\.9' is too large"),
    ("chunk_size", "9" * 400, "chunk_size=.* is too large"),
    ("nvme_memory", 1e300, "nvme_memory=1e\\+300 is too large"),
    ("device_memory", 10**5000, r"device_memory=<an integer of \d+ bits> is too large"),
    ("prefetch_bytes", f"{2**63}", "prefetch_bytes=.* is too large"),
    ("device", 3, "device=3 must be 'auto', 'cpu'"),
    ("device", None, "device=None must be"),
    ("device", ["cpu"], r"device=\['cpu'\] must be"),
    ("device", torch.device("meta"), "device='meta' must be"),
    ("initial_loss_scale", math.inf, "initial_loss_scale=inf must be a positive, finite"),
    ("min_loss_scale", 10**400, "min_loss_scale=.* must be a positive, finite"),
    ("nvme_path", "/tmp/a\0b", "nvme_path=.* contains a NUL character"),
]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    BAD_VALUES,
    ids=[f"{field}-{i}" for i, (field, _, _) in enumerate(BAD_VALUES)],  # str(10**5000) fails
)
def test_bad_values_name_the_field_briefly(field, value, message):
    with pytest.raises(infinity.ConfigError, match=message) as info:
        infinity.Config(**{field: value})
    assert len(str(info.value)) < 300  # a 400-digit value is not repeated in full


def test_sizes_are_exact_and_a_torch_device_is_accepted(tmp_path):
    big = 2**62 + 1  # a float would round it
    cfg = infinity.Config(host_memory=str(big), device_memory="1.5KiB", device=torch.device("cpu"))
    assert (cfg.host_memory, cfg.device_memory, cfg.device) == (big, 1536, "cpu")
    assert infinity.Config(host_memory=f"{2**63 - 1}").host_memory == 2**63 - 1
    cfg.to_file(tmp_path / "c.json")
    assert infinity.Config.from_file(tmp_path / "c.json") == cfg


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "is a directory"),
        (b"\x7fELF\x02\x01\x01\x00\xff\xfe" * 30, "is not UTF-8 text"),
        (b'{"dtype": ', "is not valid JSON"),
        (b"[" * 100_000, "is not valid JSON"),
        (b'{"host_memory": 1' + b"0" * 5000 + b"}", "is not valid JSON"),
        (b" " * ((1 << 20) + 1), "is larger than"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"host_memory": "lots"}', "host_memory='lots' is not a size"),
    ],
    ids=["directory", "binary", "truncated", "nested", "digits", "huge", "list", "value"],
)
def test_bad_config_files_name_the_path(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(infinity.ConfigError, match=message) as info:
        infinity.Config.from_file(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("nvme_path", ["/proc", "/proc/not-there", "/sys/kernel"])
def test_nvme_path_on_a_pseudo_filesystem_says_so(nvme_path):
    model = tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    budgets = {"host_memory": param_bytes(model, 4) * 2, "device_memory": "1MiB"}
    for nvme_memory in ("auto", "64MiB"):
        with pytest.raises(infinity.ConfigError, match="on a (proc|sysfs) file system") as info:
            infinity.offload(model, config(nvme_path=nvme_path, nvme_memory=nvme_memory, **budgets))
        assert "0 B" not in str(info.value) and f"nvme_path='{nvme_path}'" in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_bench_nvme_refuses_a_pseudo_filesystem(capsys):
    assert cli_main(["bench", "nvme", "--path", "/proc/bench", "--size", "1MiB"]) == 2
    assert "'/proc/bench' is on a proc file system" in capsys.readouterr().err
