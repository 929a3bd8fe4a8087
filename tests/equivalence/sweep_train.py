"""Train one sweep case offloaded, and the plain-PyTorch references it is judged against.

The offloaded side is what a user writes: ``infinity.offload`` + the case's
optimizer (``CPUAdam``, ``CPULion`` or ``CPUSGD``: :mod:`sweep_optimizers`) and
the ordinary loop (each of ``world`` ranks feeding its slice of every
batch). The references never touch infinity: the same ``transformers`` model
in RAM, the case's reference optimizer (``torch.optim.AdamW``, the quantised
AdamW or the Lion of :mod:`sweep_reference`, ``torch.optim.SGD``), the whole
batch in one process. With a 16-bit compute
dtype the reference keeps fp32 master weights and a 16-bit copy to compute
with, which is what mixed precision means in plain PyTorch. With
``case.backend="cuda"`` both sides compute on the GPU; the reference still
steps its fp32 masters with torch's AdamW on the CPU, as infinity does.
"""

from __future__ import annotations

import collections
import copy
import gc
import os
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
from sweep_cases import Case
from sweep_fp16 import Fp16Scaler, Grads, add_rank_mean, added, rank_grads
from sweep_optimizers import offloaded_optimizer, param_groups, reference_optimizer, warmup

import infinity
from infinity.chunks.movers import Purpose
from infinity.core.names import NVME
from infinity.offload import engine_of
from infinity.utils.process_memory import device_bytes

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Bytes per parameter kept in host homes, by (compute dtype, state dtype):
# parameter + gradient (compute dtype), fp32 master for 16-bit compute, and the
# two moments (int8: one byte each plus one fp32 scale per 256).
_STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 8.0 / 256}


def build_model(case: Case) -> torch.nn.Module:
    """The case's ``transformers`` model, seeded: a Llama (grouped-query attention), or
    a GPT-2 (Conv1D projections, learned positions, dropout 0.1 in one process; two
    ranks draw other masks for their slices than one process for the whole batch)."""
    import transformers

    torch.manual_seed(0)
    if case.model == "gpt2":
        drop = 0.1 if case.world == 1 else 0.0
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=case.vocab, n_embd=case.hidden, n_inner=case.intermediate,
                n_layer=case.layers, n_head=4, n_positions=max(64, case.seq),
                tie_word_embeddings=case.tied, resid_pdrop=drop, embd_pdrop=drop,
                attn_pdrop=drop,
            )
        )  # fmt: skip
        frozen = [*model.transformer.h[0].attn.parameters(), *model.transformer.ln_f.parameters()]
    else:
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=case.vocab, hidden_size=case.hidden,
                intermediate_size=case.intermediate, num_hidden_layers=case.layers,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=max(64, case.seq), tie_word_embeddings=case.tied,
            )
        )  # fmt: skip
        frozen = [*model.model.layers[0].self_attn.parameters(), *model.model.norm.parameters()]
    if case.frozen:
        for p in frozen:
            p.requires_grad_(False)
    if case.checkpointing:
        reentrant = case.checkpointing == "reentrant"
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    return model.train()


def batches(case: Case) -> list[torch.Tensor]:
    """Token ids of every micro-batch, whole (``steps * accumulation`` of them)."""
    g = torch.Generator().manual_seed(1)
    shape = (case.batch, case.seq)
    return [
        torch.randint(0, case.vocab, shape, generator=g)
        for _ in range(case.steps * case.accumulation)
    ]


def eval_batch(case: Case) -> torch.Tensor:
    """The held-out batch a case evaluates (drawn apart from the training batches)."""
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, case.vocab, (case.batch, case.seq), generator=g)


def evaluate(case: Case, model: torch.nn.Module) -> float:
    """The loss of :func:`eval_batch` in eval mode under ``case.evaluate``'s grad mode,
    as a validation loop between training steps computes it; the model trains again
    afterwards. Every rank evaluates the whole batch."""
    model.eval()
    grad_mode = torch.inference_mode() if case.evaluate == "inference_mode" else torch.no_grad()
    host_autocast = torch.autocast("cpu", torch.bfloat16, enabled=case.evaluate == "autocast")
    with grad_mode, host_autocast:
        ids = eval_batch(case).to(case.backend)
        loss = float(model(input_ids=ids, labels=ids).loss)
    model.train()
    return loss


def element_size(case: Case) -> int:
    """Bytes of one parameter in the compute dtype."""
    return TORCH_DTYPES[case.dtype].itemsize


