"""A span's staging copy while a device fill of the same oversize chunk is in flight.

The interleaving behind an intermittent ``KeyError: SpanKey(...)`` at
``close_host``: a state read stages a parameter span while the next forward's
device fill of that chunk (a :class:`~infinity.chunks.movers.SpanFill`)
is still streaming spans through the same host staging slots. Staging the
span used to poll the device copy (to decide whether its bytes could come from
there), which advanced the fill *inside* the staging call: the fill took the
only slot from the copy just placed (nobody held it yet), and the reader went
on with an orphan whose slot now belonged to another span. Here the fill's
first span is made to land before the read, so the interleaving happens on
every run instead of once in a few dozen.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import config, tiny_llama

import infinity
from infinity.chunks.movers import SpanFill
from infinity.chunks.pieces import read_elements
from infinity.chunks.pools import is_split, span_key, span_ranges
from infinity.core.names import NVME, Kind
from infinity.offload import engine_of

VOCAB = 4096
CHUNK = 64 << 10


def _twin():
    return tiny_llama(VOCAB, hidden=64, intermediate=128, tie=True)


@pytest.fixture
def manager(tmp_path):
    """The manager of a Llama whose tied 4096 x 64 bf16 embedding spans 8 chunks and
    whose parameter staging holds a single span."""
    model = _twin()
    cfg = config(
        dtype="bf16",
        device_memory="3MiB",
        host_memory="640KiB",
        nvme_path=str(tmp_path),
        chunk_size=CHUNK,
    )
    model = infinity.offload(model, cfg)
    engine = engine_of(model)
    m = engine.manager
    assert is_split(m.plan, 0) and m.homes.tier((Kind.PARAM, 0)) == NVME
    assert sum(m.plan.host_staging["param"].values()) == 1
    yield m
    engine.close()


def _fill_with_a_span_landed(m) -> tuple[SpanFill, int]:
    """Start the device fill of chunk 0 and let the span it holds in staging land;
    returns the fill and the index of the span it starts next."""
    m.synchronize()  # the initial writes: the staging slot is free to take
    copy = m.fetch_param(0, prefetch=True)
    assert copy is not None
    (fill,) = [p for p in copy.pending if isinstance(p, SpanFill)]
    # NOTE: span 0, or span 1 if span 0 landed so fast that the fill already
    # reused its slot (the only one).
    (staged,) = list(m.staging[Kind.PARAM])
    staged.wait()  # its read and its copy to the device
    return fill, span_ranges(m.plan, 0).index((staged.key.start, staged.key.end)) + 1


def _embedding(m) -> torch.Tensor:
    """Chunk 0's bytes as written at offload: the embedding (bf16), then zeros."""
    want = torch.zeros(m.plan.layout.chunks[0].capacity, dtype=m.dtype)
    weight = _twin().get_input_embeddings().weight.detach().reshape(-1)
    want[: weight.numel()] = weight.to(m.dtype)
    return want


@pytest.mark.parametrize("ahead", [0, 2], ids=["fill-next-span", "other-span"])
def test_reading_a_span_while_its_chunk_fills_the_device(manager, ahead):
    """The span the fill starts next (it must not take the reader's copy before its
    bytes are read), or another one (the fill must not evict the reader's copy to
    start its next span)."""
    m = manager
    fill, following = _fill_with_a_span_landed(m)
    start, end = span_ranges(m.plan, 0)[following + ahead]
    region, copy = m.open_host(span_key(Kind.PARAM, 0, start, end), writable=False)
    assert m.staging[Kind.PARAM].get(copy.key) is copy, "the reader's copy left the cache"
    got = region.view(m.dtype).clone()
    m.close_host(copy, modified=False)  # KeyError: SpanKey(...) before the fix
    fill.wait()
    device = m.device.get((Kind.PARAM, 0)).typed(m.dtype)
    whole = _embedding(m)
    assert torch.equal(got, whole[start:end])
    # Every span of the device copy holds the chunk's bytes (none came from a slot
    # that was still waiting for its read).
    assert torch.equal(device, whole)
    m.synchronize()
    assert torch.equal(read_elements(m, Kind.PARAM, 0, 0, 0, whole.numel(), m.dtype), whole)


def test_a_second_holder_keeps_a_shared_span_cached(manager):
    """Two holders of one staged span: the first to close without ``keep`` leaves it
    to the other (its reference), the last one drops it."""
    m = manager
    key = span_key(Kind.PARAM, 0, *span_ranges(m.plan, 0)[2])
    first, a = m.open_host(key, writable=False)
    second, b = m.open_host(key, writable=False)
    assert a is b and a.pins == 2
    m.close_host(a, modified=False)
    assert m.staging[Kind.PARAM].get(key) is b and b.pins == 1
    assert torch.equal(first, second)
    m.close_host(b, modified=False)
    assert key not in m.staging[Kind.PARAM]
