"""``infinity.load_checkpoint``: stream a checkpoint back into the chunks.

Tensors are found by name and read straight into their chunk regions (host
homes, or staging slots written to NVMe), chunk by chunk, so loading never
holds the model in RAM and works across chunk layouts. Only JSON and raw bytes
are read: nothing is unpickled.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from infinity.checkpoint.format import (
    OPTIM_FILE,
    PARAM_FILE,
    CheckpointError,
    TensorRecord,
    read_meta,
    records,
    verify_files,
)
from infinity.chunks.homes import Kind
from infinity.offload import engine_of
from infinity.runtime.engine import OffloadEngine

FP32 = 4


def _read_into(f, offset: int, dst: torch.Tensor) -> None:
    """Fill the uint8 tensor ``dst`` from byte ``offset`` of file ``f``."""
    f.seek(offset)
    view = dst.numpy()
    got = f.readinto(view)
    if got != view.nbytes:
        raise CheckpointError(
            f"{f.name}: short read at offset {offset} ({got} of {view.nbytes} bytes)"
        )


def _match(engine: OffloadEngine, recs: dict[str, TensorRecord], dtype: str) -> None:
    if dtype != engine.config.dtype:
        raise CheckpointError(
            f"checkpoint was written with dtype={dtype!r} but the model is offloaded with "
            f"dtype={engine.config.dtype!r}; offload with the checkpoint's dtype"
        )
    problems = []
    for entry in engine.registry.entries:
        rec = recs.get(entry.name)
        if rec is None:
            problems.append(f"{entry.name}: not in checkpoint")
        elif rec.shape != entry.shape:
            problems.append(
                f"{entry.name}: shape {rec.shape} in checkpoint, {entry.shape} in model"
            )
        elif rec.trainable != entry.trainable and entry.trainable:
            problems.append(f"{entry.name}: frozen in checkpoint, trainable in model")
    if problems:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(problems[:10]))


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer=None,
    *,
    verify: bool = True,
) -> dict:
    """Restore parameters, fp32 masters, moments and step counts (and optimizer
    hyper-parameters) from ``path``; returns the checkpoint's metadata.

    ``verify`` checks every file's CRC-32 first (one sequential read).
    """
    target = Path(path)
    meta = read_meta(target)
    if verify:
        verify_files(target, meta)
    engine = engine_of(model)
    recs = records(meta)
    _match(engine, recs, meta["dtype"])
    manager = engine.manager
    engine.synchronize()
    esize = engine.plan.element_size
    parts = 3 if engine.plan.has_master else 2
    with open(target / PARAM_FILE, "rb") as fp, open(target / OPTIM_FILE, "rb") as fo:
        for chunk, spec in enumerate(engine.layout.chunks):
            members = engine.chunk_members[chunk]
            region, copy = manager.open_host((Kind.PARAM, chunk), load=False)
            try:
                region.zero_()
                for entry in members:
                    slot = engine.layout.slots[entry.index]
                    rec = recs[entry.name]
                    dst = region[slot.offset * esize : (slot.offset + slot.numel) * esize]
                    _read_into(fp, rec.param_offset, dst)
            finally:
                manager.close_host(copy, modified=True)
            manager.drop_param(chunk)
            if not spec.trainable:
                continue
            region, copy = manager.open_host((Kind.OPTIM, chunk), load=False)
            try:
                region.zero_()
                cap = spec.capacity
                for entry in members:
                    slot = engine.layout.slots[entry.index]
                    rec = recs[entry.name]
                    if rec.optim_offset is None:
                        raise CheckpointError(
                            f"{entry.name} has no optimizer state in the checkpoint"
                        )
                    for k in range(parts):
                        src = (
                            rec.optim_offset + (k * rec.chunk_capacity + rec.element_offset) * FP32
                        )
                        at = (k * cap + slot.offset) * FP32
                        _read_into(fo, src, region[at : at + slot.numel * FP32])
                    engine.tensor_steps[entry.index] = rec.step
            finally:
                manager.close_host(copy, modified=True)
    engine.reset_gradients()
    engine.step_count = meta["step_count"]
    if engine.scaler is not None and meta["loss_scaler"] is not None:
        engine.scaler.load_state_dict(meta["loss_scaler"])
    if optimizer is not None and meta["optimizer"] is not None:
        _load_optimizer(engine, optimizer, meta["optimizer"])
    return meta


def _load_optimizer(engine: OffloadEngine, optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(groups)} optimizer parameter groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    for saved, group in zip(groups, optimizer.param_groups, strict=False):
        names = [engine.registry.entries[p._infinity_index].name for p in group["params"]]
        if names != saved["params"]:
            raise CheckpointError(
                "optimizer parameter groups hold different parameters than in the checkpoint"
            )
        for key, value in saved["hyper"].items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
