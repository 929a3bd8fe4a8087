"""The activation policy of one offloaded model: measure, check, choose, route.

:class:`ActivationPolicy` is what the engine's hooks talk to about saved tensors:

- every forward is measured (:class:`ActivationTrace`): the bytes autograd
  saves (tensors on the compute device that are not parameter views), in all
  and per block, with the forward's tokens;
- a forward with more tokens than any before is checked **before it runs**:
  if what it will save (predicted from the measured bytes per token) fits
  nowhere the policy may put it, it raises :class:`~infinity.config.ConfigError`
  naming the bytes, instead of failing halfway (a full disk) or being killed
  (memory);
- ``"auto"`` runs its first forward as ``"offload"`` and then chooses per block
  (:func:`choose_blocks`), again when the tokens grow;
- :meth:`ActivationPolicy.pack` routes a saved tensor: it stays (``"keep"``,
  a block ``"auto"`` keeps) or goes to the store (:mod:`.store`).

From the largest forward measured, :meth:`ActivationTrace.predict` says what a
forward with more tokens will save (linearly: an underestimate for attention
whose saves grow faster, so the check never refuses a step that would fit).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from infinity.activations.blocks import CheckpointedBlocks
from infinity.activations.estimate import estimate
from infinity.activations.store import ActivationStore
from infinity.config import ConfigError
from infinity.utils.sizes import format_size

KEEP, OFFLOAD, CHECKPOINT = "keep", "offload", "checkpoint"
log = logging.getLogger("infinity")
Estimator = Callable[[int, int], "ForwardSaves | None"]


@dataclass
class ForwardSaves:
    """Bytes one forward saved for backward (``tokens``: its batch x sequence)."""

    tokens: int
    total: int = 0
    per_block: list[int] = field(default_factory=list)
    on_device: int = 0  # of total, what stayed on the compute device (not moved)

    @property
    def outside_blocks(self) -> int:
        """Saved outside every block (embeddings, final norm, logits, loss)."""
        return self.total - sum(self.per_block)

    def scaled(self, tokens: int) -> ForwardSaves:
        """The same forward at ``tokens`` (every saved tensor grows with the tokens)."""
        ratio = tokens / max(1, self.tokens)
        return ForwardSaves(
            tokens, round(self.total * ratio), [round(b * ratio) for b in self.per_block]
        )


def batch_shape(args: tuple, kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """(batch, sequence) of a forward's input: ``input_ids`` (or ``inputs_embeds``), else
    the first tensor argument; a 1-D one is one sequence."""
    first = kwargs.get("input_ids")
    if first is None:
        first = kwargs.get("inputs_embeds")
    if first is None:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return None
    if first.dim() == 1:
        return 1, int(first.shape[0])
    return int(first.shape[0]), int(first.shape[1])


class ActivationTrace:
    """Saved bytes per forward, per block (``blocks``: the model's repeated blocks)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self._index = {id(m): i for i, m in enumerate(blocks)}
        self.block_count = len(blocks)
        self._stack: list[int] = []  # blocks running (recomputations in backward too)
        self._forward: ForwardSaves | None = None  # the forward being measured
        self.last: ForwardSaves | None = None
        self.largest: ForwardSaves | None = None  # the most tokens measured

    @property
    def current_block(self) -> int | None:
        """Index of the innermost block running, or ``None``."""
        return self._stack[-1] if self._stack else None

    def enter(self, module: nn.Module) -> None:
        """A block's forward starts (its forward pre-hook)."""
        self._stack.append(self._index[id(module)])

    def leave(self, module: nn.Module) -> None:
        """A block's forward ended, or raised (its forward hook, ``always_call``)."""
        if self._stack:
            self._stack.pop()

    def begin(self, tokens: int | None) -> None:
        """A root forward starts; ``None``: not measured (no tokens, or no grad)."""
        self._stack.clear()
        self._forward = (
            None if tokens is None else ForwardSaves(tokens, per_block=[0] * self.block_count)
        )

    def saved(self, tensor: torch.Tensor, moved: bool) -> None:
        """Autograd saved ``tensor`` during the forward being measured (``moved``: it
        left the device)."""
        forward = self._forward
        if forward is None:
            return
        nbytes = tensor.numel() * tensor.element_size()
        forward.total += nbytes
        if not moved and tensor.device.type != "meta":
            forward.on_device += nbytes
        if self._stack:
            forward.per_block[self._stack[-1]] += nbytes

    def end(self) -> None:
        """The root forward ended: its measurement becomes ``last``."""
        forward, self._forward = self._forward, None
        if forward is None or forward.total == 0:
            return
        self.last = forward
        if self.largest is None or forward.tokens >= self.largest.tokens:
            self.largest = forward

    def predict(self, tokens: int | None) -> ForwardSaves | None:
        """What a forward of ``tokens`` will save, when it has more tokens than any
        measured (``None`` otherwise: one at least as large has run already)."""
        if tokens is None or self.largest is None or tokens <= self.largest.tokens:
            return None
        return self.largest.scaled(tokens)

    def per_token(self) -> float:
        """Bytes saved per token by the largest forward measured (0: none yet)."""
        largest = self.largest
        return 0.0 if largest is None else largest.total / max(1, largest.tokens)


def first_forward_estimate(
    model: nn.Module, dtype: torch.dtype, device: torch.device, config: Any
) -> Estimator:
    """What a forward of (batch, sequence) would save, before any has been measured:
    the model's forward on fake tensors (:mod:`.estimate`), ``None`` where that does
    not run (a model not called with token ids). Holds the model weakly."""
    ref = weakref.ref(model)

    def run(batch: int, seq: int) -> ForwardSaves | None:
        target = ref()
        if target is None:
            return None
        try:
            est = estimate(target, batch, seq, dtype, device, config.activation_blocks)
        except Exception as exc:  # best effort: the forward itself is measured
            log.debug("activations: no estimate before the first forward (%s)", exc)
            return None
        return ForwardSaves(est.tokens, est.total, list(est.per_block))

    return run


def choose_blocks(
    per_block: Sequence[int], device_room: int, host_room: int, has_nvme: bool
) -> list[str]:
    """``"auto"``'s choice per block from what each saves (``per_block`` bytes).

    Backward needs the last blocks first, so they are placed first: **keep** on
    the device while ``device_room`` holds them (no traffic, no recompute), then
    **offload** (to host memory while ``host_room`` holds them, and with an NVMe
    tier to it without limit: moving bytes costs less than recomputing them on
    a device that waits for neither), and the earliest blocks that fit nowhere
    **checkpoint** (only their inputs are kept).
    """
    choice = [CHECKPOINT] * len(per_block)
    for index in reversed(range(len(per_block))):
        nbytes = per_block[index]
        if nbytes <= device_room:
            choice[index], device_room = KEEP, device_room - nbytes
        elif has_nvme or nbytes <= host_room:
            choice[index], host_room = OFFLOAD, max(0, host_room - nbytes)
    return choice


class ActivationPolicy:
    """Saved tensors of one model under ``Config(activations=mode)``.

    Args:
        mode: ``"keep"``, ``"checkpoint"``, ``"offload"`` or ``"auto"``.
        blocks: the model's repeated blocks (may be empty: totals only, and
            ``"auto"`` then offloads everything).
        store: where offloaded tensors go (``"offload"`` and ``"auto"``).
        device_room: device bytes the chunk slots leave (``"auto"`` keeps there).
        device_free: free bytes on the device now, or ``None`` if not known.
        estimate: what a forward of (batch, sequence) would save, before the first
            one is measured (:func:`first_forward_estimate`).
    """

    def __init__(
        self,
        mode: str,
        blocks: list[tuple[str, nn.Module]],
        store: ActivationStore | None,
        device_room: int,
        device_free: Callable[[], int | None],
        estimate: Estimator | None = None,
    ) -> None:
        self.mode = mode
        self.store = store
        self.device_room = device_room
        self._device_free = device_free
        self._estimate = estimate
        self._blocks = blocks
        self.trace = ActivationTrace([module for _, module in blocks])
        self.checkpointed: CheckpointedBlocks | None = None
        self.choice: list[str] | None = None  # "auto": per block, once measured
        self._chosen_for = 0  # the tokens the choice was made for

    @property
    def blocks(self) -> list[nn.Module]:
        """The modules the trace attributes saved bytes to."""
        return [module for _, module in self._blocks]

    def attach(self) -> None:
        """Wrap the blocks ``"checkpoint"`` recomputes (with the engine's hooks)."""
        if self.mode == CHECKPOINT and self.checkpointed is None:
            self.checkpointed = CheckpointedBlocks(self._blocks)

    # --- forward -------------------------------------------------------------------------
    def begin_forward(self, shape: tuple[int, int] | None, new_iteration: bool) -> None:
        """A root forward starts: choose (``"auto"``), check it fits, measure it."""
        if not torch.is_grad_enabled() or shape is None:
            self.trace.begin(None)  # nothing saved, or no tokens: nothing to check
            return
        tokens = shape[0] * shape[1]
        predicted = self.trace.predict(tokens)
        if self.trace.largest is None and self._estimate is not None:
            # The first forward has nothing measured to predict from: the
            # estimate on fake tensors stands in, so a first step too large fails
            # before it runs too.
            predicted = self._estimate(*shape)
        if self.mode == "auto" and new_iteration:
            self._choose(tokens)
        if predicted is not None:
            self._check_fit(predicted)
        self.trace.begin(tokens)

    def end_forward(self) -> None:
        """The root forward ended: record it; backward's first reads start."""
        self.trace.end()
        if self.store is not None:
            self.store.end_forward()

    def pack(self, tensor: torch.Tensor) -> Any:
        """A saved tensor that is not a parameter: kept or stored, and measured."""
        block = self.trace.current_block
        kept = self.store is None or (
            self.choice is not None and block is not None and self.choice[block] == KEEP
        )
        out = tensor if kept or self.store is None else self.store.pack(tensor)
        self.trace.saved(tensor, moved=out is not tensor)
        return out

    # --- auto ----------------------------------------------------------------------------
    def _choose(self, tokens: int | None) -> None:
        measured = self.trace.largest
        if measured is None or (self.choice is not None and (tokens or 0) <= self._chosen_for):
            return  # first forward: offload everything and measure it; or chosen already
        target = max(tokens or 0, measured.tokens)
        sizes = measured.scaled(target).per_block
        store = self.store
        host_room = 0 if store is None else store.host_capacity
        has_nvme = store is not None and store.spill is not None
        choice = choose_blocks(sizes, self.device_room, host_room, has_nvme)
        if self.checkpointed is not None:
            self.checkpointed.remove()
        chosen = [b for b, c in zip(self._blocks, choice, strict=True) if c == CHECKPOINT]
        self.checkpointed = CheckpointedBlocks(chosen) if chosen else None
        self.choice, self._chosen_for = choice, target

    # --- the check before a larger forward -----------------------------------------------
    def _check_fit(self, predicted: ForwardSaves) -> None:
        """Raise before a forward whose saved tensors cannot fit where the policy puts them."""
        need = predicted.total
        measured = self.trace.largest
        per_token = format_size(round(need / max(1, predicted.tokens)))
        how = (
            f"measured at {measured.tokens}"
            if measured is not None
            else "estimated before the first forward"
        )
        basis = f"{format_size(need)} for {predicted.tokens} tokens ({per_token} per token, {how})"
        store = self.store
        if store is not None:
            host_free = max(0, store.host_capacity - store.tier_bytes()[0])
            beyond_host = need - host_free
            if store.spill is not None:
                room = store.spill.room(store.tier_bytes()[1])
                if room is not None and beyond_host > room:
                    raise ConfigError(
                        f"activations={self.mode!r}: this forward would save {basis}; host "
                        f"memory holds {format_size(host_free)} of it and NVMe "
                        f"{format_size(room)} ({self._nvme_limit_words(store)}), "
                        f"{format_size(beyond_host - room)} short; lower the tokens per step, "
                        "raise nvme_memory or free disk space, or use activations='checkpoint'"
                    )
                return
            need = beyond_host  # no NVMe tier: what the host does not hold stays on the device
        free = self._device_free()
        if free is not None and need > free:
            fixes = (
                "use activations='offload' with an nvme_path, or 'checkpoint'"
                if self.mode == KEEP
                else "set nvme_path (activations spill there)"
                if store is not None
                else "use activations='offload' with an nvme_path"
            )
            raise ConfigError(
                f"activations={self.mode!r}: this forward would save {basis} on the device "
                f"({self._device_words()}), which has {format_size(free)} free; lower the "
                f"tokens per step, or {fixes}"
            )

    def _device_words(self) -> str:
        return "beyond the host memory the states leave" if self.store is not None else "kept"

    @staticmethod
    def _nvme_limit_words(store: ActivationStore) -> str:
        assert store.spill is not None
        return (
            "what nvme_memory leaves beyond the states"
            if store.spill.limit is not None
            else ("the disk's free space")
        )

    # --- statistics and teardown ---------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The store's counters (if any), the last forward's saved bytes, ``"auto"``'s choice."""
        out: dict[str, Any] = dict(self.store.snapshot()) if self.store is not None else {}
        last = self.trace.last
        out["policy"] = self.mode
        out["saved_last_forward_bytes"] = 0 if last is None else last.total
        # what of it stayed on the device: all under keep, the small ones and the blocks
        # "auto" keeps under offload and auto
        out["device_last_forward_bytes"] = 0 if last is None else last.on_device
        out["tokens_last_forward"] = 0 if last is None else last.tokens
        out["saved_bytes_per_token"] = self.trace.per_token()
        out["per_block_last_forward_bytes"] = [] if last is None else list(last.per_block)
        if self.choice is not None:
            out["blocks"] = {c: self.choice.count(c) for c in (KEEP, OFFLOAD, CHECKPOINT)}
        return out

    def remove(self) -> None:
        """Undo the checkpoint wrappers (the hooks are removed)."""
        if self.checkpointed is not None:
            self.checkpointed.remove()
            self.checkpointed = None
