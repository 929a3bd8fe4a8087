"""``nvme_busy_seconds`` in ``infinity.stats``: how long the disk worked for each step.

Checked against the step timer's wall clock: a step that moved NVMe bytes was
busy for part of its interval, never longer than it; a model without NVMe has none.
"""

from __future__ import annotations

from engine_helpers import batches, config, param_bytes, tiny_gpt, train

import infinity
from infinity.optim import CPUAdam


def _laps(model) -> list[dict]:
    laps: list[dict] = []

    def record(step: int) -> None:
        if step > 0:
            laps.append(dict(infinity.stats(model)["last_step"]))

    train(model, CPUAdam(model.parameters(), lr=1e-3), batches(4), before_step=record)
    return laps


def test_busy_time_of_each_step_is_within_its_wall_time(tmp_path):
    model = tiny_gpt(hidden=64)
    pbytes = param_bytes(model, 4)
    model = infinity.offload(
        model,
        config(device_memory=pbytes // 2, host_memory=pbytes, chunk_size="32KiB",
               nvme_path=str(tmp_path)),
    )  # fmt: skip
    laps = _laps(model)
    assert laps
    for lap in laps:
        assert lap["nvme_read_bytes"] + lap["nvme_write_bytes"] > 0
        # (+1 ms: the step timer reads its clock and the counters one after the other)
        assert 0 < lap["nvme_busy_seconds"] <= lap["seconds"] + 1e-3
    assert infinity.stats(model)["nvme_busy_seconds"] >= sum(
        lap["nvme_busy_seconds"] for lap in laps
    )


def test_no_nvme_no_busy_time():
    model = tiny_gpt(hidden=64)
    model = infinity.offload(model, config(device_memory=param_bytes(model, 4) // 2))
    for lap in _laps(model):
        assert lap["nvme_busy_seconds"] == 0.0
    assert infinity.stats(model)["nvme_busy_seconds"] == 0.0
