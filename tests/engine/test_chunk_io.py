"""``engine.chunk_io`` and the one walk of a chunk's pieces (``chunks/pieces.py``).

A chunk's windows cover it once, in order; their parts, piece after piece, are
the home's bytes (a whole chunk's padding included), which is what a
checkpoint writes; a write through the windows is what a read gives back.
"""

from __future__ import annotations

import itertools
from contextlib import closing

import torch
from engine_helpers import config, tiny_llama

import infinity
from infinity.chunks.pieces import Window
from infinity.core.names import Kind
from infinity.offload import engine_of
from infinity.optim import CPUAdam

CHUNK = 64 << 10


def _offload(tmp_path, *, spans: bool, **overrides):
    """A tied 4096 x 64 embedding (an oversize chunk), staged in spans or whole."""
    model = tiny_llama(4096, hidden=64, intermediate=128, tie=True, seed=0)
    cfg = {
        "device_memory": "3MiB",
        "host_memory": "640KiB" if spans else "64MiB",
        "nvme_path": str(tmp_path),
        "chunk_size": CHUNK,
        "dtype": "bf16",
        **overrides,
    }
    model = infinity.offload(model, config(**cfg))
    CPUAdam(model.parameters(), lr=1e-3)
    return model, engine_of(model)


def test_overlap_names_the_tensor_and_window_elements():
    window = Window(100, 200, [])
    assert window.overlap(0, 100) is None
    assert window.overlap(200, 5) is None
    assert window.overlap(150, 100) == (slice(0, 50), slice(50, 100))
    assert window.overlap(50, 100) == (slice(50, 100), slice(0, 50))


def test_windows_cover_every_chunk_once_in_order(tmp_path):
    for spans in (True, False):
        _model, engine = _offload(tmp_path / str(spans), spans=spans)
        io = engine.chunk_io
        oversize = [spec for spec in io.chunk_specs if spec.oversize]
        assert oversize
        for spec in io.chunk_specs:
            with closing(io.windows(Kind.PARAM, spec.index)) as each:
                bounds = [(w.start, w.end) for w in each]
            assert bounds[0][0] == 0 and bounds[-1][1] == spec.capacity
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            assert (len(bounds) > 1) is (spans and spec.oversize)
        engine.close()


def test_home_bytes_are_the_units_bytes_whole_or_in_spans(tmp_path):
    """An oversize unit's home bytes in spans are the same as staged whole."""
    got = {}
    for spans in (True, False):
        _model, engine = _offload(tmp_path / str(spans), spans=spans)
        io = engine.chunk_io
        chunk = next(spec.index for spec in io.chunk_specs if spec.oversize)
        got[spans] = {
            kind: b"".join(bytes(part.numpy()) for part in io.home_bytes(kind, chunk))
            for kind in (Kind.PARAM, Kind.OPTIM)
        }
        engine.close()
    assert got[True] == got[False]
    master = torch.frombuffer(bytearray(got[True][Kind.OPTIM]), dtype=torch.float32)
    params = torch.frombuffer(bytearray(got[True][Kind.PARAM]), dtype=torch.bfloat16)
    assert torch.equal(master[: params.numel()].to(torch.bfloat16), params)


def test_a_write_through_the_windows_reads_back(tmp_path):
    _model, engine = _offload(tmp_path, spans=True)
    io = engine.chunk_io
    chunk = next(spec.index for spec in io.chunk_specs if spec.oversize)
    capacity = io.chunk_specs[chunk].capacity
    values = torch.arange(capacity, dtype=torch.float32).to(torch.bfloat16)
    for window in io.windows(Kind.PARAM, chunk, load=False, write=True):
        window.parts[0].view(torch.bfloat16).copy_(values[window.start : window.end])
    io.params_written(chunk)
    data = b"".join(bytes(part.numpy()) for part in io.home_bytes(Kind.PARAM, chunk))
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.bfloat16), values)
    engine.close()
