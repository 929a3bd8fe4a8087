"""Oversize chunks through host staging in spans of the normal chunk size.

A tied embedding far larger than a chunk, budgets far below the model's
states: training must match plain PyTorch ``AdamW``, and be bit-identical to
the same training whose oversize chunk is staged whole (a roomy host budget,
the path every oversize chunk took before spans).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    batches,
    config,
    global_rel_error,
    llama_113m_config,
    reference_pair,
    tiny_llama,
    train,
)

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam

VOCAB = 4096
HIDDEN = 64
CHUNK = 64 << 10  # the embedding (1 MiB in fp32) spans 16 chunks
STEPS = 3


def _twin(seed: int = 0):
    """A 2-layer Llama with a tied 4096 x 64 embedding: the 113M shape problem, small."""
    return tiny_llama(VOCAB, hidden=HIDDEN, intermediate=2 * HIDDEN, tie=True, seed=seed)


def _loss(m, batch):
    x, y = batch
    return m(input_ids=x, labels=y).loss


def _offload(model, tmp_path, *, spans: bool, **overrides):
    """Offload with a host budget that forces spans, or a roomy one (whole staging)."""
    cfg = {
        "device_memory": "3MiB",
        "host_memory": "640KiB" if spans else "64MiB",
        "nvme_path": str(tmp_path / ("spans" if spans else "whole")),
        "chunk_size": CHUNK,
    }
    cfg.update(overrides)
    model = infinity.offload(model, config(**cfg))
    plan = engine_of(model).plan
    largest = max(c.capacity for c in plan.layout.chunks)
    assert (plan.span_elems < largest) is spans
    return model


def _run(model, opt, *, accum: int = 1, clip: bool = False):
    data = batches(STEPS * accum, vocab=VOCAB, seq=16)

    def before_step(_step):
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

    return train(model, opt, data, accum=accum, loss_fn=_loss, before_step=before_step)


def _states(model, opt) -> dict[str, torch.Tensor]:
    out = {f"param/{k}": v for k, v in model.state_dict().items()}
    for index, state in opt.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"optim/{index}/{key}"] = state[key]
    return out


def test_spans_train_like_torch_adamw_with_states_beyond_both_budgets(tmp_path):
    model = _twin()
    ref, ref_opt = reference_pair(model)
    model = _offload(model, tmp_path, spans=True)
    plan = engine_of(model).plan
    states = plan.home_bytes("host") + plan.nvme_bytes
    assert states > plan.budgets.host + plan.budgets.device
    # Every staging slot is at most a normal chunk (an optimizer unit: its parts).
    assert max(plan.host_staging["param"]) <= CHUNK
    assert max(plan.host_staging["optim"]) <= 2 * CHUNK
    losses = _run(model, CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1))
    ref_losses = _run(ref, ref_opt)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert global_rel_error(model, ref) < 1e-6


@pytest.mark.parametrize(
    ("dtype", "accum", "clip", "overlap"),
    [
        ("fp32", 1, False, False),
        ("fp32", 2, True, False),
        ("bf16", 1, False, True),
        ("fp16", 2, False, False),
    ],
)
def test_spans_are_bit_identical_to_whole_staging(tmp_path, dtype, accum, clip, overlap):
    results = {}
    for spans in (True, False):
        model = _offload(_twin(), tmp_path, spans=spans, dtype=dtype, overlap_optimizer=overlap)
        opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
        scale = opt.scale_loss if dtype == "fp16" else None
        data = batches(STEPS * accum, vocab=VOCAB, seq=16)
        train(
            model,
            opt,
            data,
            accum=accum,
            loss_fn=_loss,
            scale=scale,
            before_step=(lambda _s, m=model: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            if clip
            else None,
        )
        results[spans] = _states(model, opt)
        engine_of(model).close()
    assert results[True].keys() == results[False].keys()
    for name, value in results[False].items():
        assert torch.equal(results[True][name], value), name


def test_checkpoint_written_in_spans_loads_into_whole_staging(tmp_path):
    model = _offload(_twin(), tmp_path, spans=True)
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    _run(model, opt)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    want = _states(model, opt)
    for spans in (False, True):
        (tmp_path / f"load-{spans}").mkdir()
        other = _offload(_twin(), tmp_path / f"load-{spans}", spans=spans)
        other_opt = CPUAdam(other.parameters(), lr=1e-3, weight_decay=0.1)
        infinity.load_checkpoint(tmp_path / "ckpt", other, other_opt)
        got = _states(other, other_opt)
        for name, value in want.items():
            assert torch.equal(got[name], value), (spans, name)
        engine_of(other).close()


@pytest.mark.slow
def test_113m_llama_trains_on_256mib_of_host_like_torch(tmp_path):
    """The issue's model at full size (2 GiB of fp32 states) on 128 MiB of device and
    256 MiB of host: two steps, losses as plain PyTorch AdamW's."""
    transformers = pytest.importorskip("transformers")
    cfg = llama_113m_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ref, ref_opt = reference_pair(model, lr=1e-4)
    model = infinity.offload(
        model,
        config(device_memory="128MiB", host_memory="256MiB", nvme_path=str(tmp_path)),
    )
    plan = engine_of(model).plan
    assert plan.home_bytes("host") + plan.nvme_bytes > plan.budgets.host + plan.budgets.device
    assert plan.span_elems < max(c.capacity for c in plan.layout.chunks)
    data = batches(2, vocab=16384, seq=32, batch=1)
    losses = train(
        model, CPUAdam(model.parameters(), lr=1e-4, weight_decay=0.1), data, loss_fn=_loss
    )
    peak_host = infinity.stats(model)["host_peak_bytes"]
    ref_losses = train(ref, ref_opt, data, loss_fn=_loss)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert peak_host <= 256 << 20