def host_bytes_per_param(case: Case) -> float:
    """Host bytes one parameter needs with everything in host homes."""
    master = 0 if case.dtype == "fp32" else 4
    return 2 * element_size(case) + master + _STATE_BYTES[case.state_dtype]


def config(case: Case, model: torch.nn.Module, nvme_dir: str | None) -> infinity.Config:
    """The case's budgets in bytes (see ``sweep_cases``' NOTE).

    NOTE: without NVMe the host budget is 1 GiB, room for anything, except under
    ``activations="auto"``: there ``case.host`` of the states' bytes leaves a little
    room beside them, so that auto offloads some blocks to host memory and
    checkpoints the blocks that do not fit (with NVMe it never checkpoints).
    """
    n = sum(p.numel() for p in model.parameters())
    tight = case.nvme or case.activations == "auto"
    return infinity.Config(
        device=case.backend,
        dtype=case.dtype,
        device_memory=int(case.device * n * element_size(case)),
        host_memory=int(case.host * n * host_bytes_per_param(case)) if tight else "1GiB",
        nvme_path=nvme_dir if case.nvme else None,
        chunk_size=case.chunk_size,
        overlap_optimizer=case.overlap,
        optimizer_state_dtype=case.state_dtype,
        activations=case.activations,
        activation_min_bytes=0,
        initial_loss_scale=case.loss_scale or infinity.Config().initial_loss_scale,
    )


@dataclass
class Trained:
    """What one training run left: fp32 parameters (masters) by name, per-step losses,
    where chunks lived, and the held-out losses of ``case.evaluate`` (the reference's
    start with the one before the first step)."""

    state: dict[str, torch.Tensor]
    losses: list[float]
    placement: dict[str, dict[str, int]] = field(default_factory=dict)
    evals: list[float] = field(default_factory=list)
    # On a device with an allocator that counts (the fence, CUDA): the bytes it held at
    # once over the first model's steps, and infinity.memory_forecast's device peak.
    device_peak: int | None = None
    device_forecast: int | None = None
    # Budget lines over their limit, or lines over their budget (see _over_limits).
    over_limits: list[str] = field(default_factory=list)
    # The held-out loss plain PyTorch computes on this run's final weights (the masters
    # in the compute dtype), on its device: see sweep_run._judge_evals.
    own_eval: float | None = None


def _parts(case: Case, ids: torch.Tensor, world: int) -> Iterator[torch.Tensor]:
    size = ids.shape[0] // world
    for r in range(world):
        yield ids[r * size : (r + 1) * size]


class ResumePlanError(Exception):
    """The model that resumes from the checkpoint got no plan (its budgets, the case's
    ``resume_host`` / ``resume_device``, are too small): carries the PlanError."""

    def __init__(self, error: infinity.PlanError) -> None:
        super().__init__(str(error))
        self.error = error


def train_offloaded(case: Case, nvme_dir: str | None, rank: int = 0) -> Trained:
    """The case through infinity on this process (rank ``rank`` of ``case.world``).

    With ``case.resume_at`` the first model trains that many steps and saves a
    checkpoint; a second model (initialised differently, so that nothing it ends
    with can come from anywhere but the checkpoint) is offloaded with the resume
    budgets, loads it and trains the remaining steps.

    The garbage collector is off meanwhile, and every model the case made must be
    gone once its last reference is (NOTE [the model owns its engine]): a reference
    cycle through the model, its hooks or its engine fails the case.
    """
    engines: list[weakref.ref] = []  # NOTE: closed whatever happens (twice is a no-op)
    # NOTE: a model built first, collected: the first build in a process imports
    # transformers' modelling code lazily, and an import's frames, a cycle until the
    # next collection, reach back to the frame holding the new model (seed 5804's
    # first two-rank cases).
    build_model(case)
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        trained = _train_offloaded(case, nvme_dir, rank, engines)
        kept = sum(ref() is not None for ref in engines)
        if kept:
            raise AssertionError(
                f"{kept} of the case's {len(engines)} offloaded models outlived their last "
                "reference: a reference cycle holds them (NOTE [the model owns its engine]); "
                f"what a collection frees of infinity's: {_cycle_types()}"
            )
        return trained
    finally:
        for ref in engines:
            engine = ref()
            if engine is not None:
                engine.close()
        if collecting:
            gc.enable()


