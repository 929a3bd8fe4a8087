"""A rank that dies in the middle of a sharded training step stops the others.

Rank 1 exits abruptly (``os._exit``: no exception, no cleanup) halfway through
backward; rank 0, blocked in a collective of the same step, must raise
:class:`infinity.distributed.DistributedError` naming itself and the
operation, well within the harness's timeout, instead of hanging.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from engine_helpers import tiny_llama
from harness import spawn_ranks

import infinity
from infinity.distributed import DistributedError
from infinity.optim import CPUAdam

pytestmark = pytest.mark.distributed

TIMEOUT = 120.0


def _dies_in_backward(rank: int, nvme: str) -> float:
    config = infinity.Config(
        device="cpu",
        dtype="fp32",
        device_memory="512KiB",
        host_memory="400KiB",
        nvme_path=nvme,
        chunk_size="32KiB",
    )
    model = infinity.offload(tiny_llama(128, hidden=64, tie=True), config)
    optimizer = CPUAdam(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()  # one healthy step
    optimizer.step()
    optimizer.zero_grad()
    if rank == 1:
        # Layer 0's output gets its gradient late in backward: after some gradient
        # chunks were reduced, before the rest.
        def die_in_backward(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            hidden.register_hook(lambda _grad: os._exit(3))

        model.model.layers[0].register_forward_hook(die_in_backward)
    loss = model(input_ids=ids, labels=ids).loss
    started = time.monotonic()
    try:
        loss.backward()
        optimizer.step()
    except DistributedError as exc:
        elapsed = time.monotonic() - started
        message = str(exc)
        assert "rank 0 of 2" in message and "failed" in message, message
        return elapsed
    raise AssertionError("rank 0 went on after rank 1 died")


def test_a_rank_dying_mid_step_stops_the_other_with_a_clear_error(tmp_path):
    outcomes = spawn_ranks(_dies_in_backward, str(tmp_path), timeout=TIMEOUT)
    assert outcomes[1].exitcode == 3 and not outcomes[1].finished
    survivor = outcomes[0]
    assert survivor.error is None, survivor.describe()
    assert survivor.finished, survivor.describe()
    assert survivor.result < TIMEOUT / 2, survivor.result
