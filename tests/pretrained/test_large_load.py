"""Loading a checkpoint larger than the host budget keeps peak RSS within the budgets.

A subprocess builds the model under ``init_empty``, offloads it with NVMe on
and loads a 224 MiB fp32 checkpoint (written by ``safetensors.torch.save_file``)
afterwards, or as the initialisation, with a 64 MiB host and a 48 MiB device
budget; its peak RSS (``VmHWM``, reset just before) may exceed its RSS before
by the budgets plus a stated constant. The loaded values are then checked
against the file, read with ``safe_open``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

LAYERS, WIDTH = 56, 1024  # 56 x 4 MiB of fp32 weights
DEVICE_MIB, HOST_MIB = 48, 64
# NOTE: the constant covers the read block (16 MiB), the fp32 scratch chunks of
# the initial fill (a few MiB), transient conversions and allocator slack.
CONSTANT_MIB = 64

SCRIPT = textwrap.dedent(
    rf"""
    import json, re, sys, torch
    from safetensors import safe_open
    from torch import nn
    import infinity

    def status_mib(field):
        return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read())[1]) / 1024

    with infinity.init_empty():
        model = nn.Sequential(*[nn.Linear({WIDTH}, {WIDTH}, bias=False) for _ in range({LAYERS})])
    model.requires_grad_(False)  # frozen: no optimizer states to write, so the test is quick
    # NOTE: reset the peak (VmHWM) so that imports' transient peaks do not hide the load's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status_mib("VmRSS")
    config = infinity.Config(device="cpu", dtype="fp32", device_memory="{DEVICE_MIB}MiB",
                             host_memory="{HOST_MIB}MiB", nvme_path=sys.argv[2])
    if sys.argv[3] == "load_pretrained":  # offload, then overwrite from the file
        model = infinity.offload(model, config, init=lambda m: None)
        result = infinity.load_pretrained(model, sys.argv[1])
    else:  # the file is the initialisation (what infinity.from_pretrained does)
        from infinity.pretrained.load import offload_pretrained
        model, result = offload_pretrained(lambda: (model, None), sys.argv[1], config)
    peak = status_mib("VmHWM")
    stats = infinity.stats(model)
    wrong = []
    with safe_open(sys.argv[1], framework="pt") as f:
        for name, value in model.state_dict().items():
            if not torch.equal(value, f.get_tensor(name)):
                wrong.append(name)
    print(json.dumps({{"base": base, "peak": peak, "wrong": wrong, "result": list(result),
                      "nvme_bytes": stats["nvme_bytes"]}}))
    """
)


@pytest.mark.parametrize("route", ["load_pretrained", "offload_pretrained"])
def test_checkpoint_bigger_than_host_budget_loads_in_bounded_memory(tmp_path, route):
    generator = torch.Generator().manual_seed(0)
    tensors = {f"{i}.weight": torch.randn(WIDTH, WIDTH, generator=generator) for i in range(LAYERS)}
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))
    file_mib = path.stat().st_size / 2**20
    del tensors
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), str(nvme), route],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert file_mib > DEVICE_MIB + HOST_MIB + CONSTANT_MIB  # the file cannot fit the bound
    print(r["peak"] - r["base"])
    assert r["peak"] - r["base"] <= DEVICE_MIB + HOST_MIB + CONSTANT_MIB, r
    assert r["result"] == [[], [], []]
    assert r["wrong"] == []
    assert r["nvme_bytes"] > 0