def _cycle_types() -> list[tuple[str, int]]:
    """The classes and functions of infinity among what a collection frees now, most
    frequent first (what a reference cycle through a model holds)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = collections.Counter(
            getattr(o, "__qualname__", "")
            if isinstance(o, types.FunctionType)
            else type(o).__name__
            for o in gc.garbage
            if (getattr(o, "__module__", None) or type(o).__module__ or "").startswith("infinity")
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found.most_common(12)


def _train_offloaded(
    case: Case, nvme_dir: str | None, rank: int, engines: list[weakref.ref]
) -> Trained:
    """:func:`train_offloaded`'s run; each model's engine goes into ``engines``, weakly."""
    data = batches(case)
    first = case.resume_at or case.steps
    before = _device_allocated(case)
    model, opt = _offloaded(case, build_model(case), nvme_dir)
    engines.append(weakref.ref(engine_of(model)))
    forecast = _forecast(case, model, data[0], rank)
    schedule = warmup(case, opt)
    evals: list[float] = []
    losses = _train(case, model, opt, schedule, data, range(first), rank, evals)
    peak = None if forecast is None else _device_peak(case) - before
    if not case.resume_at:
        return _trained(case, model, losses, evals=evals, device=(peak, forecast))
    assert nvme_dir is not None, "a resumed case saves its checkpoint in nvme_dir"
    saved = os.path.join(nvme_dir, "resume-checkpoint")
    infinity.save_checkpoint(saved, model, opt)
    # NOTE: the schedule's state travels beside the checkpoint, as users keep it.
    schedule_state = None if schedule is None else schedule.state_dict()
    placement = infinity.stats(model)["placement"]
    engine_of(model).close()
    model = _reinitialised(build_model(case))
    try:
        model, opt = _offloaded(case.resumed(), model, os.path.join(nvme_dir, "b"))
    except infinity.PlanError as exc:
        raise ResumePlanError(exc) from exc
    engines.append(weakref.ref(engine_of(model)))
    # NOTE: torch's order: the schedule is made before the optimizer's state (its
    # scheduled rates) is loaded, and its own state after.
    schedule = warmup(case, opt)
    infinity.load_checkpoint(saved, model, opt)
    if schedule is not None:
        schedule.load_state_dict(schedule_state)
    try:
        losses += _train(case, model, opt, schedule, data, range(first, case.steps), rank, evals)
    except infinity.PlanError as exc:  # its first forward: the resume budgets' saved tensors
        raise ResumePlanError(exc) from exc
    return _trained(case.resumed(), model, losses, placement, evals, (peak, forecast))


LOOP_SCALARS = 4


def _device_allocated(case: Case) -> int:
    """Bytes the case's device allocator holds now, its peak started over (0 on the CPU).
    Earlier cases' engines are collected first: their slots would be freed mid-case."""
    if case.backend == "cpu":
        return 0
    gc.collect()
    _STEPS_PEAK[0] = 0
    device = torch.get_device_module(case.backend)
    device.reset_peak_memory_stats()
    return device.memory_allocated()


def _device_peak(case: Case) -> int:
    return max(_STEPS_PEAK[0], torch.get_device_module(case.backend).max_memory_allocated())


def _forecast(case: Case, model: torch.nn.Module, batch: torch.Tensor, rank: int) -> int | None:
    """``infinity.memory_forecast``'s device peak for one micro-batch of this rank, on the
    fence and on CUDA (``None`` on the CPU, whose device is RAM).

    NOTE: on CUDA the allocator also holds cuBLAS's workspaces (one per thread: the
    loop's and autograd's), made by the first matmuls and kept: the forecast measures
    what they add (``MemoryForecast.library_workspaces``, 0 once an earlier case made
    them), so they count on both sides of the check."""
    if case.backend not in ("fence", "cuda"):
        return None
    ids = list(_parts(case, batch, case.world))[rank].to(case.backend)
    forecast = infinity.memory_forecast(model, lambda m: _loss(case, m, ids), ids.numel())
    # NOTE: plus what this loop holds on the device beside the model's step: the
    # micro-batch it moved there, and its scalars (the loss divided for accumulation,
    # scaled for fp16)
    return forecast.device_peak + _loop_bytes(case, ids)


def _loop_bytes(case: Case, ids: torch.Tensor) -> int:
    """The loop's micro-batch and scalars as the device's allocator counts them: each
    one block of its own (CUDA's and the fence's round every block up to 512 bytes),
    at most LOOP_SCALARS fp32 scalars."""
    device = torch.device(case.backend)
    return device_bytes(ids.nbytes, device) + LOOP_SCALARS * device_bytes(4, device)


