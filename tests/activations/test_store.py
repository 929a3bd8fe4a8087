"""The activation store on its own: bytes back exactly, newest kept in memory,
read ahead in reverse order, nothing left behind, every disk error raised.

References are clones of the tensors taken before packing; the store's
counters are checked against sums of the tensors' sizes computed here.
"""

from __future__ import annotations

import errno
import gc
import random

import pytest
import torch

from infinity.activations.spill import ActivationSpill
from infinity.activations.store import ActivationStore, SavedActivation
from infinity.config import AioConfig
from infinity.io import NVMeIOError

KIB = 1024


def _store(
    tmp_path,
    host_capacity: int,
    *,
    nvme: bool = True,
    min_bytes: int = 0,
    read_ahead: int = 64 * KIB,
    write_window: int = 1 << 20,
) -> ActivationStore:
    spill = ActivationSpill(str(tmp_path), AioConfig(), None) if nvme else None
    return ActivationStore(
        torch.device("cpu"),
        shares_host_memory=True,
        host_capacity=host_capacity,
        min_bytes=min_bytes,
        spill=spill,
        read_ahead=read_ahead,
        write_window=write_window,
    )


def _tensors(count: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
    out = []
    for i in range(count):
        shape = (int(torch.randint(1, 40, (1,), generator=g)), 257)  # not a 4 KiB multiple
        out.append((torch.randn(shape, generator=g) * 100).to(dtypes[i % len(dtypes)]))
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("order", ["reverse", "shuffled", "forward"])
def test_values_come_back_exactly_in_any_order(tmp_path, order: str) -> None:
    store = _store(tmp_path, host_capacity=40 * KIB)
    tensors = _tensors(24)
    expected = [t.clone() for t in tensors]
    handles = [store.pack(t) for t in tensors]
    del tensors  # only the store holds the bytes now
    assert all(isinstance(h, SavedActivation) for h in handles)
    indices = list(range(len(handles)))
    if order == "reverse":
        indices.reverse()
    elif order == "shuffled":
        random.Random(3).shuffle(indices)
    for i in indices:
        got = store.unpack(handles[i])
        assert got.dtype == expected[i].dtype and got.shape == expected[i].shape
        assert torch.equal(got.view(torch.uint8), expected[i].view(torch.uint8)), i
    stats = store.snapshot()
    assert stats["nvme_written_bytes"] > 0, "the case must spill"
    assert stats["host_peak_bytes"] <= 40 * KIB
    store.close()


def test_the_newest_stay_in_memory_and_the_oldest_go_to_disk(tmp_path) -> None:
    tensors = _tensors(20, seed=1)
    capacity = sum(_nbytes(t) for t in tensors[-5:])  # exactly the last five
    store = _store(tmp_path, host_capacity=capacity)
    handles = [store.pack(t) for t in tensors]
    stats = store.snapshot()
    assert stats["host_bytes"] == capacity
    assert stats["nvme_written_bytes"] == sum(_nbytes(t) for t in tensors[:-5])
    assert stats["host_peak_bytes"] <= capacity
    del handles
    store.close()


def test_backward_order_reads_every_spilled_tensor_ahead(tmp_path) -> None:
    store = _store(tmp_path, host_capacity=16 * KIB, read_ahead=128 * KIB)  # > any tensor
    tensors = _tensors(30, seed=2)
    handles = [store.pack(t) for t in tensors]
    spilled = store.snapshot()["nvme_written_bytes"]
    store._reap_writes(block=True)  # every write landed: each must be read back
    store.end_forward()
    for h in reversed(handles):
        store.unpack(h)
    stats = store.snapshot()
    kept = stats["written_kept_bytes"]
    assert stats["nvme_read_bytes"] + kept == spilled, "each spilled tensor read exactly once"
    # The newest written stayed in their write buffers: at most the window, and some.
    assert 0 < kept <= 128 * KIB
    assert stats["reads_not_ahead"] == 0, "each read was started ahead of its use"
    store.close()


def test_newest_written_tensors_are_not_read_back(tmp_path) -> None:
    """Backward's first tensors were written last: the forward keeps their buffers, so
    backward does not start with a wait for the disk (issue 27: 0.2 s a step)."""
    store = _store(tmp_path, host_capacity=0)
    tensors = [torch.full((4096,), float(i)) for i in range(40)]  # 16 KiB each
    handles = [store.pack(t) for t in tensors]
    store._reap_writes(block=True)
    store.end_forward()
    newest = handles[-1].record
    assert newest.read is not None and newest.kept, "the newest tensor's buffer is kept"
    assert handles[0].record.read is None, "the oldest are on the disk only"
    for h, t in zip(reversed(handles), reversed(tensors), strict=True):
        assert torch.equal(store.unpack(h), t)
    stats = store.snapshot()
    assert stats["written_kept_bytes"] == 64 * KIB  # the window: the 4 newest
    assert stats["nvme_read_bytes"] == 36 * 16 * KIB
    store.close()


def test_dropped_handles_free_every_tier(tmp_path) -> None:
    store = _store(tmp_path, host_capacity=16 * KIB)
    handles = [store.pack(t) for t in _tensors(30, seed=4)]
    for h in handles[::3]:  # some used, the rest dropped unused (a graph freed)
        store.unpack(h)
    del h, handles
    gc.collect()
    store._reap_writes(block=True)
    stats = store.snapshot()
    assert stats["host_bytes"] == 0 and stats["nvme_bytes"] == 0
    assert store.spill is not None and store.spill.live == 0
    # The space is reused: a second round needs no new segment.
    segments = len(store.spill.segments)
    handles = [store.pack(t) for t in _tensors(30, seed=5)]
    assert len(store.spill.segments) == segments
    del handles
    store.close()


def test_small_tensors_and_other_devices_stay_put(tmp_path) -> None:
    store = _store(tmp_path, host_capacity=1 << 20, min_bytes=4 * KIB)
    small = torch.ones(100)
    big = torch.ones(2000)
    assert store.pack(small) is small
    assert isinstance(store.pack(big), SavedActivation)
    assert store.snapshot()["kept_small"] == 1
    store.close()


def test_without_nvme_what_does_not_fit_stays_on_the_device(tmp_path) -> None:
    store = _store(tmp_path, host_capacity=10 * KIB, nvme=False)
    tensors = [torch.ones(1024) for _ in range(4)]  # 4 KiB each
    with pytest.warns(RuntimeWarning, match="raise host_memory or set nvme_path"):
        packed = [store.pack(t) for t in tensors]
    assert [isinstance(p, SavedActivation) for p in packed] == [True, True, False, False]
    assert store.snapshot()["kept_on_device_bytes"] == 8 * KIB
    store.close()


@pytest.mark.parametrize("when", ["write", "read"])
def test_a_disk_error_is_raised_never_returned_as_data(tmp_path, when: str) -> None:
    store = _store(tmp_path, host_capacity=8 * KIB)
    tensors = _tensors(12, seed=6)
    handles = [store.pack(t) for t in tensors[:2]]  # opens the first segment
    assert store.spill is not None and store.spill.segments
    engine = store.spill.engine
    if when == "write":
        engine.inject_fault(1, errno.EIO, per="request")
        with pytest.raises(NVMeIOError):
            for t in tensors[2:]:
                handles.append(store.pack(t))
            store._reap_writes(block=True)
        # the tensor whose write failed can never be read as if it were fine
        with pytest.raises(NVMeIOError):
            for h in reversed(handles):
                store.unpack(h)
    else:
        handles += [store.pack(t) for t in tensors[2:]]
        store._reap_writes(block=True)
        engine.inject_fault(1, errno.EIO, per="request")
        with pytest.raises(NVMeIOError):
            for h in reversed(handles):
                store.unpack(h)
    del handles
    store.close()


def test_strides_come_back_for_views_expanded_and_sliced_tensors(tmp_path) -> None:
    """A compiled backward asserts the strides of what it saved: every layout returns
    with its shape, strides and values (spilled to NVMe and kept in memory)."""
    base = torch.randn(64, 48)
    tensors = [
        base.t(),  # transposed: travels as its span
        base[:, :5],  # mostly gaps: travels as values, laid out again
        torch.randn(48, 1).expand(48, 300),  # stride 0: a small span
        base[3:40:3],  # a strided slice
        torch.randn(2, 3, 40).permute(2, 0, 1),
    ]
    for capacity in (0, 1 << 20):  # all on NVMe; all in memory
        store = _store(tmp_path / str(capacity), host_capacity=capacity)
        handles = [store.pack(t) for t in tensors]
        store._reap_writes(block=True)
        for h, t in reversed(list(zip(handles, tensors, strict=True))):
            got = store.unpack(h)
            assert got.shape == t.shape and got.stride() == t.stride()
            assert torch.equal(got, t)
        del h, handles
        store.close()


def test_a_tensor_dropped_while_it_is_being_evicted_is_freed(tmp_path) -> None:
    """A garbage collection inside pack can drop a record mid-eviction (its host copy
    gone, its write not yet issued): its extent must still be freed."""
    store = _store(tmp_path, host_capacity=8 * KIB)
    original = store._write
    dropped = []

    def write_after_a_drop(saved, data):  # type: ignore[no-untyped-def]
        if not dropped:
            dropped.append(saved)
            store.drop(saved)  # as the handle's __del__ would
        original(saved, data)

    store._write = write_after_a_drop  # type: ignore[method-assign]
    handles = [store.pack(t) for t in _tensors(12, seed=7)]
    assert dropped
    store._reap_writes(block=True)
    live = len([h for h in handles if h.record is not dropped[0]])
    del handles
    gc.collect()
    store._reap_writes(block=True)
    stats = store.snapshot()
    assert live == 11 and stats["nvme_bytes"] == 0 and stats["host_bytes"] == 0
    assert store.spill is not None and store.spill.live == 0
    store.close()


def test_the_allowance_splits_into_three_lines_that_shrink_with_it() -> None:
    from infinity.activations.store import READ_AHEAD, WRITE_WINDOW, split_allowance

    big = 1 << 30
    assert split_allowance(big, True) == (big - READ_AHEAD - WRITE_WINDOW, READ_AHEAD, WRITE_WINDOW)
    small = 8 << 20  # the windows shrink to a quarter and an eighth
    assert split_allowance(small, True) == (5 << 20, 2 << 20, 1 << 20)
    assert split_allowance(small, False) == (small, 0, 0)  # nothing to spill: no windows
    # a tiny allowance keeps two I/O blocks for the write window (its piece is one)
    tiny = 26_824  # a sweep case's: an eighth was 3,353 bytes, under the 4 KiB piece
    share, read, write = split_allowance(tiny, True)
    assert write == 8192 and share + read + write == tiny and min(share, read) >= 0
    assert split_allowance(6000, True) == (0, 0, 6000)


def test_a_tensor_larger_than_the_write_window_goes_through_it_in_pieces(tmp_path) -> None:
    store = _store(tmp_path, host_capacity=0, read_ahead=0, write_window=8 * KIB)
    tensors = _tensors(12, seed=8)
    assert max(_nbytes(t) for t in tensors) > 8 * KIB
    expected = [t.clone() for t in tensors]
    handles = [store.pack(t) for t in tensors]
    del tensors
    stats = store.snapshot()
    assert stats["written_in_pieces"] > 0 and stats["write_peak_bytes"] <= 8 * KIB
    store.end_forward()
    for h, want in zip(reversed(handles), reversed(expected), strict=True):
        assert torch.equal(store.unpack(h), want)  # read on demand: no read window
    stats = store.snapshot()
    assert stats["reads_not_ahead"] == len(handles) and stats["read_peak_bytes"] == 0
    assert stats["read_on_demand_peak_bytes"] >= max(_nbytes(t) for t in expected)
    del handles
    store.close()


def test_every_line_stays_within_its_limit_through_a_forward_and_backward(tmp_path) -> None:
    store = _store(tmp_path, host_capacity=0)
    allowance = 160 * KIB
    store.set_allowance(allowance)  # windows of 40 and 20 KiB: some tensors are larger
    tensors = _tensors(40, seed=7)
    expected = [t.clone() for t in tensors]
    handles = [store.pack(t) for t in tensors]
    del tensors
    store.end_forward()
    for h, want in zip(reversed(handles), reversed(expected), strict=True):
        assert torch.equal(store.unpack(h), want)
    stats = store.snapshot()
    assert stats["host_peak_bytes"] <= stats["host_share_bytes"]
    assert stats["read_peak_bytes"] <= stats["read_window_bytes"]
    assert stats["write_peak_bytes"] <= stats["write_window_bytes"]
    assert 0 < stats["held_peak_bytes"] <= allowance
    assert stats["nvme_written_bytes"] > 0 and stats["reads_ahead"] > 0
    del handles
    store.close()
