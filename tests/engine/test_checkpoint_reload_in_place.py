"""A checkpoint loaded into a model that has trained since it was saved: the next
forward computes with the checkpoint's values, whole chunks and oversize ones alike.

Loading into a fresh model (the other checkpoint tests) cannot see a device copy
left over from training; here the chunks' device copies have moved on since the
save. The reference is a fresh model loaded from the same files.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import batches, config, tiny_llama, train
from test_oversize_spans import CHUNK, HIDDEN, VOCAB

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam


def _model(tmp_path, name: str, spans: bool):
    model = tiny_llama(VOCAB, hidden=HIDDEN, intermediate=2 * HIDDEN, tie=True, seed=0)
    cfg = config(
        device_memory="3MiB",
        host_memory="640KiB" if spans else "64MiB",
        nvme_path=str(tmp_path / name),
        chunk_size=CHUNK,
    )
    model = infinity.offload(model, cfg)
    return model, CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)


def _loss(m, batch):
    x, y = batch
    return m(input_ids=x, labels=y).loss


@pytest.mark.parametrize("spans", [True, False], ids=["spans", "whole"])
def test_load_into_a_trained_model_computes_with_the_loaded_values(tmp_path, spans):
    model, opt = _model(tmp_path, "trained", spans)
    data = batches(6, vocab=VOCAB, seq=16)
    train(model, opt, data[:2], loss_fn=_loss)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    train(model, opt, data[2:4], loss_fn=_loss)  # the device copies move on
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    fresh, fresh_opt = _model(tmp_path, "fresh", spans)
    infinity.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    with torch.no_grad():
        got = [_loss(model, b).item() for b in data[4:]]
        want = [_loss(fresh, b).item() for b in data[4:]]
    assert got == want
    for m in (model, fresh):
        engine_of(m).close()