def _reinitialised(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter (frozen ones too) drawn again: what it trains
    from after a resume can only be the checkpoint's."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def _offloaded(
    case: Case, model: torch.nn.Module, nvme_dir: str | None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``model`` offloaded as ``case`` says, and the case's optimizer over it."""
    if case.nvme and nvme_dir is not None:
        os.makedirs(nvme_dir, exist_ok=True)
    cfg = config(case, model, nvme_dir)
    if case.nvme_direct:
        model = _offload_reading_nvme_directly(model, cfg)
    else:
        model = infinity.offload(model, cfg)
    # NOTE [the layout is decided once, late]: the optimizer first, so the homes are
    # planned for it; reading the queue before would lay them out for Adam.
    optimizer = offloaded_optimizer(case, param_groups(case, model))
    if case.defer_host:
        # a GPU backend's defaults: NOTE [host updates behind the forward] and
        # NOTE [host updates on a worker]
        queue = engine_of(model).queue
        queue.defer_host = queue.on_worker = True
    return model, optimizer


def _train(
    case: Case,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler | None,
    data: list[torch.Tensor],
    steps: range,
    rank: int,
    evals: list[float],
) -> list[float]:
    """The ordinary loop over ``steps``; each step's loss on this rank. With
    ``case.evaluate`` each step is followed by an evaluation, appended to ``evals``."""
    losses = []
    for step in steps:
        torch.manual_seed(1000 + step)  # NOTE: dropout's masks, as the reference draws them
        total = 0.0
        for micro in range(case.accumulation):
            ids = list(_parts(case, data[step * case.accumulation + micro], case.world))[rank]
            ids = ids.to(case.backend)
            with training_autocast(case):
                loss = _loss(case, model, ids) / case.accumulation
            # fp16: the loss times infinity's dynamic loss scale (torch's GradScaler.scale)
            (opt.scale_loss(loss) if case.dtype == "fp16" else loss).backward()
            total += float(loss.detach())
        if case.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        if case.clip_value:
            torch.nn.utils.clip_grad_value_(model.parameters(), case.clip_value)
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
        losses.append(total)
        if case.evaluate:
            evals.append(_evaluated(case, model))
    return losses


# The device peak of the steps before the last evaluation (see _evaluated).
_STEPS_PEAK = [0]


def _evaluated(case: Case, model: torch.nn.Module) -> float:
    """``evaluate``, outside the device peak the sweep checks: the forecast is of a
    training step, and the held-out batches are of another shape (the whole batch)."""
    if case.backend != "cpu":
        _STEPS_PEAK[0] = max(_STEPS_PEAK[0], _device_peak(case))
    value = evaluate(case, model)
    if case.backend != "cpu":
        torch.get_device_module(case.backend).reset_peak_memory_stats()
    return value


def training_autocast(case: Case) -> torch.autocast:
    """The training forward's autocast: bf16 on the host with ``case.autocast``, else off."""
    return torch.autocast("cpu", torch.bfloat16, enabled=case.autocast)


def _loss(case: Case, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The training loss of ``ids`` (labels are the inputs): the model's own, the loop's
    own (``case.own_loss``) or with ``case.loss_block`` infinity's blockwise one (the
    reference keeps the model's)."""
    if case.own_loss:
        # transformers' causal LM loss, from the parts: fp32 logits, targets shifted
        backbone = getattr(model, type(model).base_model_prefix)
        logits = model.get_output_embeddings()(backbone(input_ids=ids).last_hidden_state)
        targets = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100
        )
    if not case.loss_block:
        return model(input_ids=ids, labels=ids).loss
    targets = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]  # as transformers shifts
    return infinity.causal_lm_loss(model, ids, targets, block_tokens=case.loss_block)


