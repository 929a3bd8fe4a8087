"""How many bytes autograd saves for a step, without computing it.

The model's forward runs on fake tensors (``FakeTensorMode``: shapes, dtypes
and the device's kernel choices, no memory, no arithmetic) under a saved-tensor
hook that counts what autograd keeps for backward: the same tensors
``activations="offload"`` would move, and, per block, what
``activations="checkpoint"`` would recompute. ``infinity plan``
prints it next to the states.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks

from infinity.activations.blocks import blocks_for


@dataclass
class ActivationEstimate:
    """Saved-tensor bytes of one forward at a batch shape."""

    tokens: int
    total: int = 0  # every saved tensor that is not a parameter ("keep", "offload")
    per_block: list[int] = field(default_factory=list)  # saved inside each block
    block_inputs: list[int] = field(default_factory=list)  # each block's input bytes
    small: int = 0  # tensors below the offload threshold (they stay on the device)

    @property
    def outside_blocks(self) -> int:
        """Saved outside every block (embeddings, final norm, logits, loss)."""
        return self.total - sum(self.per_block)

    @property
    def checkpoint(self) -> int:
        """Peak saved bytes under ``"checkpoint"``: the block inputs, what the blocks
        do not cover, and one block recomputed in backward."""
        return sum(self.block_inputs) + self.outside_blocks + max(self.per_block, default=0)


def estimate(
    model: nn.Module,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    blocks: list[str] | None = None,
    min_bytes: int = 0,
) -> ActivationEstimate:
    """Saved bytes of ``model(input_ids)`` for token ids of shape ``(batch, seq_len)``.

    ``model`` is best on the ``meta`` device (it is copied; the original is
    untouched): its parameters become fake tensors of ``dtype`` on ``device``.
    NOTE: fake, not ``meta``, tensors: on ``meta`` attention dispatches to the
    quadratic reference kernel, on a fake CPU or CUDA tensor to the kernel that
    device runs (flash attention saves O(tokens), not O(tokens^2)). The forward
    is called as a ``transformers`` causal LM (``input_ids``, ``labels``), else
    with one tensor of token ids.
    """
    meta = _without_hooks(copy.deepcopy(model))
    result = ActivationEstimate(tokens=batch * seq_len)
    found = blocks_for(meta, blocks, required=False)
    names = {id(m): i for i, (_, m) in enumerate(found)}
    result.per_block = [0] * len(names)
    result.block_inputs = [0] * len(names)
    current: list[int] = []  # the block running (a stack: blocks do not nest)
    with FakeTensorMode():
        params = _fake_weights(meta, dtype, torch.device(device))

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            base = tensor._base if tensor._base is not None else tensor
            if id(tensor) in params or id(base) in params:
                return tensor
            nbytes = tensor.numel() * tensor.element_size()
            result.total += nbytes
            if nbytes < min_bytes:
                result.small += nbytes
            if current:
                result.per_block[current[-1]] += nbytes
            return tensor

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            index = names[id(module)]
            current.append(index)
            first = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(first, torch.Tensor):
                result.block_inputs[index] = first.numel() * first.element_size()

        def post(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            current.pop()

        handles = []
        for module in meta.modules():
            if id(module) in names:
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(post, with_kwargs=True))
        ids = torch.zeros((batch, seq_len), dtype=torch.long, device=device)
        meta.train()
        try:
            with saved_tensors_hooks(pack, lambda t: t):
                try:
                    meta(input_ids=ids, labels=ids)
                except TypeError:  # not a transformers model: one tensor of token ids
                    meta(ids)
        finally:
            for handle in handles:
                handle.remove()
    return result


def _without_hooks(model: nn.Module) -> nn.Module:
    """``model`` with no module hooks and no instance ``forward``.

    NOTE: a copy of an offloaded model carries the engine's hooks (they would fetch
    chunks for a fake forward) and its checkpoint wrappers; the estimate wants the
    model's own forward on fake tensors, nothing else. Parameters are replaced by
    fake ones (:func:`_fake_weights`), which drops their tensor hooks."""
    for module in model.modules():
        for hooks in (
            module._forward_pre_hooks, module._forward_hooks, module._backward_hooks,
            module._backward_pre_hooks, module._forward_hooks_always_called,
            module._forward_hooks_with_kwargs, module._forward_pre_hooks_with_kwargs,
        ):  # fmt: skip
            hooks.clear()
        module.__dict__.pop("forward", None)
    return model


def _fake_weights(model: nn.Module, dtype: torch.dtype, device: torch.device) -> set[int]:
    """Replace every parameter and buffer by an empty (fake) tensor on ``device``,
    floating ones in ``dtype``; returns the parameters' ids."""
    params: set[int] = set()
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                kind = dtype if p.is_floating_point() else p.dtype
                fake = nn.Parameter(
                    torch.empty(p.shape, dtype=kind, device=device), requires_grad=p.requires_grad
                )
                module._parameters[name] = fake
                params.add(id(fake))
        for name, b in list(module._buffers.items()):
            if b is not None:
                kind = dtype if b.is_floating_point() else b.dtype
                module._buffers[name] = torch.empty(b.shape, dtype=kind, device=device)
    return params
