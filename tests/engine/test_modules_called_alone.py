"""Modules of an offloaded model called on their own, outside the model's forward.

Loops that compute their own loss run the backbone, then the head
(``model.model(...)``, ``model.lm_head(h)``); others call a container's parts in
turn. Before NOTE [modules called on their own], the weights those calls saved
pinned the device slots (PoolExhausted at tight budgets), and the head stayed
bound after the backbone's call: with room to spare, the weights silently became
NaN. Each case trains against plain PyTorch on a deep copy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import batches, config, global_rel_error, offload_on_nvme, tiny_llama
from torch import nn

import infinity
from infinity.optim import CPUAdam


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)


def _own_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    hidden = model.model(input_ids=x).last_hidden_state
    logits = model.lm_head(hidden)
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize(
    "budget, activations",
    [("tight", "keep"), ("tight", "offload"), ("tight", "checkpoint"), ("roomy", "keep")],
)
def test_backbone_then_head_trains_as_torch(tmp_path, budget, activations):
    base = tiny_llama(layers=4)
    ref = copy.deepcopy(base)
    ref_opt = _adamw(ref)
    if budget == "tight":  # states on NVMe, the device holding a few chunks
        model = offload_on_nvme(base, tmp_path, 1.6, activations=activations)
    else:  # every chunk fits on the device
        model = infinity.offload(base, config(device_memory="4MiB", chunk_size="24KiB"))
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    for i, (x, y) in enumerate(batches(4)):
        for m, o in ((model, opt), (ref, ref_opt)):
            # every other step the model's own forward: the two kinds of call mix
            loss = m(input_ids=x, labels=y).loss if i % 2 else _own_loss(m, x, y)
            loss.backward()
            o.step()
            o.zero_grad()
    assert global_rel_error(model, ref) < 1e-6
    with torch.no_grad():
        x = batches(1, seed=7)[0][0]
        got = model.model(input_ids=x).last_hidden_state
        want = ref.model(input_ids=x).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 96), nn.GELU(), nn.Linear(96, 32)
        )
        self.decoder = nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def test_a_containers_parts_called_in_turn_train_as_torch(tmp_path):
    torch.manual_seed(0)
    base = _EncoderDecoder()
    ref = copy.deepcopy(base)
    ref_opt = _adamw(ref)
    cfg = config(
        device_memory="96KiB", host_memory="256KiB", chunk_size="16KiB", nvme_path=str(tmp_path)
    )
    model = infinity.offload(base, cfg)
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            nn.functional.cross_entropy(m.decoder(m.encoder(x)), y).backward()
            o.step()
            o.zero_grad()
    assert global_rel_error(model, ref) < 1e-6