def _trained(
    case: Case,
    model: torch.nn.Module,
    losses: list[float],
    earlier: dict[str, dict[str, int]] | None = None,
    evals: list[float] | None = None,
    device: tuple[int | None, int | None] = (None, None),
) -> Trained:
    """What ``model`` ended with; ``earlier``: the placement of the model it resumed from
    (the counts are added, so a table shows every tier either used)."""
    from infinity.runtime.state_access import read_params

    engine = engine_of(model)
    # NOTE: the fp32 masters (the parameters themselves in fp32): 16-bit copies
    # round every difference to a whole ulp, which would drown small errors.
    entries = engine.registry.entries
    state = {entry.name: value for entry, value in read_params(engine, entries, master=True)}
    stats = infinity.stats(model)
    placement = stats["placement"]
    if case.nvme_direct and any(tiers.get("nvme") for tiers in placement.values()):
        # NOTE: a case that claims the direct route must have had it wherever its
        # plan kept an NVMe tier (Adafactor's homes, planned again, may not); whether
        # the reader ran depends on the case (a chunk the step just updated in host
        # staging is copied from there: with fp32 parameters, often every one).
        assert str(engine.manager.routes(Purpose.COMPUTE, NVME)) == "nvme -> device"
    for kind, tiers in (earlier or {}).items():
        for tier, count in tiers.items():
            placement[kind][tier] = placement[kind].get(tier, 0) + count
    own = _plain_eval(case, state) if case.evaluate else None
    return Trained(
        state, losses, placement, list(evals or []), *device, _over_limits(stats["memory"]), own
    )


def _plain_eval(case: Case, state: dict[str, torch.Tensor]) -> float:
    """:func:`evaluate` of a plain model holding ``state`` (fp32 masters by name) in the
    compute dtype, on the case's device."""
    model = build_model(case).to(case.backend)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.data = state[name].to(case.backend, TORCH_DTYPES[case.dtype])
    return evaluate(case, model)


def _over_limits(memory: dict) -> list[str]:
    """Each budget line whose peak passed its limit, and each tier whose lines' limits
    add up to more than its budget: the accounts' own promise, in every combination."""
    faults = []
    for tier in ("host", "device"):
        lines = memory[tier]["lines"]
        over = [name for name, line in lines.items() if line["peak"] > line["limit"]]
        faults += [f"{tier} {name}: {lines[name]}" for name in over]
        total = sum(line["limit"] for line in lines.values())
        if total > memory[tier]["budget_bytes"]:
            faults.append(f"{tier} lines {total} > budget {memory[tier]['budget_bytes']}")
    for beside in ("transient_copies", "pretrained_read_block"):
        line = memory["host"][beside]
        if line["peak"] > line["limit"]:
            faults.append(f"host {beside}: {line}")
    return faults


def _offload_reading_nvme_directly(model: torch.nn.Module, cfg: infinity.Config) -> torch.nn.Module:
    """``infinity.offload`` on the case's backend, reading NVMe homes into device slots
    (``nvme_direct=True``: the CPU backend or the fence; see ``Case.on``).

    NOTE: the backend is the one ``cfg.device`` names. A CPU backend here under a CUDA
    case computed on the host while the inputs sat on the GPU: 3 of 28 CUDA tests
    failed that way (issue 40); the fence's sweep fails the same way if it comes back.
    """
    from infinity.devices.cpu import CpuBackend
    from infinity.devices.fence import FenceBackend
    from infinity.runtime import engine as engine_module

    readers = {"cpu": CpuBackend, "fence": FenceBackend}
    if cfg.device not in readers:
        raise ValueError(f"no direct NVMe reader on {cfg.device!r}: use Case.on({cfg.device!r})")
    backend = readers[cfg.device](nvme_direct=True)
    with mock.patch.object(engine_module, "make_backend", lambda _device: backend):
        model = infinity.offload(model, cfg)
    return model


def _round_through(masters: list[torch.Tensor], case: Case, scale: float) -> None:
    """The masters' gradients rounded through the compute dtype (at the loss scale).

    NOTE: a clamp after a clip by norm sees the norm-clipped gradient as torch does on a
    16-bit ``param.grad`` (``mul_`` rounds the product to 16 bits): the engine writes
    the clip factor into its 16-bit gradient chunks before it clamps them
    (``GradientLedger.clamp``). Without a clamp the factor folds into the update in
    fp32, as on these fp32 masters."""
    dtype = TORCH_DTYPES[case.dtype]
    for m in masters:
        if m.grad is not None:
            m.grad = (m.grad * scale).to(dtype).float() / scale


