"""What an optimizer keeps per chunk and per tensor, for the planner and re-cut plans.

:func:`tensor_state_bytes`: the host bytes of an optimizer's per-tensor states
(Adafactor's factors), which every plan reserves in the host budget.
:func:`units_for`, pure: the plan of an offloaded model, made for one optimizer (the
first constructed over it, or Adam: NOTE [the layout is decided once, late]), with
every unit sized for another :class:`~infinity.optim.chunk_optimizer.ChunkOptimizer`.
Homes, staging slots and the layout stay; only what a unit holds (and so what each
step moves) changes. Used by ``runtime/budgets.py`` for an optimizer
constructed after the homes were laid out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from infinity.core.names import HOST
from infinity.core.plan import FP32_BYTES, ChunkLayout, Plan, PlanError
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.schedule.traffic import estimate_traffic
from infinity.utils.sizes import format_size


def tensor_state_bytes(layout: ChunkLayout, optimizer: ChunkOptimizer[Any]) -> int:
    """Host bytes of ``optimizer``'s per-tensor states (fp32) for every trainable tensor
    of ``layout``: Adafactor's row and column factors; 0 for the others.

    They live in host memory beside the units, whatever the homes, and a
    sharded rank keeps them whole (``runtime/offloaded_step.py``): so they are
    a fixed host cost, not divided by the shard count. See
    NOTE [per-tensor optimizer state].
    """
    return FP32_BYTES * sum(
        math.prod(shape)
        for slot in layout.slots
        if layout.chunks[slot.chunk].trainable
        for shape in optimizer.tensor_state_shapes(tuple(slot.shape)).values()
    )


def units_for(
    home_plan: Plan,
    optimizer: ChunkOptimizer[Any],
    *,
    consume_grads: bool,
    planned_for: ChunkOptimizer[Any] | None = None,
) -> Plan:
    """``home_plan`` with each chunk's optimizer unit cut for ``optimizer`` (its state
    slots in the plan's state format) and the traffic estimated again.

    Raises ``ValueError`` naming the chunk if a unit would not fit the home the
    plan gave it (an optimizer with more state than ``planned_for``, the one the
    homes were planned for: Adam's when not given), and :class:`PlanError` if the
    optimizer's per-tensor states do not fit the host budget beside the homes and
    staging kept.
    """
    if optimizer.state_format.name != home_plan.state_dtype:
        raise AssertionError(
            f"units stored as {optimizer.state_format.name!r} cannot replace the plan's "
            f"{home_plan.state_dtype!r} ones (the layout aligns tensors for its format)"
        )
    sizes = []
    for i, home in enumerate(home_plan.optim_home):
        size = optimizer.unit_bytes(home_plan.home_elems(i), home_plan.has_master)
        if home is not None and size > home_plan.optim_bytes(i):
            raise ValueError(_too_large(optimizer, size, home_plan.optim_bytes(i), i, planned_for))
        sizes.append(size if home is not None else home_plan.optim_bytes(i))
    plan = dataclasses.replace(
        home_plan,
        state_slots=optimizer.state_slots,
        optim_unit_bytes=tuple(sizes),
        tensor_state_bytes=tensor_state_bytes(home_plan.layout, optimizer),
        traffic={},
    )
    if plan.host_bytes > plan.budgets.states_host:
        # The units shrink when re-cut, which almost always leaves room for
        # the per-tensor states; the budget is a promise all the same.
        raise PlanError(
            f"host_memory={format_size(plan.budgets.host)} is too small: "
            f"{optimizer.front_end or optimizer.name}'s per-tensor states "
            f"({format_size(plan.tensor_state_bytes)}) do not fit beside the homes and staging "
            f"planned for {planned_for.front_end or planned_for.name if planned_for else 'Adam'} "
            f"({format_size(plan.home_bytes(HOST) + plan.staging_bytes)}). Raise host_memory to "
            f"at least {plan.budgets.host_for_states(plan.host_bytes)} bytes"
            + (
                f"; or: {_FIRST.format(name=optimizer.front_end or optimizer.name)}"
                if planned_for is not None and planned_for.name != optimizer.name
                else ""
            ),
            needed=plan.budgets.host_for_states(plan.host_bytes),
        )
    object.__setattr__(plan, "traffic", estimate_traffic(plan, consume_grads=consume_grads))
    return plan


# NOTE [the layout is decided once, late]: the way to homes planned for an optimizer.
_FIRST = (
    "Construct {name} first, right after infinity.offload() and before any other optimizer, "
    "forward or read of the model (the homes are then planned for it)"
)


def _too_large(
    optimizer: ChunkOptimizer[Any],
    size: int,
    home: int,
    chunk: int,
    planned_for: ChunkOptimizer[Any] | None,
) -> str:
    """Why ``optimizer``'s unit of ``size`` bytes does not fit chunk ``chunk``'s home."""
    name = optimizer.front_end or optimizer.name
    head = (
        f"{name} needs {format_size(size)} of optimizer state for chunk {chunk}, more than "
        f"the {format_size(home)} "
    )
    if planned_for is None or planned_for.name == "adam":
        return head + (
            "that offload() planned (Adam's: two state slots per parameter); an optimizer "
            "with more state per parameter than Adam cannot run on infinity.offload yet"
        )
    return head + (
        f"its home holds: the homes were planned for {planned_for.front_end or planned_for.name} "
        f"(slots {', '.join(planned_for.state_slots) or 'none'}) before {name} was constructed. "
        f"{_FIRST.format(name=name)}, or raise the budgets"
    )
