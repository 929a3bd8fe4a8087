"""What a model's forward does with its parameters, from one fake run at ``offload``.

The forward runs once on fake tensors (a weightless copy: shapes only, no memory,
no arithmetic) to learn two things the registry lays the chunks out by:

- the order it first calls the modules that own parameters (chunks are packed in
  that order);
- which parameters a module's forward reads although they belong to another module
  that is not running (DeBERTa's encoder reads its relative-position embedding's
  weight; a hand-tied head reads the token embedding's): the engine binds those
  owners for the reader's whole forward, as it binds a module for its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from infinity.activations.estimate import fake_errors_quiet, fake_weights, weightless


@dataclass
class ForwardTrace:
    """What one fake forward did: ``order``, the names of the modules owning
    parameters in the order it first called them; ``reads``, by the name of a module,
    the names of the parameters its forward read while no module holding them ran."""

    order: list[str] = field(default_factory=list)
    reads: dict[str, set[str]] = field(default_factory=dict)


# What reads a tensor's metadata only (``weight.dtype`` is a getter through the mode):
# not a use of its values, so no reason to bind it.
_METADATA = frozenset(
    ("__get__", "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride",
     "is_floating_point", "is_complex", "is_contiguous", "get_device", "__len__")
)  # fmt: skip


class _Reads(TorchFunctionMode):
    """Records the parameters each torch function reads outside their modules."""

    def __init__(self, trace: ForwardTrace, holders: dict[int, tuple[str, set[str]]]) -> None:
        super().__init__()
        self.trace = trace
        self.holders = holders  # id(parameter) -> (its name, names of the modules holding it)
        self.running: Counter[str] = Counter()
        self.stack: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in _METADATA:
            return func(*args, **(kwargs or {}))
        for leaf in tree_flatten((args, kwargs or {}))[0]:
            held = self.holders.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if held is not None and self.stack and not any(self.running[m] for m in held[1]):
                self.trace.reads.setdefault(self.stack[-1], set()).add(held[0])
        return func(*args, **(kwargs or {}))


def forward_trace(model: nn.Module, seq_len: int = 8) -> ForwardTrace | None:
    """The :class:`ForwardTrace` of ``model``'s forward on one sequence of ``seq_len``
    token ids; ``None`` where that forward does not run.

    NOTE: the order parameters are registered in is not the order a forward uses them
    (a ``transformers`` decoder layer registers its norms after its attention and MLP,
    and runs each norm first). Chunks packed in registration order then receive their
    gradients out of order: a 16-layer Llama held up to three half-filled gradient
    chunks at once in backward, whose evictions moved 1.4x the plan's bytes to the
    device and 1.9x from it. Packed in forward order, a chunk's gradients arrive
    together. A model without an embedding table takes no token ids: it keeps its
    registration order without the fake run (whose first use costs ~5 MiB)."""
    if not any(isinstance(m, nn.Embedding) for m in model.modules()):
        return None
    try:
        meta = weightless(model)
    except Exception:  # an uncopyable model keeps its registration order
        return None
    names = {id(m): name for name, m in meta.named_modules()}
    owners = {id(m) for m in meta.modules() if any(True for _ in m.parameters(recurse=False))}
    trace = ForwardTrace()
    order: dict[str, None] = {}
    reads = _Reads(trace, {})

    def pre(module: nn.Module, args: tuple) -> None:
        name = names[id(module)]
        if id(module) in owners:
            order.setdefault(name, None)
        reads.running[name] += 1
        reads.stack.append(name)

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        name = reads.stack.pop()
        reads.running[name] -= 1

    handles = [m.register_forward_pre_hook(pre) for m in meta.modules()]
    handles += [m.register_forward_hook(post, always_call=True) for m in meta.modules()]
    try:
        with FakeTensorMode(), torch.no_grad(), fake_errors_quiet():
            fake_weights(meta, torch.float32, torch.device("cpu"))
            for name, param in meta.named_parameters():
                reads.holders[id(param)] = (name, set())
            for module_name, module in meta.named_modules():
                for param in module._parameters.values():
                    if param is not None:
                        reads.holders[id(param)][1].add(module_name)
            ids = torch.zeros((1, seq_len), dtype=torch.long)
            with reads:
                try:
                    meta(input_ids=ids)
                except TypeError:  # not a transformers model: one tensor of token ids
                    meta(ids)
    except Exception:  # any forward it cannot run keeps registration order
        return None
    finally:
        for handle in handles:
            handle.remove()
    trace.order = list(order)
    return trace


def forward_order(model: nn.Module, seq_len: int = 8) -> list[str] | None:
    """The names of ``model``'s modules that own parameters, in the order its forward
    first calls them (:func:`forward_trace`); ``None`` where that forward does not run."""
    trace = forward_trace(model, seq_len)
    return trace.order if trace is not None else None
