"""``OffloadEngine``: one per offloaded model; what the hooks and the optimizer call.

It owns the parameter registry, the plan and the chunk manager, and implements
the per-event logic: a module starts or ends its forward, autograd saves or
unpacks a weight view, a gradient is ready, backward ends.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from infinity.chunks.homes import Kind
from infinity.chunks.layout import ChunkLayout
from infinity.chunks.manager import ChunkManager, typed
from infinity.chunks.states import StateCounters, TensorState
from infinity.config import Config
from infinity.core.names import Phase
from infinity.devices.factory import make_backend
from infinity.optim.chunk_optimizer import ADAM, ChunkOptimizer
from infinity.optim.loss_scale import LossScaler
from infinity.runtime.budgets import DTYPE_OF, plan_for
from infinity.runtime.errors import ModelChangedError
from infinity.runtime.grad_norms import GradientNorms
from infinity.runtime.gradients import GradientEvents
from infinity.runtime.params import (
    ParamEntry,
    ParamRegistry,
    is_placeholder,
    placeholder,
    tensor_index,
)
from infinity.runtime.step_timer import StepTimer
from infinity.runtime.stepping import OptimizerSteps
from infinity.runtime.swap import open_swap, prepare_nvme, release
from infinity.runtime.timeline import Moment, Timeline
from infinity.schedule.eviction import LRUPolicy, TraceDrivenPolicy
from infinity.schedule.prefetch import Prefetcher
from infinity.schedule.trace import TraceRecorder

log = logging.getLogger("infinity")
_S = TensorState


class OffloadEngine(GradientEvents, GradientNorms, OptimizerSteps):
    """Runtime state of one offloaded model."""

    def __init__(self, model: nn.Module, config: Config) -> None:
        self.config = config
        self.dtype = DTYPE_OF[config.dtype]
        self.backend = make_backend(config.device)
        self.device = self.backend.device
        self.registry = ParamRegistry.from_model(model)
        if not self.registry.entries:
            raise ValueError("the model has no parameters: there is nothing to offload")
        prepare_nvme(config)
        # The per-element optimizer the chunks are laid out for (CPUAdam's Adam).
        self.chunk_optimizer: ChunkOptimizer[Any] = ADAM.with_state_dtype(
            config.optimizer_state_dtype
        )
        self.plan = plan_for(self.registry, config, self.device, self.chunk_optimizer)
        self.layout: ChunkLayout = self.plan.layout
        self.swap = open_swap(config, self.plan.nvme_bytes)
        # Frees the threads and the swap file when the model is collected (or at
        # exit) if close() was not called; it holds no reference to the model.
        self._release = weakref.finalize(model, release, self.backend, self.swap)
        self.policy = TraceDrivenPolicy()
        try:
            self.manager = ChunkManager(
                self.plan,
                self.dtype,
                self.backend,
                self.swap,
                device_policy=self.policy,
                host_policy=LRUPolicy,
            )
        except BaseException:
            self._release()  # the model lives on: its finalizer would not run soon
            raise
        self.prefetcher: Prefetcher | None = None
        n = self.layout.num_chunks
        self.chunk_members: list[list[ParamEntry]] = [[] for _ in range(n)]
        for entry in self.registry.entries:
            self.chunk_members[self.layout.slots[entry.index].chunk].append(entry)
        # Position of each tensor inside its chunk's state counters.
        self.local_index = {
            e.index: pos for members in self.chunk_members for pos, e in enumerate(members)
        }
        self.states = [StateCounters(len(m)) for m in self.chunk_members]
        self.has_grad = [False] * len(self.registry.entries)
        self.init_grad_norms()
        self.trace = TraceRecorder()
        self.timeline = Timeline()
        self._resident: tuple[int, tuple[int, ...], tuple[int, ...]] = (-1, (), ())
        self._backward_active = False
        self._param_count = len(self.registry.entries)
        self.tensor_steps = [0] * len(self.registry.entries)
        self.scaler = (
            LossScaler(config.initial_loss_scale, config.loss_scale_window, config.min_loss_scale)
            if config.dtype == "fp16"
            else None
        )
        self.manager.check_overflow = self.scaler is not None
        self.loss_scaled = False
        self.step_count = 0
        self.step_timer = StepTimer(self.manager.traffic)
        # overlap_optimizer=True: the optimizer registers itself; chunks stepped
        # during the current backward are remembered until step().
        self.overlap = config.overlap_optimizer is True
        self.manager.consume_grads = self.overlap
        self.optimizer = None  # weakref to the CPUAdam holding this model's parameters
        # Chunks updated or queued during backward: UpdateState (manager.updates).
        self.early_queue = []
        self._early_hyper = None
        self.early_chunk_steps = 0
        # Updates queued by optimizer.step() that run when their chunk is next needed.
        self.trailing = deque()
        self.trailing_scale = 1.0
        self.trailing_chunk_steps = 0  # updates that ran after optimizer.step() returned
        self.hooks: object | None = None  # the model's HookSet, kept alive with the engine
        self._closed = False

    # --- layout helpers ------------------------------------------------------------
    def set_state(self, entry: ParamEntry, state: TensorState) -> None:
        """Move one parameter to ``state`` (checked against the whitelist)."""
        chunk = self.layout.slots[entry.index].chunk
        self.states[chunk].set(self.local_index[entry.index], state)

    def chunk_view(self, chunk_bytes: torch.Tensor, entry: ParamEntry) -> torch.Tensor:
        """``entry``'s tensor inside a chunk's bytes (compute dtype, its shape)."""
        slot = self.layout.slots[entry.index]
        flat = typed(chunk_bytes, self.dtype)
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def release_new(self, entry: ParamEntry) -> None:
        """Turn a meta parameter into a real one holding its placeholder (same object)."""
        if entry.placeholder is None:
            entry.placeholder = placeholder(entry.shape, self.dtype, self.device)
        fresh = nn.Parameter(entry.placeholder, requires_grad=entry.trainable)
        torch.utils.swap_tensors(entry.param, fresh)

    def release(self, entry: ParamEntry) -> None:
        """Point the parameter back at its placeholder (no chunk memory held)."""
        if entry.placeholder is None:
            entry.placeholder = placeholder(entry.shape, self.dtype, self.device)
        entry.param.data = entry.placeholder

    def access(self, phase: Phase, chunk: int) -> None:
        """Record one access: it becomes the current moment of the iteration."""
        self.manager.moment = self.trace.moment
        self.trace.record(phase, chunk)
        self.policy.active = self.trace.on_track
        self.manager.poll()
        if self.trailing:
            self.poll_trailing(needed=chunk)
        if self.early_queue:
            # NOTE: a gradient arriving needs no parameter bytes; every other
            # access reads them, so the chunk's queued update runs first.
            self.poll_early(needed=None if phase == Phase.GRAD else chunk)

    def prefetch(self) -> None:
        """Start fetching the chunks the trace says come next (never blocks)."""
        if self.prefetcher is None or not self.trace.on_track:
            return
        resident = self.manager.device
        for chunk in self.prefetcher.plan(
            self.manager.moment, lambda c: (Kind.PARAM, c) in resident
        ):
            if self.manager.updates.queued(chunk):
                break  # its update has not run: the home still holds old values
            if self.manager.fetch_param(chunk, prefetch=True) is None:
                break  # no room without evicting something needed sooner

    def _new_trace(self) -> None:
        """A finished iteration became the trace: rebuild Belady's uses and the prefetcher."""
        trace = self.trace.trace
        if trace is None:
            return
        uses: dict = {}
        for position, (phase, chunk) in enumerate(trace.accesses):
            kind = Kind.GRAD if phase == Phase.GRAD else Kind.PARAM
            uses.setdefault((kind, chunk), []).append(position)
        self.policy.set_trace(uses, len(trace))
        depth = self.config.prefetch_depth
        budget = self.config.prefetch_bytes
        if budget == "auto":
            budget = depth * self.layout.chunk_bytes
        self.prefetcher = (
            Prefetcher(trace, depth, int(budget), lambda c: self.plan.param_bytes(c))
            if depth
            else None
        )

    def sample(self, phase: Phase, chunk: int) -> None:
        """Add the tiers' state after an access to the memory timeline."""
        manager = self.manager
        version, params, grads = self._resident
        if version != manager.device.version:
            # NOTE: recomputed only when the device's keys changed (this runs at
            # every access); other keys are retired slots still landing.
            # (kind, chunk) keys, and retired slots' keys, whose [0] is not a Kind
            keys = cast(list[tuple[object, int]], manager.device.keys())
            params = tuple(sorted(k[1] for k in keys if k[0] is Kind.PARAM))
            grads = tuple(sorted(k[1] for k in keys if k[0] is Kind.GRAD))
            self._resident = (manager.device.version, params, grads)
        self.timeline.add(
            Moment(
                phase,
                chunk,
                manager.device_account.used,
                manager.host_account.used,
                params,
                grads,
            )
        )

    # --- forward -----------------------------------------------------------------------
    def begin_module(self, module: nn.Module) -> None:
        """A module's forward starts: make its parameters' chunks resident and bind views."""
        by_chunk = self.layout.group_by_chunk(self.registry.owners[module], tensor_index)
        for chunk, entries in by_chunk.items():
            self.access(Phase.FORWARD, chunk)
            alias = self.manager.param_alias(chunk)
            for entry in entries:
                entry.param.data = self.chunk_view(alias, entry)
                self.set_state(entry, _S.COMPUTE)
            self.sample(Phase.FORWARD, chunk)
        self.prefetch()

    def end_module(self, module: nn.Module) -> None:
        """A module's forward ended: drop the views; the chunks become evictable."""
        for entry in self.registry.owners[module]:
            self.release(entry)
            chunk = self.layout.slots[entry.index].chunk
            if self.states[chunk].states[self.local_index[entry.index]] != _S.COMPUTE:
                continue  # the forward failed before this parameter was bound
            after_grad = self.has_grad[entry.index] and self._backward_active
            self.set_state(entry, _S.HOLD_AFTER_BWD if after_grad else _S.HOLD_AFTER_FWD)

    def begin_forward(self) -> None:
        """The root module's forward starts: check the model, start a new iteration."""
        self.manager.check_io()
        self._check_model()
        if self._backward_active and torch._C._current_graph_task_id() == -1:
            # A backward that never finished (interrupted, or an exception inside
            # it): its end-of-backward callback will not come, so settle it now.
            self._end_backward()
        if not self._backward_active:
            previous = self.trace.trace
            self.trace.start_iteration()
            if self.trace.trace is not previous:
                self._new_trace()
            self.timeline.finish_iteration()
            for counters in self.states:
                counters.reset_step()

    # --- saved tensors -----------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a view of a parameter chunk becomes a handle."""
        key = cast(
            "tuple[object, int] | None",
            self.manager.device.key_at(tensor.untyped_storage().data_ptr()),
        )
        if key is None or key[0] is not Kind.PARAM:
            return tensor
        chunk = key[1]
        return (
            chunk,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset(),
            tensor.dtype,
        )

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: make the chunk resident again and rebuild the view."""
        if not isinstance(packed, tuple):
            return packed
        chunk, shape, stride, offset, dtype = packed
        self._note_backward()
        self.access(Phase.BACKWARD, chunk)
        alias = self.manager.param_alias(chunk)
        self.sample(Phase.BACKWARD, chunk)
        self.prefetch()
        return torch.as_strided(alias.view(dtype), shape, stride, offset)

    def _check_model(self) -> None:
        """Refuse to run if parameters were swapped, added or converted after offload."""
        for entry in self.registry.entries:
            data = entry.param.data
            if not is_placeholder(data) or data.dtype != self.dtype or data.device != self.device:
                raise ModelChangedError(
                    f"parameter {entry.name!r} was changed after infinity.offload() "
                    f"(now {data.dtype} on {data.device}); move or convert the model before "
                    "offloading it, not after"
                )
        count = sum(1 for _ in self._root_parameters())
        if count != self._param_count:
            raise ModelChangedError(
                f"the model now has {count} parameters but had {self._param_count} when it was "
                "offloaded; build the final model first, then call infinity.offload()"
            )

    def _root_parameters(self) -> Iterator[nn.Parameter]:
        root = next(m for m, parent in self.registry.parents.items() if parent is None)
        return root.parameters()

    def close(self) -> None:
        """Wait for transfers, release threads and remove the swap file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        failures = self.manager.failures
        try:
            if failures.first is None:
                self.synchronize()  # queued updates run, every transfer lands (errors raise)
        finally:
            self._release()
        # NOTE: after the cleanup: an I/O error nobody was told about yet is raised.
        failures.raise_unreported()