def train_reference(case: Case, *, variant: str = "single", steps: int | None = None) -> Trained:
    """Plain PyTorch on the whole batch.

    ``variant``: ``"single"`` (the reference), or a source of noise that has
    nothing to do with infinity, to size the tolerance: ``"fused"`` (the
    reference's other arithmetic: torch's fused AdamW, multi-tensor SGD, or the
    update in float64),
    ``"halves"`` (the gradient as ``world`` data-parallel ranks compute it:
    the mean of the slices' gradients), ``"blocks"`` (with ``case.loss_block``: the
    loss a block of tokens at a time, as the offloaded side computes it: the same
    loss in another summation order, which Adam's normalisation amplifies on
    near-zero gradients).
    """
    steps = case.steps if steps is None else steps
    model = build_model(case)  # its parameters are the fp32 masters, stepped on the CPU
    compute = model
    if case.dtype != "fp32" or case.backend != "cpu":
        # NOTE: parameters only: offload leaves buffers (rotary frequencies) as built.
        compute = copy.deepcopy(model).to(case.backend)
        for p in compute.parameters():
            p.data = p.data.to(TORCH_DTYPES[case.dtype])
    masters = list(model.parameters())
    params = list(compute.parameters())
    opt = reference_optimizer(case, param_groups(case, model), noise=variant == "fused")
    schedule = warmup(case, opt)
    data = batches(case)
    split = case.world if variant == "halves" else 1
    # fp16: torch's own dynamic loss scaling, with infinity's defaults (Config)
    scaler = Fp16Scaler(case.loss_scale) if case.dtype == "fp16" else None
    losses = []
    evals = [evaluate(case, compute)] if case.evaluate else []
    for step in range(steps):
        torch.manual_seed(1000 + step)
        total = 0.0
        per_rank: list[Grads] | None = None  # "halves", fp16: each rank's micro-batches
        for micro in range(case.accumulation):
            batch = data[step * case.accumulation + micro]
            if scaler is not None and case.world > 1:
                # NOTE: the reference reduces every micro-batch, then adds the means;
                # "halves" adds each rank's micro-batches first and reduces once: both
                # orders are infinity's (a gradient chunk that stays on the device
                # accumulates there), and fp16 rounds them apart.
                blocks = (lambda ids: _loss(case, compute, ids)) if variant == "blocks" else None
                ranks, loss_mean = rank_grads(
                    case, compute, _parts(case, batch, case.world), scaler.scale, blocks
                )
                total += loss_mean
                if variant == "halves":
                    per_rank = ranks if per_rank is None else [
                        added(a, b) for a, b in zip(per_rank, ranks, strict=True)
                    ]  # fmt: skip
                else:
                    add_rank_mean(compute, ranks)
                continue
            for ids in _parts(case, batch, split):
                ids = ids.to(case.backend)
                with training_autocast(case):
                    if variant == "blocks":
                        loss = _loss(case, compute, ids) / case.accumulation / split
                    else:
                        loss = compute(input_ids=ids, labels=ids).loss / case.accumulation / split
                (loss * scaler.scale if scaler else loss).backward()
                total += float(loss.detach())
        if per_rank is not None:
            add_rank_mean(compute, per_rank)
        if compute is not model:
            for master, p in zip(masters, params, strict=True):
                master.grad = None if p.grad is None else p.grad.to("cpu", torch.float32)
        stepped = scaler is None or scaler.unscale(masters)
        if case.clip and stepped:
            torch.nn.utils.clip_grad_norm_(masters, case.clip)
        if case.clip_value and stepped:
            if case.clip and case.dtype != "fp32":
                _round_through(masters, case, 1.0 if scaler is None else scaler.scale)
            torch.nn.utils.clip_grad_value_(masters, case.clip_value)
        if stepped:
            opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
        compute.zero_grad()
        if compute is not model:
            with torch.no_grad():
                for master, p in zip(masters, params, strict=True):
                    p.copy_(master)
        losses.append(total)
        if case.evaluate:
            evals.append(evaluate(case, compute))
    state = {k: v.detach().clone() for k, v in model.named_parameters()}  # fp32 masters
    if case.dtype != "fp32":
        # NOTE: a frozen tensor has no fp32 master in infinity: it is kept as its
        # 16-bit rounding, the values both sides compute with.
        for k, v in model.named_parameters():
            if not v.requires_grad:
                state[k] = v.detach().to(TORCH_DTYPES[case.dtype]).float()
    return Trained(state, losses, evals=evals)


def rel_error(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """||ours - ref|| / ||ref|| over every tensor of ``ref`` (float64 sums)."""
    num = sum(float((ours[k].double() - v.double()).pow(2).sum()) for k, v in ref.items())
    den = sum(float(v.double().pow(2).sum()) for v in ref.values())
    return (num / den) ** 0.5
