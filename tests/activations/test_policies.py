"""``Config(activations=...)``: checkpointing and offloading train exactly like keeping.

Both only move data (offload) or recompute it with the same kernels
(checkpoint), so every loss and every fp32 master weight after a few steps
with accumulation and clipping must be *bit-identical* to the same model,
budgets and seed with ``activations="keep"`` — itself checked against plain
PyTorch by the equivalence sweep. The models are ``transformers`` Llama and
GPT-2 (GPT-2 with its dropout on: checkpointing must replay the same masks).
"""

from __future__ import annotations

import pytest
import torch
from activation_helpers import BATCH, SEQ, VOCAB, activation_config, tiny_model

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.runtime.state_access import read_params

pytest.importorskip("transformers")


def _train(kind: str, dtype: str, policy: str, nvme: str | None, steps: int = 2):
    model = tiny_model(kind)
    model = infinity.offload(model, activation_config(model, dtype, policy, nvme))
    engine = engine_of(model)
    try:
        opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(2)  # dropout masks: the same stream for every policy
        losses = []
        for _ in range(steps):
            for _ in range(2):  # accumulation
                ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
                loss = model(input_ids=ids, labels=ids).loss / 2
                loss.backward()
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        masters = {
            e.name: v.clone() for e, v in read_params(engine, engine.registry.entries, master=True)
        }
        return losses, masters, infinity.stats(model)
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_checkpoint_and_offload_train_bit_identically_to_keep(
    kind: str, dtype: str, tmp_path
) -> None:
    keep_losses, keep_masters, _ = _train(kind, dtype, "keep", None)
    runs = {
        "checkpoint": (None,),
        "offload-host": (None,),
        "offload-nvme": (str(tmp_path),),
        "auto-nvme": (str(tmp_path),),
    }
    for name, (nvme,) in runs.items():
        losses, masters, stats = _train(kind, dtype, name.split("-")[0], nvme)
        assert losses == keep_losses, name
        for key, value in keep_masters.items():
            assert torch.equal(masters[key], value), (name, key)
        if name == "offload-nvme":
            act = stats["activations"]
            assert act["nvme_written_bytes"] > 0, "the NVMe case must spill activations"
            assert act["nvme_read_bytes"] <= act["nvme_written_bytes"]
            assert act["host_bytes"] == 0 and act["nvme_bytes"] == 0, "all freed after backward"
        if name == "offload-host":
            act = stats["activations"]
            assert act["packed"] > 0 and act["nvme_written_bytes"] == 0


def test_offloaded_activations_stay_within_the_host_budget(tmp_path, monkeypatch) -> None:
    """Every byte the store holds is in one of its three lines (host share, read and
    write windows), each within its limit, and together within what host_memory
    leaves saved activations; the store's own buffers, counted where they are
    allocated, stay within the windows (plus the one tensor a read on demand is
    unpacking). The rest goes to NVMe and most of it comes back ahead of its use."""
    import weakref

    from infinity.activations import store as store_module

    # Buffers the store allocated and has not handed to autograd (by address); a read
    # on demand allocates the tensor backward uses, the step's working set: not counted.
    held: dict[int, int] = {}
    peak = [0]
    demand = [False]

    def counted(nbytes: int, pinned: bool = False) -> torch.Tensor:
        buffer = real(nbytes, pinned=pinned)
        if demand[0]:
            return buffer
        ptr = buffer.data_ptr()
        held[ptr] = nbytes
        peak[0] = max(peak[0], sum(held.values()))
        weakref.finalize(buffer, held.pop, ptr, None)
        return buffer

    def unpack(store, handle):
        out = unpack_real(store, handle)
        held.pop(out.untyped_storage().data_ptr(), None)  # now backward's working set
        return out

    def from_nvme(store, saved):  # a read on demand happens here, reads ahead after it
        demand[0] = True
        try:
            return from_nvme_real(store, saved)
        finally:
            demand[0] = False

    store_class = store_module.ActivationStore
    real, unpack_real = store_module.aligned_empty, store_class.unpack
    from_nvme_real = store_class._from_nvme
    monkeypatch.setattr(store_module, "aligned_empty", counted)
    monkeypatch.setattr(store_class, "unpack", unpack)
    monkeypatch.setattr(store_class, "_from_nvme", from_nvme)
    model = tiny_model("llama")
    model = infinity.offload(model, activation_config(model, "fp32", "offload", str(tmp_path)))
    engine = engine_of(model)
    try:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
        stats = infinity.stats(model)
        act = stats["activations"]
        allowance = stats["host_budget_bytes"] - stats["host_reserved_bytes"]
        lines = act["host_share_bytes"], act["read_window_bytes"], act["write_window_bytes"]
        assert sum(lines) == allowance and all(line > 0 for line in lines)
        assert act["host_peak_bytes"] <= act["host_share_bytes"]
        assert act["read_peak_bytes"] <= act["read_window_bytes"]
        assert act["write_peak_bytes"] <= act["write_window_bytes"]
        assert act["held_peak_bytes"] <= allowance
        windows = act["read_window_bytes"] + act["write_window_bytes"]
        assert 0 < peak[0] <= windows
        assert act["nvme_written_bytes"] > 0
        # NOTE: a window of ~22 KiB here: what fits is read ahead, the rest on demand
        assert act["reads_ahead"] > 0 and act["reads_not_ahead"] > 0, act
        # the memory timeline carries them as their own band, bounded by the peaks
        timeline = infinity.timeline(model)
        assert 0 < max(timeline["activation_nvme_bytes"]) <= act["nvme_peak_bytes"]
        assert max(timeline["activation_host_bytes"]) <= act["host_peak_bytes"]
    finally:
        engine.close()


