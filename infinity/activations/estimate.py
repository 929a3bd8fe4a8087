"""How many bytes autograd saves for a step, without computing it.

The model's forward runs on fake tensors (``FakeTensorMode``: shapes, dtypes
and the device's kernel choices, no memory, no arithmetic) under a saved-tensor
hook that counts what autograd keeps for backward: the same tensors
``activations="offload"`` would move, and, per block, what
``activations="checkpoint"`` would recompute. ``infinity plan``
prints it next to the states.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from infinity.activations.blocks import blocks_for
from infinity.activations.spill import _Record, _restore
from infinity.utils.process_memory import device_block_bytes


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
    meta = weightless(model)
    result = ActivationEstimate(tokens=batch * seq_len)
    found = blocks_for(meta, blocks, required=False)
    names = {id(m): i for i, (_, m) in enumerate(found)}
    result.per_block = [0] * len(names)
    result.block_inputs = [0] * len(names)
    current: list[int] = []  # the block running (a stack: blocks do not nest)
    with FakeTensorMode():
        params = fake_weights(meta, dtype, torch.device(device))

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
            with saved_tensors_hooks(pack, lambda t: t), fake_errors_quiet():
                try:
                    meta(input_ids=ids, labels=ids)
                except TypeError:  # not a transformers model: one tensor of token ids
                    meta(ids)
        finally:
            for handle in handles:
                handle.remove()
    return result


@contextlib.contextmanager
def fake_errors_quiet() -> Iterator[None]:
    """Silence torch's ERROR log of each kernel that fails on fake tensors meanwhile.

    NOTE: a fake forward that fails is expected (a model that takes no token ids, a
    classifier given token ids as labels), and its caller falls back; torch still
    logged a traceback per failed kernel, dozens of ERROR lines at a user's offload
    or first forward (DeBERTa's sequence classifier printed 34)."""
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        quiet.setLevel(level)


def weightless(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are empty ``meta`` tensors, with
    no module hooks and no instance ``forward``: the model's own forward, nothing else.

    NOTE: a plain deep copy of an offloaded model copied the chunk slabs its parameters
    view, and the device tensors its hooks reach, on the device, inside the step whose
    first forward asked for the estimate (the fence sweep's allocator found it); a
    model in RAM would be copied whole. The fake run needs shapes only, so the copy
    starts from ``meta`` stand-ins and without the hooks' dictionaries (the engine's
    hooks would fetch chunks for a fake forward); its checkpoint wrappers go too."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if "hooks" in name and isinstance(value, dict):
                memo[id(value)] = type(value)()  # the engine's hooks stay behind
        for p in module._parameters.values():
            if p is not None:
                memo[id(p)] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad
                )
        for b in module._buffers.values():
            if b is not None:
                memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    # The engine's copy guard (runtime/guards.py CopyGuard) refuses a user's deep copy;
    # this one replaces every tensor first, so it is set aside meanwhile.
    guard = model.__dict__.pop("__deepcopy__", None)
    try:
        copied = copy.deepcopy(model, memo)
    finally:
        if guard is not None:
            model.__dict__["__deepcopy__"] = guard
    for module in copied.modules():
        module.__dict__.pop("forward", None)
    return copied


def fake_weights(model: nn.Module, dtype: torch.dtype, device: torch.device) -> set[int]:
    """Replace every parameter and buffer by an empty (fake) tensor on ``device``,
    floating ones in ``dtype``; returns the parameters' ids. A tensor two modules share
    (tied embeddings) stays shared: its gradient is one tensor, accumulated once."""
    fakes: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in fakes:
            kind = dtype if t.is_floating_point() else t.dtype
            empty = torch.empty(t.shape, dtype=kind, device=device)
            fakes[id(t)] = nn.Parameter(empty, t.requires_grad) if parameter else empty
        return fakes[id(t)]

    params: set[int] = set()
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                fake = cast(nn.Parameter, fake_of(p, True))
                module._parameters[name] = fake
                params.add(id(fake))
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake_of(b, False)
    return params


@dataclass
class StepMemory:
    """What one training step holds on its compute device beyond the parameters, from a
    forward, loss and backward on fake tensors (:func:`step_memory`).

    ``peak``: the most bytes alive at once (saved activations, intermediates, the loss's
    logits and their gradient, gradients before they land in their chunks);
    ``saved``: alive at the end of forward (what backward starts from);
    ``loss``: the most the loss added to what the backbone held (its logits and
    their gradient: the working set :mod:`infinity.models.losses` takes in blocks).
    """

    peak: int = 0
    saved: int = 0
    loss: int = 0
    largest_moved: int = 0  # the largest saved tensor "offload" moves off the device

    @property
    def transient(self) -> int:
        """The peak beyond what forward left for backward."""
        return max(0, self.peak - self.saved)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages operators create, counted until each storage dies; the peak.

    NOTE: storages, not tensors: views share their base's bytes, and a storage's
    Python object lives exactly as long as some tensor uses it (torch keeps one per
    storage), so a weak reference's callback is the moment the bytes are freed.
    """

    def __init__(self, existing: list[torch.Tensor], granule: int = 1) -> None:
        super().__init__()
        self.granule = granule  # the allocator's rounding of every block
        self.live = 0
        self.peak = 0
        self.window: tuple[int, int] | None = None  # (live at its start, its peak)
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for tensor in existing:  # the weights: a view of one (``weight.t()``) is free
            self._seen[tensor.untyped_storage()] = None

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage not in self._seen:
                    nbytes = -(-storage.nbytes() // self.granule) * self.granule
                    self._seen[storage] = weakref.finalize(storage, self._free, nbytes)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    if self.window is not None:
                        self.window = (self.window[0], max(self.window[1], self.live))
        return out


StepFn = Callable[[nn.Module], torch.Tensor]


def step_memory(
    model: nn.Module,
    step: StepFn,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    policy: str = "keep",
    blocks: Sequence[str] | None = None,
    min_bytes: int = 64 << 10,
) -> StepMemory:
    """The device bytes one step of ``model`` holds beyond its parameters (a fake run).

    ``step(model)`` runs the forward and returns the loss, which is backpropagated;
    it may build its inputs (on ``device``) or pass real CPU tensors (made fake on the
    way in). ``policy`` is the activation policy the step runs under: ``"offload"``
    moves every saved tensor of at least ``min_bytes`` off the device until backward
    unpacks it, ``"checkpoint"`` recomputes each block in backward, ``"keep"`` (and
    ``"auto"``, at its most) keeps them. Gradients leave as they are made, as they
    leave for their chunks in the engine.
    """
    from infinity.activations.blocks import CheckpointedBlocks

    fake = weightless(model)
    result = StepMemory()
    found = blocks_for(fake, blocks, required=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = fake_weights(fake, dtype, torch.device(device))
        for p in fake.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        if policy == "checkpoint":
            CheckpointedBlocks(found)
        # The device's allocator holds every block in multiples of its rounding
        tracker = _LiveBytes(
            [*fake.parameters(), *fake.buffers()], device_block_bytes(torch.device(device))
        )

        def pack(tensor: torch.Tensor) -> Any:
            base = tensor._base if tensor._base is not None else tensor
            if policy != "offload" or id(tensor) in params or id(base) in params:
                return tensor
            if tensor.numel() * tensor.element_size() < min_bytes:
                return tensor
            record = _Record(0, tensor)
            result.largest_moved = max(result.largest_moved, record.nbytes)
            return record, tensor.device

        def unpack(packed: Any) -> torch.Tensor:
            # Back as the store brings it back (spill.py): its bytes as they
            # travelled, then the tensor over them, laid out again where it must be.
            if isinstance(packed, torch.Tensor):
                return packed
            record, where = packed
            flat = torch.empty(record.nbytes // record.dtype.itemsize, dtype=record.dtype)
            return _restore(record, flat.to(where))

        def open_window(_module: nn.Module, _args: Any, output: Any) -> None:
            tracker.window = (tracker.live, tracker.live)
            first = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)), None)
            if first is not None and first.requires_grad:
                first.register_hook(close_window)

        def close_window(*_: Any) -> None:
            if tracker.window is not None:
                result.loss = max(result.loss, tracker.window[1] - tracker.window[0])
            tracker.window = None

        # NOTE: the loss's share is what runs between the last block's forward and its
        # output's gradient: the final norm, the head, the loss and their gradients. A
        # tensor hook, not a module backward hook: those add autograd nodes, which
        # change the order backward frees in (and the peak, by a weight's gradient).
        hooks = []
        if found:
            hooks.append(found[-1][1].register_forward_hook(open_window))
        fake.train()
        try:
            # NOTE: the policy's hooks are on for the forward only, as the engine's are
            # (its root module's forward): a block a reentrant checkpoint recomputes in
            # backward keeps what it saves.
            with tracker:
                with saved_tensors_hooks(pack, unpack):
                    loss = step(fake)
                result.saved = tracker.live
                loss.backward()
                close_window()
        finally:
            for handle in hooks:
                handle.remove()
        result.peak = tracker.peak
    return result
