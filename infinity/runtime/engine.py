"""``OffloadEngine``: one per offloaded model; what the hooks and the optimizer call.

Made at ``offload`` with the offload plan (Adam's, to check the budgets) and nothing
allocated; :meth:`OffloadEngine.lay_out` then builds, once, the components below on
homes planned for the first optimizer constructed over the model (or Adam's at the
first forward or read): NOTE [the layout is decided once, late]. Each component owns
its state and is built only on those before it (one dependency direction, none
knows the engine):

- :class:`~infinity.runtime.model_chunks.ModelChunks` (``chunks``): registry,
  plan, layout, chunk manager, tensor states, step counts, gradient states;
- :class:`~infinity.runtime.update_queue.UpdateQueue` (``queue``): updates
  queued early (during backward) or trailing (into the next forward);
- :class:`~infinity.runtime.update_queue.ParamFetcher` (``fetcher``): accesses,
  the trace, prefetch;
- :class:`~infinity.runtime.grad_ledger.GradientLedger` (``ledger``): which
  tensors hold a gradient, pending clip factors, zeroing;
- :class:`~infinity.runtime.gradients.GradientNorms` (``norms``): norms and
  scaling through the ``param.grad`` sentinels;
- :class:`~infinity.runtime.stepping.UpdatePipeline` (``pipeline``): the
  optimizer step, early steps, loss scale, optimizer state;
- :class:`~infinity.runtime.gradients.GradientSink` (``sink``): gradient
  arrival, start and end of backward.

The engine itself handles the forward side (a module starts or ends, autograd saves or
unpacks a weight view) and keeps the methods hooks, the optimizer front-ends (``CPUAdam``,
``CPUSGD``, ``CPULion``), state access and checkpoints call."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from infinity.activations.blocks import blocks_for, recomputed_blocks
from infinity.activations.policy import ActivationPolicy, first_forward_estimate
from infinity.activations.store import SavedActivation
from infinity.chunks.homes import Kind
from infinity.chunks.manager import ChunkManager
from infinity.chunks.states import TensorState
from infinity.config import Config
from infinity.core.names import Phase
from infinity.core.plan import Plan
from infinity.devices.choice import make_backend
from infinity.distributed import Collectives, resolve_world
from infinity.distributed.agreement import check_same_units
from infinity.io import SwapFile
from infinity.io.directories import prepare_directory
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.optim.cpu_adam import ADAM
from infinity.optim.offloaded import LossScaler, MomentState
from infinity.runtime.budgets import DTYPE_OF, bind_optimizer, first_layout, plan_for
from infinity.runtime.grad_ledger import GradientLedger
from infinity.runtime.gradients import GradientNorms, GradientSink
from infinity.runtime.model_chunks import ChunkIO, ModelChunks
from infinity.runtime.params import (
    PLACEHOLDER_STORAGES,
    ParamEntry,
    ParamRegistry,
    check_late_checkpointing,
    check_model,
    placeholder_used,
    tensor_index,
)
from infinity.runtime.stepping import UpdatePipeline, check_moments, read_moments, write_moments
from infinity.runtime.swap import (
    activation_host_room,
    close_activation_store,
    open_activation_store,
    open_swap,
    prepare_nvme,
    release,
    swap_directory,
)
from infinity.runtime.update_queue import ParamFetcher, UpdateQueue
from infinity.schedule.trace import LRUPolicy, TraceDrivenPolicy, TraceRecorder
from infinity.utils.process_memory import baseline_resident_set, return_freed_memory

log = logging.getLogger("infinity")
_S = TensorState
# What OffloadEngine.lay_out makes (read before it, they make it: __getattr__).
_LAID_OUT = frozenset(
    "home_plan layout swap manager policy chunks chunk_io trace queue fetcher ledger norms "
    "pipeline sink activations".split()
)


class OffloadEngine:
    """Runtime state of one offloaded model (see the module docstring)."""

    def __init__(self, model: nn.Module, config: Config) -> None:
        self.forecast: Any = None  # runtime.memory.MemoryForecast, once one is made
        self.config = config
        self.dtype = DTYPE_OF[config.dtype]
        self.backend = make_backend(config.device)
        self.device = self.backend.device
        self.registry = ParamRegistry.from_model(model, recomputed_blocks(model, config))
        self.baseline_rss = baseline_resident_set()  # before anything is allocated
        if not self.registry.entries:
            raise ValueError("the model has no parameters: there is nothing to offload")
        prepare_nvme(config)
        # Data parallel: the processes every chunk is sharded over (one: unsharded).
        self.world = resolve_world(config.process_group)
        self.collectives = Collectives(self.world)
        # NOTE [the layout is decided once, late]: Adam's plan (the largest units)
        # checks the budgets now; the homes are planned and allocated in lay_out.
        self.offload_optimizer: ChunkOptimizer[Any] = ADAM.with_state_dtype(
            config.optimizer_state_dtype
        )
        self.offload_plan = plan_for(
            self.registry, config, self.device, self.offload_optimizer, world=self.world
        )
        if self.offload_plan.nvme_bytes:
            # A bad nvme_path fails here, at offload, not at the optimizer's construction.
            prepare_directory(Path(swap_directory(config)))
        self.scaler = (
            LossScaler(config.initial_loss_scale, config.loss_scale_window, config.min_loss_scale)
            if config.dtype == "fp16"
            else None
        )
        self.overlap = config.overlap_optimizer is True
        self.swaps: list[SwapFile] = []
        # Frees threads and swap files when the model dies unclosed (holds no reference).
        self._release = weakref.finalize(model, release, self.backend, self.swaps)
        checkpoint = config.activations == "checkpoint"
        # Its store and device room are set by lay_out (they follow the plan).
        self.activation_policy = ActivationPolicy(
            config.activations,
            blocks_for(model, config.activation_blocks, required=checkpoint),
            None,
            device_room=0,
            device_free=self.backend.free_memory,
            estimate=first_forward_estimate(model, self.dtype, self.device, config),
        )
        self._param_count = len(self.registry.entries)
        # The model's HookSet, held weakly: the model's hooks own it and it owns this
        # engine (NOTE [the model owns its engine]). Set by offload.
        self.hooks_ref: weakref.ref[Any] | None = None
        # By module: (attribute, Parameter) a recomputation sees through a view (_stand_in).
        self._stand_ins: dict[nn.Module, list[tuple[str, nn.Parameter]]] = {}
        self._closed = False
        # Writes the model's initial values into the homes (offload sets it; lay_out runs it).
        self.fill: Callable[[OffloadEngine], None] | None = None
        self.laid_out_by = ""  # what made lay_out run ("": it has not)
        self._layout_failure: BaseException | None = None
        self._laying_out = False

    # --- the layout, decided once ----------------------------------------------------------
    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            # NOTE [the layout is decided once, late]: a component read before any
            # optimizer was constructed and before the first forward (a load, a state
            # dict, stats) lays the chunks out for the offload plan's Adam.
            if name not in _LAID_OUT or "_laying_out" not in self.__dict__:
                raise AttributeError(name)
            if self._laying_out:
                raise AttributeError(f"OffloadEngine.{name} was read before lay_out made it")
            self.lay_out(f"a read of its {name} before any optimizer or forward")
            return self.__dict__[name]

    @property
    def hooks(self) -> Any:
        """The hooks this engine installed on its model (``None`` once they are gone)."""
        return self.hooks_ref() if self.hooks_ref is not None else None

    @property
    def laid_out(self) -> bool:
        """Whether the homes are planned and allocated and the initial values written."""
        return "chunks" in self.__dict__

    def lay_out(
        self,
        why: str = "lay_out()",
        units: ChunkOptimizer[Any] | None = None,
        plan: Plan | None = None,
    ) -> None:
        """Plan the homes, allocate them, build the components on them and write the
        model's initial values; once (``why``: what asked, for messages).

        ``units`` and ``plan``: a chunk optimizer and its plan made with the offload
        plan's budgets (default: the offload plan's Adam). Under data parallel every
        rank must lay out for the same units (checked: a collective). On any failure
        what was made is released and the model is unusable: every later use raises,
        naming the failure (the initial values may be half written).
        """
        if self.laid_out:
            return
        if self._layout_failure is not None:
            failure = self._layout_failure
            raise RuntimeError(
                f"this model's chunks could not be laid out ({type(failure).__name__}: "
                f"{failure}); call infinity.offload() on a new model"
            ) from failure
        # The values to lay out are those offload kept: a conversion or write since would
        # be dropped silently (the parameters show placeholders from offload on).
        check_model(
            self.registry, self.dtype, self.device, self._param_count, torch.is_grad_enabled()
        )
        if units is None or plan is None:
            units, plan = self.offload_optimizer, self.offload_plan
        self._laying_out = True
        try:
            if self.world.sharded:
                check_same_units(self.collectives, f"{units.name} as {units.state_format}", why)
            self._lay_out(units, plan)
            self.laid_out_by = why
        except BaseException as exc:
            for name in _LAID_OUT:
                self.__dict__.pop(name, None)
            self._layout_failure = exc
            self._release()  # the model lives on: its finalizer would not run soon
            raise
        finally:
            self._laying_out = False

    def _lay_out(self, units: ChunkOptimizer[Any], plan: Plan) -> None:
        swap = open_swap(self.config, plan.nvme_bytes)
        if swap is not None:
            self.swaps.append(swap)  # the finalizer removes it
        manager = ChunkManager(
            plan,
            self.dtype,
            self.backend,
            swap,
            device_policy=TraceDrivenPolicy(),
            host_policy=LRUPolicy,
            collectives=self.collectives,
        )
        self.home_plan = plan  # the homes as allocated (a re-cut changes chunks.plan)
        self.layout = plan.layout
        self.swap = swap
        self.manager = manager
        self.policy = cast(TraceDrivenPolicy, manager.device.policy)
        manager.grad_flow.check_overflow = self.scaler is not None
        manager.grad_flow.consume_grads = self.overlap
        self.chunks = ModelChunks(self.registry, plan, manager, self.dtype, self.device, units)
        self.chunk_io = ChunkIO(self.chunks)  # checkpoints' and pretrained weights' access
        self.trace = TraceRecorder()
        self.queue = UpdateQueue(self.chunks, self.trace)
        self.fetcher = ParamFetcher(self.chunks, self.queue, self.trace, self.policy, self.config)
        self.ledger = GradientLedger(self.chunks)
        self.norms = GradientNorms(self.chunks, self.ledger, self.queue, self.scaler)
        self.pipeline = UpdatePipeline(
            self.chunks, self.queue, self.ledger, self.scaler, self.fetcher.prefetch
        )
        self.sink = GradientSink(
            self.chunks,
            self.fetcher,
            self.queue,
            self.ledger,
            self.norms,
            self.pipeline,
            overlap=self.overlap,
        )
        # activations="offload": where saved tensors go (pack/unpack below).
        self.activations = open_activation_store(
            self.config, plan, self.backend, manager.host_account.reserved
        )
        if self.activations is not None:
            self.chunks.activation_bytes = self.activations.tier_bytes
            if self.backend.shares_host_memory:
                return_freed_memory()  # NOTE [freed memory returns]: RAM over speed, as asked
        self.activation_policy.store = self.activations
        self.activation_policy.device_room = max(
            0, plan.budgets.device - plan.device_reserved_bytes
        )
        fill, self.fill = self.fill, None
        if fill is not None:
            fill(self)

    # --- what other layers read or set ---------------------------------------------------
    @property
    def plan(self) -> Plan:
        """Where every chunk lives, with the optimizer units as the optimizer cuts them."""
        return self.chunks.plan

    @property
    def chunk_optimizer(self) -> ChunkOptimizer[Any]:
        """The per-element optimizer the optimizer units are laid out for."""
        return self.chunks.chunk_optimizer

    def use_optimizer(
        self, chunk_optimizer: ChunkOptimizer[Any], owner: str, ref: Callable[[], Any]
    ) -> None:
        """An optimizer ``owner`` (held weakly by ``ref``) was constructed over this
        model: the homes are planned for its ``chunk_optimizer`` where they are not yet
        (NOTE [the layout is decided once, late]), else its units are cut inside them
        (:func:`~infinity.runtime.budgets.recut`; a clear error if they do
        not fit)."""
        first = not self.laid_out
        if first:
            units, plan, why = first_layout(
                self.registry,
                self.config,
                self.device,
                self.world,
                (self.offload_optimizer, self.offload_plan),
                chunk_optimizer,
                owner,
            )
            self.lay_out(why, units, plan)
        bind_optimizer(
            self.chunks,
            self.home_plan,
            self.queue,
            chunk_optimizer,
            owner,
            self.config,
            self.laid_out_by if not first else "",
        )
        if self.activations is not None:
            # A re-cut plan holds this optimizer's per-tensor states, which the
            # host room of saved activations leaves out (nothing is saved now).
            self.activations.set_allowance(
                activation_host_room(self.chunks.plan, self.manager.host_account.reserved)
            )
        self.pipeline.optimizer = ref

    def note_loss_scaled(self) -> None:
        """The loss of the coming backward was multiplied by the fp16 loss scale."""
        self.pipeline.note_loss_scaled()

    # --- delegated to the components --------------------------------------------------
    def optimizer_step(self, hyper_by_index: Mapping[int, object], stepper: object) -> bool:
        """Update every parameter that has a gradient; False if fp16 overflow skipped it.
        ``stepper``: the optimizer stepping (refused where only the last one may)."""
        self._check_stepper(stepper, len(hyper_by_index))
        self.collectives.align("optimizer.step()")
        return self.pipeline.step(hyper_by_index)

    def _check_stepper(self, stepper: object, count: int) -> None:
        """Refuse a step by another optimizer than the one constructed over this model
        last, where one step must see all its parameters: overlap_optimizer (the early
        updates, during backward, use that optimizer's groups and consume the gradients
        of whole chunks) and fp16 (one overflow check and scale update a step).
        Optimizers over parts of a model are otherwise fine: each steps its tensors."""
        why = (
            "Config(overlap_optimizer=True) (the updates run during backward)"
            if self.overlap
            else "fp16 loss scaling (one overflow check and scale update a step)"
            if self.scaler is not None
            else None
        )
        last = self.pipeline.optimizer() if self.pipeline.optimizer is not None else None
        if why is None or last is None or last is stepper:
            return
        held = len(last.offloaded_hyper().get(self, {}))
        raise RuntimeError(
            f"this {type(stepper).__name__} (over {count} of the offloaded model's "
            f"parameters) cannot step it: with {why} the model is stepped by one "
            f"optimizer, the one constructed over it last ({type(last).__name__} over "
            f"{held}). Give each set of hyper-parameters a param group of one optimizer "
            "(CPUAdam([{'params': a, 'lr': 1e-3}, {'params': b, 'lr': 1e-2}])), or stop "
            "stepping the optimizer it replaced"
        )

    def read_moments(self, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
        """Copies of the moments of the tensors ``indices`` stepped at least once."""
        self.queue.settle()
        return read_moments(self.chunks, indices)

    def check_moments(self, values: dict[int, MomentState | None]) -> None:
        """Raise (changing nothing) if a state does not fit its tensor."""
        check_moments(self.chunks, values)

    def write_moments(self, values: dict[int, MomentState | None]) -> None:
        """Set moments and step counts by tensor index (``None``: never stepped)."""
        self.queue.settle()
        write_moments(self.chunks, values)

    def synchronize(self) -> None:
        """Finish queued updates and wait for every transfer in flight."""
        self.queue.synchronize()

    # --- forward -----------------------------------------------------------------------
    def begin_module(self, module: nn.Module) -> None:
        """A module's forward starts: make its parameters' chunks resident and bind views."""
        chunks = self.chunks
        chunks.require_set(self.registry.owners[module], "forward")
        by_chunk = self.layout.group_by_chunk(self.registry.owners[module], tensor_index)
        recomputing = torch._C._current_graph_task_id() != -1
        for chunk, entries in by_chunk.items():
            self.fetcher.access(Phase.FORWARD, chunk)
            alias = self.manager.param_alias(chunk)
            for entry in entries:
                entry.param.data = chunks.chunk_view(alias, entry)
                if recomputing:
                    self._stand_in(module, entry)
                chunks.set_state(entry, _S.COMPUTE)
            chunks.sample(Phase.FORWARD, chunk)
        self.fetcher.prefetch()

    def _stand_in(self, module: nn.Module, entry: ParamEntry) -> None:
        """For a recomputation in backward, the module computes with a view of the
        bound parameter (its ``_parameters`` entry, until end_module).

        NOTE: activation checkpointing recomputes a block's forward inside backward
        and keeps what the recomputed ops save until the block's backward nodes
        run. torch.utils.checkpoint keeps a tensor that does not require grad as
        itself, and under use_reentrant=True any saved parameter is the Parameter
        object: end_module pointing it back at its placeholder (NaN) would hand
        NaN to those nodes. An autograd view taken while the parameter is bound
        keeps the slot's bytes for exactly as long as autograd holds it, and its
        gradient still flows to the Parameter (and the engine's hooks).
        """
        for name, param in module._parameters.items():
            if param is entry.param:
                module._parameters[name] = param.view(param.shape)  # type: ignore[assignment]
                self._stand_ins.setdefault(module, []).append((name, param))

    def end_module(self, module: nn.Module) -> None:
        """A module's forward ended: drop the views; the chunks become evictable."""
        chunks = self.chunks
        for name, param in self._stand_ins.pop(module, ()):
            module._parameters[name] = param
        for entry in self.registry.owners[module]:
            chunks.release(entry)
            if chunks.state_of(entry) != _S.COMPUTE:
                continue  # the forward failed before this parameter was bound
            after_grad = chunks.has_grad[entry.index] and self.sink.running
            chunks.set_state(entry, _S.HOLD_AFTER_BWD if after_grad else _S.HOLD_AFTER_FWD)

    def begin_forward(self, shape: tuple[int, int] | None = None) -> None:
        """The root module's forward starts: check the model and that what the forward
        will save fits (``shape``: its batch and sequence), start a new iteration."""
        self.lay_out("the first forward")
        self.manager.failures.check()
        self.queue.check_failed()
        training = torch.is_grad_enabled()
        check_model(self.registry, self.dtype, self.device, self._param_count, training)
        self.collectives.align("a training forward" if training else "a forward without gradients")
        blocks = self.config.activation_blocks
        if training and check_late_checkpointing(self.registry, self.plan, blocks):
            self.manager.device.lend_larger = False  # as a plan made with the blocks has it
        if self.sink.running and torch._C._current_graph_task_id() == -1:
            # A backward that never finished (interrupted, or an exception inside
            # it): its end-of-backward callback will not come, so settle it now.
            self.sink.end_backward()
        self.activation_policy.begin_forward(shape, new_iteration=not self.sink.running)
        self.pipeline.step_timer.begin_span()
        if not self.sink.running:
            self.fetcher.start_iteration()
            self.chunks.timeline.finish_iteration()
            for counters in self.chunks.states:
                counters.reset_step()

    def end_forward(self) -> None:
        """The root module's forward ended: backward's first activations start loading."""
        if self.laid_out:  # not when the lay-out itself failed at begin_forward
            self.activation_policy.end_forward()

    # --- saved tensors -----------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a view of a parameter chunk becomes a handle, any
        other tensor goes to the activation policy."""
        handle = self.pack_weight(tensor)
        return self.activation_policy.pack(tensor) if handle is None else handle

    def pack_weight(self, tensor: torch.Tensor) -> tuple | None:
        """The handle :meth:`unpack` rebuilds a view of a parameter chunk from; None
        for a tensor that is not one (also the pack hook of modules called outside a
        forward: NOTE [modules called on their own])."""
        storage = tensor.untyped_storage().data_ptr()
        key = cast("tuple[object, int] | None", self.manager.device.key_at(storage))
        if key is None and storage in PLACEHOLDER_STORAGES:
            raise RuntimeError(placeholder_used(self.registry, tensor))
        if key is None or key[0] is not Kind.PARAM:
            return None
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
        if isinstance(packed, SavedActivation):
            assert self.activations is not None
            self.sink.note_backward()
            return self.activations.unpack(packed)
        if not isinstance(packed, tuple):
            return packed
        chunk, shape, stride, offset, dtype = packed
        self.sink.note_backward()
        self.fetcher.access(Phase.BACKWARD, chunk)
        alias = self.manager.param_alias(chunk)
        self.chunks.sample(Phase.BACKWARD, chunk)
        self.fetcher.prefetch()
        return torch.as_strided(alias.view(dtype), shape, stride, offset)

    def close(self) -> None:
        """Wait for transfers, release threads and remove the swap file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self.laid_out:
            self._release()  # nothing was allocated but the backend (and a failed lay-out's)
            return
        failures = self.manager.failures
        try:
            if failures.first is None and self.queue.failure is None:
                self.synchronize()  # queued updates run, every transfer lands (errors raise)
        finally:
            try:
                self.queue.close()  # NOTE: the worker's updates end before their bytes go
            finally:
                try:
                    close_activation_store(self.activations)
                finally:
                    self._release()
        # After the cleanup: an I/O error nobody was told about yet is raised.
        failures.raise_unreported()