def test_state_dicts_and_pretrained_weights_round_trip_in_spans(tmp_path):
    """torch's state dicts and safetensors weights in and out of an oversize chunk in
    spans: ``transformers`` reads what ``save_pretrained`` wrote, and a fresh model
    loaded from either holds the trained values."""
    transformers = pytest.importorskip("transformers")
    model = _offload(_twin(), tmp_path, spans=True)
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    _run(model, opt)
    want = _states(model, opt)
    infinity.save_pretrained(model, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(theirs[name], value), name
    for source in ("state_dict", "pretrained"):
        (tmp_path / source).mkdir()
        other = _offload(_twin(seed=1), tmp_path / source, spans=True)
        other_opt = CPUAdam(other.parameters(), lr=1e-3, weight_decay=0.1)
        if source == "state_dict":
            other.load_state_dict(model.state_dict())
            other_opt.load_state_dict(opt.state_dict())
            got = _states(other, other_opt)
            assert got.keys() == want.keys()
        else:
            infinity.load_pretrained(other, tmp_path / "hf")
            got = {k: v for k, v in _states(other, other_opt).items() if k.startswith("param/")}
        for name, value in got.items():
            assert torch.equal(value, want[name]), (source, name)
        engine_of(other).close()


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_stored_state_formats_in_spans_match_whole_staging(tmp_path, state_dtype):
    """bf16 and int8 moments of an oversize chunk streamed in spans (their values and
    int8 block scales cut per span): bit-identical to staging the chunk whole, and a
    checkpoint written in spans loads into whole staging exactly."""
    # NOTE: int8 spans start on multiples of 262144 elements (the I/O alignment of
    # the block scales), so this twin's chunks hold that many bf16 elements and
    # its 4096 x 128 embedding spans two of them.
    chunk = 512 << 10

    def offload(root, spans: bool):
        model = tiny_llama(VOCAB, hidden=128, intermediate=256, tie=True, seed=0)
        cfg = config(
            dtype="bf16",
            device_memory="3MiB",  # below a slot for every copy: no chunk homed there
            host_memory="5MiB" if spans else "64MiB",
            nvme_path=str(root),
            chunk_size=chunk,
            optimizer_state_dtype=state_dtype,
        )
        model = infinity.offload(model, cfg)
        plan = engine_of(model).plan
        assert (plan.span_elems < max(c.capacity for c in plan.layout.chunks)) is spans
        return model, CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)

    results = {}
    for spans in (True, False):
        model, opt = offload(tmp_path / f"train-{spans}", spans)
        train(model, opt, batches(STEPS, vocab=VOCAB, seq=16), loss_fn=_loss)
        results[spans] = _states(model, opt)
        if spans:
            infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
        engine_of(model).close()
    for name, value in results[False].items():
        assert torch.equal(results[True][name], value), name
    other, other_opt = offload(tmp_path / "load", spans=False)
    infinity.load_checkpoint(tmp_path / "ckpt", other, other_opt)
    for name, value in _states(other, other_opt).items():
        assert torch.equal(value, results[True][name]), name
    engine_of(other).close()
