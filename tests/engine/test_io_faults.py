"""Every I/O outcome reaches the user: a failed read or write of a chunk home raises
``NVMeIOError`` from the next engine call, and the engine then refuses to go on.

The property (``fault_harness``): in a short training run with states on NVMe,
failing the n-th I/O either raises or leaves every parameter and optimizer
state bit-identical to the fault-free run. Sampled here (spread values of n per
case); ``bench/fault_sweep.py`` runs every n.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator

import pytest
import torch
from engine_helpers import batches, nvme_pair, resume_equals_uninterrupted, train
from fault_harness import Case, fired, run

import infinity
from infinity.io import available_backends
from infinity.offload import engine_of

BACKENDS = available_backends()
_references: dict[tuple, object] = {}


@pytest.fixture(autouse=True)
def _one_compute_thread() -> Iterator[None]:
    """The model is tiny: one compute thread runs it ~10x faster than a contended pool."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def reference(case: Case):
    """The fault-free run of ``case``'s configuration (cached per configuration)."""
    key = (case.backend, case.buffered, case.overlap, case.homes)
    if key not in _references:
        outcome = run(Case(case.backend, "eio", case.buffered, case.overlap, case.homes))
        assert outcome.error is None, outcome.error
        _references[key] = outcome
    return _references[key]


def spread(total: int, k: int) -> list[int]:
    """``k`` values of n from 1 to ``total``, evenly spaced (both ends included)."""
    return sorted({1 + round(i * (total - 1) / (k - 1)) for i in range(k)})


# (case, how many n, what every run must do)
CASES = [
    (Case("io_uring", "eio"), 12, "raised"),
    (Case("aio", "enospc"), 12, "raised"),
    (Case("threads", "eio"), 12, "raised"),
    (Case("io_uring", "eio-piece"), 12, "raised"),
    (Case("threads", "enospc"), 6, "raised"),
    (Case("threads", "eio", buffered=True), 12, "raised"),
    (Case("io_uring", "eio", overlap=True), 12, "raised"),
    (Case("io_uring", "eio", homes=True), 8, "raised"),
    (Case("io_uring", "short"), 8, "identical"),
    (Case("aio", "short"), 6, "identical"),
    (Case("threads", "short", buffered=True), 6, "identical"),
    (Case("io_uring", "submit"), 6, "raised"),
    (Case("aio", "submit"), 6, "raised"),
    (Case("io_uring", "submit-eagain"), 3, "identical"),
]


@pytest.mark.parametrize(("case", "samples", "expected"), CASES, ids=[str(c[0]) for c in CASES])
def test_nth_io_fails_then_error_or_identical(case: Case, samples: int, expected: str) -> None:
    """Fail the n-th I/O (request, piece or batch submission) for spread values of n."""
    if case.backend not in BACKENDS:
        pytest.skip(f"{case.backend} does not work on this machine")
    ref = reference(case)
    # NOTE: the number of I/Os varies a little from run to run (prefetches
    # depend on timing): sample up to 95% of the reference's count, and
    # require an error exactly when the fault met its n-th I/O.
    total = ref.pieces if case.kind in ("short", "eio-piece") else ref.requests
    if case.kind.startswith("submit"):
        total = ref.requests // 4  # batches: fewer than requests
    for nth in spread(total * 95 // 100, samples):
        outcome = run(case, nth)
        if expected == "raised" and fired(case, nth, outcome) is not False:
            assert isinstance(outcome.error, infinity.NVMeIOError), (nth, outcome.error)
        else:
            assert outcome.error is None, (nth, outcome.error)
            assert outcome.homes.keys() == ref.homes.keys()
            for key, value in ref.homes.items():
                assert torch.equal(outcome.homes[key], value), (nth, key)


def _fail_next_io(model) -> None:
    engine_of(model).swap.engine.inject_fault(1, errno.EIO, per="request")


def test_error_names_chunk_file_offset_errno_then_engine_refuses(tmp_path) -> None:
    """The first error names what failed and the fix; later calls refuse; close cleans up."""
    model, opt, _ref, _ref_opt = nvme_pair(tmp_path, host_factor=1.0)
    data = batches(3)
    train(model, opt, data[:1])
    engine = engine_of(model)
    swap_dir = engine.swap.directory
    engine.swap.engine.inject_fault(1, errno.EIO, per="request")
    with pytest.raises(infinity.NVMeIOError) as info:
        train(model, opt, data[1:2])
    err = info.value
    assert err.errno == errno.EIO and err.filename == engine.swap.path
    assert err.offset is not None and f"at offset {err.offset} " in str(err)
    assert re.search(r"(param|grad|optim) chunk \d+: ", str(err)) and err.filename in str(err)
    assert "Input/output error" in str(err) and "load_checkpoint" in str(err)
    for call in (
        lambda: model(*data[2]),
        lambda: opt.step(),
        lambda: model.state_dict(),
        lambda: engine.synchronize(),
        lambda: infinity.save_checkpoint(tmp_path / "ckpt", model, opt),
    ):
        with pytest.raises(
            infinity.NVMeIOError, match="refuses to run.*Input/output error"
        ) as again:
            call()
        assert again.value.errno == errno.EIO
    engine.close()  # already reported: cleans up without raising again
    assert not os.path.exists(swap_dir)


def test_checkpoint_before_the_fault_resumes_exactly(tmp_path) -> None:
    """Save, fault, then a fresh model loading that checkpoint trains exactly as a
    run that never failed (compared with a fault-free run, bit for bit)."""
    data = batches(4)
    model, opt, _r, _o = nvme_pair(tmp_path / "a", host_factor=1.0)
    train(model, opt, data[:2])
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    _fail_next_io(model)
    with pytest.raises(infinity.NVMeIOError):
        train(model, opt, data[2:])
    engine_of(model).close()
    resumed = resume_equals_uninterrupted(tmp_path, tmp_path / "ckpt", data, start=2)
    engine_of(resumed).close()


def test_close_raises_a_failure_still_in_flight_and_cleans_up(tmp_path) -> None:
    """A transfer that fails while nobody waits (queued behind a slow disk when the
    step returns) is raised by close(), after the swap file is removed."""
    model, opt, _ref, _ref_opt = nvme_pair(tmp_path, host_factor=1.0)
    data = batches(2)
    train(model, opt, data[:1])
    loss = model(*data[1])
    loss.backward()
    engine = engine_of(model)
    swap_dir = engine.swap.directory
    io = engine.swap.engine
    io.inject_delay(300_000)  # every request from now on starts 0.3 s late
    io.inject_fault(1, errno.ENOSPC, per="request")
    opt.step()  # queues the NVMe updates and starts their reads; returns before they land
    with pytest.raises(infinity.NVMeIOError) as info:
        engine.close()
    assert info.value.errno == errno.ENOSPC
    assert re.search(r"(param|grad|optim) chunk \d+: ", str(info.value))
    assert not os.path.exists(swap_dir)
