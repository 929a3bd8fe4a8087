"""Every byte the engine allocates is in a named line of a budget, counted where it is
allocated.

On the CPU backend the engine's memory (device slots, host homes and staging, the saved
activations' buffers and windows) comes from one allocator, ``aligned_empty``. The test
counts what it hands out while alive, at its peak over offloading and training steps,
and holds it against what ``infinity.stats(model)["memory"]`` says the lines may hold:
an allocation outside every line makes the count pass their limits.
"""

from __future__ import annotations

import weakref

import pytest
from engine_helpers import batches, gpt_loss, tiny_gpt

import infinity
import infinity.activations.store as store_module
import infinity.devices.cpu as cpu_module


class Counted:
    """``aligned_empty`` counting the bytes alive of what it returned, and their peak."""

    def __init__(self, allocate):
        self.allocate = allocate
        self.live = 0
        self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __call__(self, nbytes, *args, **kwargs):
        tensor = self.allocate(nbytes, *args, **kwargs)
        storage = tensor.untyped_storage()
        weakref.finalize(storage, self._free, storage.nbytes())
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        return tensor


@pytest.mark.parametrize("activations", ["keep", "offload"])
def test_the_allocators_peak_stays_within_the_lines(monkeypatch, tmp_path, activations):
    counted = Counted(cpu_module.aligned_empty)
    monkeypatch.setattr(cpu_module, "aligned_empty", counted)
    monkeypatch.setattr(store_module, "aligned_empty", counted)
    config = infinity.Config(
        device="cpu",
        dtype="fp32",
        device_memory="256KiB",
        host_memory="1MiB",
        nvme_path=str(tmp_path),
        activations=activations,
        activation_min_bytes=0,
    )
    model = infinity.offload(tiny_gpt(layers=4, hidden=64), config)
    opt = infinity.optim.CPUAdam(model.parameters(), lr=1e-3)
    for batch in batches(2, batch=4):
        gpt_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    memory = infinity.stats(model)["memory"]
    limits = sum(
        line["limit"] for tier in ("host", "device") for line in memory[tier]["lines"].values()
    )
    # NOTE: a saved tensor larger than the read window is read into the tensor backward
    # computes with (the step's working set, reported apart, not a line)
    on_demand = memory["host"].get("reads_on_demand_peak_bytes", 0)
    assert counted.peak <= limits + on_demand, (counted.peak, limits, on_demand, memory)
    # the count sees the lines' own slabs: it is no looser than the lines
    slabs = sum(line["limit"] for line in memory["device"]["lines"].values())
    assert counted.peak >= slabs + memory["host"]["lines"]["chunk homes and staging"]["limit"]
    for tier in ("host", "device"):
        for name, line in memory[tier]["lines"].items():
            assert line["peak"] <= line["limit"], (tier, name, line)
        assert (
            sum(line["limit"] for line in memory[tier]["lines"].values())
            <= memory[tier]["budget_bytes"]
        )
    if activations == "offload":
        act = infinity.stats(model)["activations"]
        assert act["nvme_peak_bytes"] > 0  # the windows were used, not bypassed


def test_adafactor_stepping_an_oversize_tensor_whole_counts_its_copies(tmp_path):
    # host staging too small for the oversize chunks whole: they travel in spans, and
    # Adafactor (which reads whole tensors) steps each from copies of its master and
    # gradient, outside the host budget, in the transient account
    config = infinity.Config(
        device="cpu",
        dtype="fp32",
        chunk_size="16KiB",
        device_memory="2MiB",
        host_memory="1MiB",
        nvme_path=str(tmp_path),
    )
    model = infinity.offload(tiny_gpt(layers=2, hidden=64), config)
    opt = infinity.optim.CPUAdafactor(model.parameters(), lr=1e-3)
    for batch in batches(2, batch=2):
        gpt_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    copies = infinity.stats(model)["memory"]["host"]["transient_copies"]
    assert 0 < copies["peak"] <= copies["limit"], copies
