"""The fields :class:`~infinity.runtime.engine.OffloadEngine` shares with its mixins.

NOTE: the engine is composed of mixins (gradient events, gradient norms,
optimizer steps) that read and write one set of attributes. This class declares
them, with their types, in one place: ``OffloadEngine.__init__`` sets them, the
mixins derive from this class so the type checker knows what they touch. The
method stubs exist for the type checker only (never at run time, so they can
never shadow a mixin's real method).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from infinity.chunks.layout import ChunkLayout
from infinity.chunks.manager import ChunkManager
from infinity.chunks.states import StateCounters, TensorState
from infinity.core.names import Phase
from infinity.core.plan import Plan
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.optim.hyper import AdamHyperParams
from infinity.optim.loss_scale import LossScaler
from infinity.runtime.offloaded_step import ChunkWork
from infinity.runtime.params import ParamEntry, ParamRegistry
from infinity.runtime.step_timer import StepTimer
from infinity.schedule.trace import TraceRecorder


class EngineFields:
    """Attributes of one offloaded model's engine (see the module note)."""

    dtype: torch.dtype
    registry: ParamRegistry
    plan: Plan
    layout: ChunkLayout
    manager: ChunkManager
    chunk_members: list[list[ParamEntry]]  # per chunk, its parameters
    states: list[StateCounters]  # per chunk, its tensors' states
    has_grad: list[bool]  # per tensor: its gradient is in the chunks
    tensor_steps: list[int]  # per tensor: Adam steps taken
    trace: TraceRecorder
    scaler: LossScaler | None  # fp16 only
    loss_scaled: bool
    step_count: int
    step_timer: StepTimer
    overlap: bool  # Config(overlap_optimizer=True): step chunks during backward
    optimizer: Callable[[], Any] | None  # weak reference to the CPUAdam holding the model
    chunk_optimizer: ChunkOptimizer[Any]  # the per-element optimizer of the chunks
    early_queue: list[ChunkWork]
    early_chunk_steps: int
    trailing: deque[ChunkWork]
    trailing_scale: float
    trailing_chunk_steps: int
    grad_factors: list[float]  # per tensor: the pending clip factor
    _early_hyper: dict[int, AdamHyperParams] | None
    _backward_active: bool
    _norm_cache: dict[float, dict[int, torch.Tensor]]

    if TYPE_CHECKING:

        def access(self, phase: Phase, chunk: int) -> None: ...
        def sample(self, phase: Phase, chunk: int) -> None: ...
        def prefetch(self) -> None: ...
        def set_state(self, entry: ParamEntry, state: TensorState) -> None: ...
        def chunk_view(self, chunk_bytes: torch.Tensor, entry: ParamEntry) -> torch.Tensor: ...
        def settle_step(self) -> None: ...
        def synchronize(self) -> None: ...
        def check_not_stepped_early(self, what: str) -> None: ...
        def collect_zeroed_grads(self) -> None: ...
        def forget_grad_norms(self) -> None: ...
        def apply_grad_factors(self) -> None: ...
        def reset_grad_factors(self, indices: Iterable[int] | None = None) -> None: ...
        def step_grad_factor(self, indices: Iterable[int]) -> float: ...
        def _step_early(self, chunk: int) -> None: ...
