"""The planner: where each kind of state lives, and how many slots each tier gets.

A pure function of the layout and the budgets, run before anything is
allocated: if the budgets cannot hold the model it raises :class:`PlanError`
saying how many bytes each tier needs.

Policy (coldest state leaves first): everything starts on the host; while the
host budget is exceeded, optimizer-state units (fp32 master + moments, touched
once per step) move to NVMe chunk by chunk from the back, then gradients
(written once per micro-batch, read once per step), then parameters (read in
forward and backward). With ``overlap_optimizer`` gradient chunks leave first:
they are used from host staging and never written, so spilling them costs no
disk bytes. The optimizer's per-tensor states (Adafactor's factors) are a fixed
host cost. Room the staging leaves goes to homes (the hottest states back to
the host) before parameter staging deeper than the optimizer pipeline's. The
device tier is a cache of parameter and gradient chunks; room beyond a slot for
every copy homes whole trainable chunks there (NOTE [chunks homed on the device]).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from infinity.chunks.layout import ChunkLayout
from infinity.core.names import DEVICE, HOST, NVME, Tier
from infinity.core.plan import Budgets, Plan, PlanError
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.optim.cpu_adam import ADAM
from infinity.schedule.device_slots import add_device_slots, min_device_slots
from infinity.schedule.traffic import estimate_traffic
from infinity.schedule.units import tensor_state_bytes
from infinity.utils.sizes import format_size

# Host staging slots: optimizer pipeline = read i+1, compute i, write back i-1.
OPTIM_PIPELINE_SLOTS = 3
GRAD_STAGING_SLOTS = 4
# Parameter staging kept where parameters live on NVMe before host room goes to
# homes: the update pipeline's slots (a step reads or writes each parameter chunk
# through them) and one for a forward or backward fetch in flight beside it.
# With three, a tiny GPT's measured NVMe reads of a step (non-overlapped,
# tests/engine/test_plan_estimate.py's case) ranged from 0.96x to 1.35x the
# plan's estimate; with four, as with six, 0.94x to 1.15x on the same loaded
# machine.
MIN_PARAM_STAGING = OPTIM_PIPELINE_SLOTS + 1


def make_plan(
    layout: ChunkLayout,
    *,
    element_size: int,
    has_master: bool,
    budgets: Budgets,
    working_sets: Sequence[frozenset[int]],
    prefetch_depth: int,
    consume_grads: bool = False,
    optimizer: ChunkOptimizer = ADAM,
    shard_count: int = 1,
    shard_rank: int = 0,
    state_device: torch.device | None = None,
) -> Plan:
    """Place every chunk's kinds on host or NVMe and size the slot pools.

    ``state_device``: the compute device, where the optimizer can step chunks (None:
    nowhere but the host); device room beyond a slot for every chunk copy then homes
    whole trainable chunks there (NOTE [chunks homed on the device]).

    Sharded (``shard_count > 1``, data parallel): homes and staging hold this
    rank's shard of each chunk (capacities are multiples of ``shard_count``
    span granules, see ``runtime/budgets.py``), the device whole chunks; shards
    are staged whole (never in spans).

    An optimizer unit holds ``optimizer.unit_bytes(capacity, has_master)`` bytes
    (an fp32 master if any, then the state slots in the optimizer's state format).
    Oversize chunks are staged in spans of the normal chunk size
    (``chunks/pools.py``), so host staging is bounded by the chunk size whatever
    the largest tensor is; whole, if the host affords it at no extra NVMe bytes.

    Raises :class:`PlanError` (before anything is allocated) when a budget is
    too small, naming the bytes each tier would need.
    """
    kwargs = {
        "element_size": element_size,
        "has_master": has_master,
        "budgets": budgets,
        "working_sets": working_sets,
        "prefetch_depth": prefetch_depth,
        "consume_grads": consume_grads,
        "optimizer": optimizer,
        "shard_count": shard_count,
        "shard_rank": shard_rank,
        "state_device": state_device if shard_count == 1 else None,
    }
    largest = max((c.capacity for c in layout.chunks), default=layout.chunk_elems)
    if shard_count > 1:
        # Spans of a shard would need a second window inside the shard's;
        # a shard is already 1/N of the chunk, so it is staged whole.
        return _place(layout, span_elems=largest // shard_count, **kwargs)  # type: ignore[arg-type]
    plan = _place(layout, span_elems=span_of(layout, optimizer), **kwargs)  # type: ignore[arg-type]
    if largest > plan.span_elems:
        try:
            whole = _place(layout, span_elems=largest, **kwargs)  # type: ignore[arg-type]
        except PlanError:
            pass
        else:
            # NOTE: whole slots move an oversize chunk in fewer, larger transfers,
            # but they take host room that would otherwise keep states at home:
            # GPT-2's 147 MiB embedding staged whole on a 1 GiB host sent every
            # state to NVMe (2.0 GB read per step against 1.3 GB in spans). Whole
            # slots are taken only when they cost no extra disk bytes.
            if _nvme_bytes(whole) <= _nvme_bytes(plan):
                plan = whole
    if budgets.nvme is not None:
        object.__setattr__(plan, "min_host_bytes", _minimum_host(layout, kwargs))
    return plan


def _nvme_bytes(plan: Plan) -> int:
    """Bytes read from and written to NVMe per step, as the plan estimates them."""
    return plan.traffic["nvme_read_bytes"] + plan.traffic["nvme_write_bytes"]


def span_of(layout: ChunkLayout, optimizer: ChunkOptimizer) -> int:
    """Elements of a span of an oversize chunk: the normal chunk size, rounded up to
    the optimizer's span granule (so every piece of a span stays I/O-aligned, and
    no normal chunk is ever split).

    NOTE: a normal chunk smaller than the granule (int8 states: 262144 elements)
    leaves oversize capacities unpadded (``build_layout``), so they cannot be cut
    on aligned boundaries: they are staged whole.
    """
    granule = optimizer.span_granule
    if layout.chunk_elems < granule:
        return max(c.capacity for c in layout.chunks)
    return -(-layout.chunk_elems // granule) * granule


def _minimum_host(layout: ChunkLayout, kwargs: dict[str, object]) -> int:
    """The smallest host budget this layout plans with: every state on NVMe, the
    shallowest staging, oversize chunks in spans."""
    budgets = kwargs["budgets"]
    assert isinstance(budgets, Budgets)
    bare = dict(kwargs, budgets=Budgets(device=budgets.device, host=0, nvme=1 << 62))
    try:
        span = span_of(layout, bare["optimizer"])  # type: ignore[arg-type]
        _place(layout, span_elems=span, **bare)  # type: ignore[arg-type]
    except PlanError as exc:
        return budgets.host_for_states(exc.needed)
    return 0


def _place(
    layout: ChunkLayout,
    *,
    span_elems: int,
    element_size: int,
    has_master: bool,
    budgets: Budgets,
    working_sets: Sequence[frozenset[int]],
    prefetch_depth: int,
    consume_grads: bool,
    optimizer: ChunkOptimizer,
    shard_count: int = 1,
    shard_rank: int = 0,
    state_device: torch.device | None = None,
) -> Plan:
    """:func:`make_plan` with staging slots of at most ``span_elems`` elements."""
    chunks = layout.chunks
    n = len(chunks)
    # Homes and staging hold this rank's shard; the device whole chunks.
    pbytes = [c.capacity // shard_count * element_size for c in chunks]
    obytes = [optimizer.unit_bytes(c.capacity // shard_count, has_master) for c in chunks]

    # Device: the minimum working set, then as many more slots as fit.
    sharded = shard_count > 1
    device = min_device_slots(layout, element_size, working_sets, 2 if sharded else 1)
    device_need = sum(s * c for s, c in device.items())
    largest_slot = max(device, default=0)
    minimum_large = device.get(largest_slot, 0)
    if device_need > budgets.device:
        largest = max(c.capacity for c in chunks) * element_size
        raise PlanError(
            f"device_memory={format_size(budgets.device)} is too small: one module (or a block "
            f"recomputed in backward) needs {format_size(device_need)} of chunk memory at once "
            "(its parameters' chunks plus "
            + (
                "two gradient chunks, which a sharded model keeps on the device until complete"
                if sharded
                else "a gradient chunk"
            )
            + f"; the largest tensor's chunk, {format_size(largest)}, must be whole "
            f"on the device). Raise device_memory to at least {device_need} bytes or use a "
            "smaller chunk_size.",
            needed=device_need,
        )
    trainable = [c.trainable for c in chunks]
    whole = [c.capacity * element_size for c in chunks]
    minimum = dict(device)
    device = add_device_slots(device, whole, trainable, budgets.device - device_need)

    param_home = [HOST] * n
    grad_home: list[Tier | None] = [HOST if t else None for t in trainable]
    optim_home: list[Tier | None] = [HOST if t else None for t in trainable]
    scratch = 0
    if state_device is not None:
        # NOTE [chunks homed on the device]: room beyond a slot for every chunk copy
        # would sit idle; a trainable chunk homed there (parameters, gradients and
        # optimizer unit) never crosses the link and is stepped on the device, with
        # its update's temporaries inside the budget too.
        # A chunk homed there needs no cache slots beyond the working set's: its two
        # copies' (parameter, gradient) go to the homes too, so each costs its
        # optimizer unit more than caching it did.
        scratch = optimizer.device_step_scratch(layout.chunk_elems, state_device)
        room = budgets.device - sum(size * count for size, count in device.items()) - scratch
        every_copy = add_device_slots(minimum, whole, trainable, budgets.device << 1)
        extra = Counter({size: device[size] - minimum.get(size, 0) for size in device})
        for i in reversed(range(n) if device == every_copy else ()):
            freed = min(2, extra[whole[i]])
            cost = 2 * pbytes[i] + obytes[i] - freed * whole[i]
            if trainable[i] and obytes[i] and cost <= room:
                param_home[i] = grad_home[i] = optim_home[i] = DEVICE
                extra[whole[i]] -= freed
                device[whole[i]] -= freed
                room -= cost
        if DEVICE not in optim_home:
            scratch = 0
    staging: dict[str, Counter[int]] = {"param": Counter(), "grad": Counter(), "optim": Counter()}
    # Oversize chunks go through host staging in spans of the normal chunk
    # size (chunks/pools.py), so no staging slot is ever larger than that.
    normal = {
        "param": span_elems * element_size,
        "grad": span_elems * element_size,
        "optim": optimizer.unit_bytes(span_elems, has_master),
    }
    # (gradients homed on the device are added there, never staged)
    trainable_bytes = [pbytes[i] for i in range(n) if trainable[i] and grad_home[i] != DEVICE]
    if trainable_bytes:
        staging["grad"][min(max(trainable_bytes), normal["grad"])] = GRAD_STAGING_SLOTS

    # The optimizer's per-tensor states stay on the host whatever the homes.
    per_tensor = tensor_state_bytes(layout, optimizer)

    def host_need() -> int:
        homes = sum(pbytes[i] for i in range(n) if param_home[i] == HOST)
        homes += sum(pbytes[i] for i in range(n) if grad_home[i] == HOST)
        homes += sum(obytes[i] for i in range(n) if optim_home[i] == HOST)
        return per_tensor + homes + sum(s * c for pool in staging.values() for s, c in pool.items())

    def add_staging(kind: str, size: int, count: int) -> None:
        # A chunk fits any larger slot, so one set of slots of the largest
        # size a kind needs serves all its chunks (oversize ones in spans).
        pool = staging[kind]
        largest = max([min(size, normal[kind]), *pool])
        pool.clear()
        pool[largest] = count

    # Move the coldest state to NVMe, chunk by chunk from the back, until it fits.
    # Order: optimizer units, then gradients, then parameters.
    # Overlapped, a gradient chunk homed on NVMe is used from host staging
    # by its update and never goes to disk (unless it moves in spans, see
    # chunks/pools.is_split): spilling it costs no bytes, an optimizer unit
    # costs a read and a write per step. So those gradients leave first, and
    # the host keeps optimizer units instead.
    free: list[tuple[str, int]] = []
    paid: list[tuple[str, int]] = []
    for i in reversed(range(n)):
        if trainable[i]:
            consumed = consume_grads and pbytes[i] <= normal["grad"]
            (free if consumed else paid).append(("grad", i))
    # An empty unit (fp32 Adafactor: its factors are per tensor) frees nothing.
    units = [("optim", i) for i in reversed(range(n)) if trainable[i] and obytes[i]]
    moves = free + units + paid
    moves += [("param", i) for i in reversed(range(n))]
    param_slots = max(prefetch_depth + 2, OPTIM_PIPELINE_SLOTS)
    on_device = {i for i in range(n) if param_home[i] == DEVICE}
    moves = [(kind, i) for kind, i in moves if i not in on_device]
    for kind, i in moves:
        if host_need() <= budgets.states_host or budgets.nvme is None:
            break
        if kind == "optim":
            optim_home[i] = NVME
            add_staging("optim", obytes[i], min(OPTIM_PIPELINE_SLOTS, sum(trainable)))
            if not has_master:
                # fp32: the parameter chunk is the master; the step stages it too.
                add_staging("param", pbytes[i], min(OPTIM_PIPELINE_SLOTS, n))
        elif kind == "grad":
            grad_home[i] = NVME
        else:
            param_home[i] = NVME
            add_staging("param", pbytes[i], min(param_slots, n))

    # Still too big: run the pipelines shallower (fewer staging slots) before
    # giving up; depth buys overlap, not correctness.
    for kind in ("param", "optim", "grad", "param", "optim"):
        if host_need() <= budgets.states_host:
            break
        for size, count in staging[kind].items():
            staging[kind][size] = max(1, count - 1 if kind != "param" else count // 2)

    # With states on NVMe their bytes bound the step, and a home on the host
    # saves two or three transfers of its bytes per step where a staging slot
    # beyond the pipelines' only lets a read start earlier. So the room goes to
    # homes first: parameter staging is cut to MIN_PARAM_STAGING before the
    # hottest states come back, and what is left after them buys the depth
    # back. Lion's units, half of Adam's, had freed room that went to six
    # parameter slots instead of more homes.
    deep = Counter(staging["param"])
    for size, count in staging["param"].items():
        staging["param"][size] = min(count, MIN_PARAM_STAGING)
    # Shallower staging may have freed room: bring the hottest states back.
    homes: dict[str, list[Tier] | list[Tier | None]] = {
        "optim": optim_home,
        "grad": grad_home,
        "param": param_home,
    }
    for kind, i in reversed(moves):
        if homes[kind][i] != NVME:
            continue
        homes[kind][i] = HOST
        if host_need() > budgets.states_host:
            homes[kind][i] = NVME
    if NVME in param_home:
        for size, count in deep.items():
            while staging["param"][size] < count:
                staging["param"][size] += 1
                if host_need() > budgets.states_host:
                    staging["param"][size] -= 1
                    break

    need = host_need()
    if need > budgets.states_host:
        beside = (
            f" beside the {budgets.activations:.0%} kept for saved activations"
            if budgets.activations
            else ""
        )
        if budgets.nvme is None:
            raise PlanError(
                f"host_memory={format_size(budgets.host)} is too small: the model's states need "
                f"{format_size(need)} on the host{beside}. Raise host_memory to at least "
                f"{budgets.host_for_states(need)} bytes, or set nvme_path to a directory on a "
                "fast disk so states can spill to NVMe.",
                needed=budgets.host_for_states(need),
            )
        factors = (
            f" and the optimizer's per-tensor states ({format_size(per_tensor)})"
            if per_tensor
            else ""
        )
        raise PlanError(
            f"host_memory={format_size(budgets.host)} is too small even with every state on "
            f"NVMe: staging buffers{factors} alone need {format_size(need)}{beside}. Raise "
            f"host_memory to at least {budgets.host_for_states(need)} bytes, or use a smaller "
            "chunk_size.",
            needed=budgets.host_for_states(need),
        )
    plan = Plan(
        layout=layout,
        element_size=element_size,
        has_master=has_master,
        state_slots=optimizer.state_slots,
        optim_unit_bytes=tuple(obytes),
        state_dtype=optimizer.state_format.name,
        param_home=tuple(param_home),
        grad_home=tuple(grad_home),
        optim_home=tuple(optim_home),
        device_slots={s: c for s, c in device.items() if c},
        host_staging={k: {s: c for s, c in v.items() if c} for k, v in staging.items()},
        budgets=budgets,
        span_elems=span_elems,
        shard_count=shard_count,
        shard_rank=shard_rank,
        spare_device_slots=device.get(largest_slot, 0) - minimum_large,
        min_device_bytes=device_need,
        tensor_state_bytes=per_tensor,
        device_scratch_bytes=scratch,
    )
    if budgets.nvme is not None and plan.nvme_bytes > budgets.nvme:
        raise PlanError(
            f"nvme_memory={format_size(budgets.nvme)} is too small: {format_size(plan.nvme_bytes)} "
            "of states must spill to NVMe with this host budget. Free disk space, raise "
            "nvme_memory, or raise host_memory."
        )
    object.__setattr__(plan, "traffic", estimate_traffic(plan, consume_grads=consume_grads))
    return plan