def test_a_compiled_model_trains_the_same_with_offloaded_activations(tmp_path) -> None:
    """torch.compile's backward gets its saved tensors back from the store (with
    their strides) and computes what it computes with them kept."""

    def run(policy: str, nvme: str | None) -> list[float]:
        model = tiny_model("llama")
        model = infinity.offload(model, activation_config(model, "fp32", policy, nvme))
        compiled = torch.compile(model)
        opt = CPUAdam(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 128, (4, 32), generator=g)
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    assert run("offload", str(tmp_path)) == run("keep", None)


@pytest.mark.parametrize("policy", ["checkpoint", "offload"])
def test_lora_over_a_frozen_offloaded_base_trains_like_keep(policy: str, tmp_path) -> None:
    """peft LoRA: the base frozen in chunks, adapters trained; activations checkpointed
    or offloaded (to NVMe) change nothing."""
    peft = pytest.importorskip("peft")

    def run(policy: str, nvme: str | None) -> dict[str, torch.Tensor]:
        model = peft.get_peft_model(
            tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        )
        model = infinity.offload(model, activation_config(model, "fp32", policy, nvme))
        engine = engine_of(model)
        try:
            opt = CPUAdam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            g = torch.Generator().manual_seed(1)
            for _ in range(2):
                ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            return {k: v.clone() for k, v in model.state_dict().items() if "lora" in k}
        finally:
            engine.close()

    expected = run("keep", None)
    got = run(policy, str(tmp_path) if policy == "offload" else None)
    assert expected and all(torch.equal(got[k], v) for k, v in expected.items())


def test_the_transformers_trainer_trains_the_same_with_offloaded_activations(tmp_path) -> None:
    """The Trainer's loop (accumulation 2, clipping at 1.0) over an offloaded model
    whose activations go to NVMe: the same gradient norms and weights as keeping them."""
    import transformers

    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(16)]
    data = [{"input_ids": r, "labels": r} for r in rows]

    def run(policy: str, nvme: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = tiny_model("llama")
        model = infinity.offload(model, activation_config(model, "fp32", policy, nvme))
        try:
            opt = CPUAdam(model.parameters(), lr=3e-3)
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path / policy), per_device_train_batch_size=2,
                gradient_accumulation_steps=2, max_steps=3, logging_steps=1, report_to=[],
                use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no",
            )  # fmt: skip
            trainer = transformers.Trainer(
                model=model, args=args, train_dataset=data, optimizers=(opt, None)
            )
            trainer.train()
            norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
            return norms, {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            engine_of(model).close()

    keep_norms, keep_state = run("keep", None)
    norms, state = run("offload", str(tmp_path / "nvme"))
    assert len(keep_norms) == 3 and norms == keep_norms
    assert all(torch.equal(state[k], v) for k, v in keep_state.items())
