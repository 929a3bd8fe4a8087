"""A plan's optimizer units re-cut for another optimizer, inside the same homes.

Pure: the plan of an offloaded model, made before its optimizer was known
(NOTE [units planned for Adam], ``runtime/engine.py``), with every unit sized
for another :class:`~infinity.optim.chunk_optimizer.ChunkOptimizer`. Homes,
staging slots and the layout stay; only what a unit holds (and so what each
step moves) changes. Used by ``runtime/optimizer_binding.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from infinity.core.plan import Plan
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.schedule.traffic import estimate_traffic
from infinity.utils.sizes import format_size


def units_for(home_plan: Plan, optimizer: ChunkOptimizer[Any], *, consume_grads: bool) -> Plan:
    """``home_plan`` with each chunk's optimizer unit cut for ``optimizer`` (its state
    slots in the plan's state format) and the traffic estimated again.

    Raises ``ValueError`` naming the chunk if a unit would not fit the home the
    plan gave it (an optimizer with more state than the one planned for).
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
            planned = format_size(home_plan.optim_bytes(i))
            raise ValueError(
                f"{optimizer.front_end or optimizer.name} needs {format_size(size)} of "
                f"optimizer state for chunk {i}, more than the {planned} "
                "that offload() planned (Adam's: two state slots per parameter); an optimizer "
                "with more state per parameter than Adam cannot run on infinity.offload yet"
            )
        sizes.append(size if home is not None else home_plan.optim_bytes(i))
    plan = dataclasses.replace(
        home_plan, state_slots=optimizer.state_slots, optim_unit_bytes=tuple(sizes), traffic={}
    )
    object.__setattr__(plan, "traffic", estimate_traffic(plan, consume_grads=consume_grads))
    return plan
