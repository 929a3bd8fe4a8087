"""Every byte of a step, per tier: the named lines each budget is divided into, their
measured peaks, and the forecast of the step's peak.

A budget is divided into lines, each with its limit (what it may hold) and its measured
peak: on the host the chunks' homes and staging (and the optimizer's per-tensor states),
the saved activations' host share and the two windows that move them to NVMe and back;
on the device the chunks' slots. What no budget can hold is the step's working set:
what autograd saves and computes on the device beyond the parameters (intermediates,
the loss's logits and their gradient, a gradient before it lands in its chunk). It is
forecast from a forward, loss and backward on fake tensors
(:func:`infinity.activations.estimate.step_memory`), and measured where the device has an
allocator that counts (CUDA, the fence). On CUDA the device also holds the math
libraries' workspaces, measured (:func:`probe_libraries`). The forecast of the
process's resident set adds the baseline it had when the model was offloaded (the
interpreter, the libraries, the model's own weights if it was built in RAM).

The chunks' counters for ``infinity.stats`` (:func:`tier_stats`: sizes, budgets,
reserved and peak bytes per tier, homes per kind, and the traffic so far) are read
from the plan and the chunk manager's exact accounting, so that
``infinity/stats.py`` reaches neither.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinity.activations.estimate import StepFn, StepMemory, step_memory
from infinity.chunks.grad_flow import grad_norm_bytes
from infinity.chunks.updates import transient_limit
from infinity.core.names import DEVICE, HOST, NVME
from infinity.runtime.model_chunks import ModelChunks
from infinity.utils.process_memory import (
    device_block_bytes,
    device_bytes,
    device_peak_bytes,
    resident_bytes,
    resident_peak_bytes,
)
from infinity.utils.sizes import format_size

if TYPE_CHECKING:
    from infinity.runtime.engine import OffloadEngine


def probe_libraries(device: torch.device, dtypes: Iterable[torch.dtype]) -> tuple[int, int]:
    """(device bytes, host bytes) the math libraries add when a step's matmuls first run:
    the growth of CUDA's allocated bytes and of the resident set over a tiny matmul
    forward, recomputation and backward in each of ``dtypes``; (0, 0) where they were
    loaded already, and on any other device (nothing is run there).

    cuBLAS and cuBLASLt take a workspace from torch's caching allocator per
    (handle, stream), and a handle per thread: the forward's matmuls make one on the
    loop's thread, the first backward another on autograd's device thread. They stay
    allocated, so the step's peak holds them, above what was allocated before it, as
    long as they were not made yet. Their size depends on the torch build, the GPU and
    ``CUBLAS_WORKSPACE_CONFIG`` (32 MiB each at ``:4096:8``), so it is measured, on
    the threads and stream the step uses, not guessed. CUDA also loads the libraries'
    kernels into host memory when first used (an H200's main job grew its resident
    set by ~650 MB after ``offload``): what the matmuls load is measured here; other
    kernels' modules are not."""
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)
    before, rss = torch.cuda.memory_allocated(device), resident_bytes()
    with torch.cuda.device(device), torch.inference_mode(False), torch.enable_grad():
        for dtype in dict.fromkeys(dtypes):
            _matmul_step(device, dtype)
    torch.cuda.synchronize(device)
    grown = max(0, resident_bytes() - rss)
    return max(0, torch.cuda.memory_allocated(device) - before), grown


def _matmul_step(device: torch.device, dtype: torch.dtype) -> None:
    """A (8, 8) linear layer with a bias (addmm: cuBLASLt where torch uses it) and a
    batched matmul (cuBLAS), forward on this thread, then recomputed (as a checkpointed
    block is) and differentiated on autograd's; every tensor it makes is freed on return.

    NOTE: the recomputation is what a lent H200 showed missing: a checkpointed block's
    forward runs on autograd's thread, whose first cuBLASLt call takes a workspace of
    its own (1 MiB there), which a plain backward never asks for."""
    x, w, b = (
        torch.ones(shape, dtype=dtype, device=device, requires_grad=True)
        for shape in ((8, 8), (8, 8), (8,))
    )

    def block(t: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(t, w, b)
        return torch.bmm(y.unsqueeze(0), w.unsqueeze(0))

    z = checkpoint(block, x, use_reentrant=False)
    torch.autograd.grad(z.sum(), (x, w, b))


@dataclass(frozen=True)
class MemoryForecast:
    """The step's peak per tier: each budget's lines at their limits, plus the working set
    no budget holds, plus (on the host) the baseline.

    ``device_in_host``: the device is host memory (the CPU backend), so its bytes and
    the working set are in the resident set too.
    """

    device_lines: int  # the chunks' device slots
    host_lines: int  # every host line's limit
    working_set: StepMemory
    resident: int  # the model's buffers on the device (not chunks)
    baseline: int  # resident set when the model was offloaded
    device_in_host: bool
    tokens: int
    # Host bytes outside the lines: a saved tensor read from NVMe on demand lands in a
    # host buffer before its copy to the device (the largest moved one), and the
    # whole-chunk or whole-tensor copies of transient_limit.
    host_transients: int = 0
    # Device bytes the math libraries' workspaces add when the step's matmuls first run
    # (CUDA; 0 elsewhere, or where they exist already): see library_workspaces.
    library_workspaces: int = 0
    # Host bytes the math libraries load when the step's matmuls first run (CUDA).
    library_host: int = 0
    # Device bytes of the gradient norms taken at the flushes when gradients are clipped
    # (NOTE [gradient norms on the device]): see grad_norm_bytes.
    grad_norms: int = 0

    @property
    def device_peak(self) -> int:
        """Bytes on the device at the step's peak: slots, buffers, working set, the
        libraries' workspaces the step makes and the gradient norms."""
        return (
            self.device_lines
            + self.resident
            + self.working_set.peak
            + self.library_workspaces
            + self.grad_norms
        )

    @property
    def resident_peak(self) -> int:
        """The process's resident set at the step's peak."""
        return (
            self.baseline
            + self.host_lines
            + self.host_transients
            + self.library_host
            + (self.device_peak if self.device_in_host else 0)
        )

    def describe(self) -> list[str]:
        """Lines for a run's header or ``infinity plan``."""
        work = self.working_set
        where = "host memory (the device is RAM)" if self.device_in_host else "the device"
        return [
            f"step working set at {self.tokens} tokens: {format_size(work.peak)} on {where} "
            f"(saved for backward {format_size(work.saved)}, the loss "
            f"{format_size(work.loss)}, the rest transient); no budget holds it",
            f"forecast peak: device {format_size(self.device_peak)} = slots "
            f"{format_size(self.device_lines)} + buffers {format_size(self.resident)} + working "
            "set"
            + (
                f" + library workspaces {format_size(self.library_workspaces)}"
                if self.library_workspaces
                else ""
            )
            + f"; resident set {format_size(self.resident_peak)} = baseline "
            f"{format_size(self.baseline)} + host lines {format_size(self.host_lines)}"
            + (
                f" + transient copies {format_size(self.host_transients)}"
                if self.host_transients
                else ""
            )
            + (f" + libraries loaded {format_size(self.library_host)}" if self.library_host else "")
            + (" + the device's" if self.device_in_host else ""),
        ]

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers (for stats and JSON reports)."""
        return {
            **{k: v for k, v in asdict(self).items() if k != "working_set"},
            "working_set": {**asdict(self.working_set), "transient": self.working_set.transient},
            "device_peak": self.device_peak,
            "resident_peak": self.resident_peak,
        }


def host_lines(engine: OffloadEngine) -> dict[str, dict[str, int]]:
    """Each host line's limit and measured peak (bytes)."""
    chunks = engine.chunks
    account = chunks.manager.host_account
    lines = {
        "chunk homes and staging": {"limit": account.reserved, "peak": account.peak},
    }
    if engine.plan.tensor_state_bytes:
        size = engine.plan.tensor_state_bytes
        lines["optimizer per-tensor states"] = {"limit": size, "peak": size}
    store = engine.activations
    if store is not None:
        c = store.counters
        lines["activations: host share"] = {
            "limit": store.host_capacity,
            "peak": int(c["host_peak_bytes"]),
        }
        lines["activations: read window"] = {
            "limit": store.read_ahead,
            "peak": int(c["read_peak_bytes"]),
        }
        lines["activations: write window"] = {
            "limit": store.write_window,
            "peak": int(c["write_peak_bytes"]),
        }
    return lines


def device_lines(engine: OffloadEngine) -> dict[str, dict[str, int]]:
    """Each device line's limit and measured peak (bytes)."""
    manager = engine.chunks.manager
    account = manager.device_account
    arena = manager.homes.device_arena
    homed = arena.reserved_bytes if arena is not None else 0
    lines = {"chunk slots": {"limit": account.reserved - homed, "peak": account.peak - homed}}
    if homed:  # NOTE [chunks homed on the device]
        lines["chunks homed on the device"] = {"limit": homed, "peak": homed}
        scratch = engine.plan.device_scratch_bytes
        if scratch:  # the temporaries of an update on the device (not measured apart)
            lines["device update scratch"] = {"limit": scratch, "peak": scratch}
    return lines


def memory_stats(engine: OffloadEngine) -> dict[str, Any]:
    """``infinity.stats(model)["memory"]``: per tier its budget, its lines (limit and
    peak), what the allocator or the resident set measured, and the forecast if one was
    made (:func:`forecast`)."""
    plan = engine.plan
    host = host_lines(engine)
    store = engine.activations
    out: dict[str, Any] = {
        "host": {
            "budget_bytes": plan.budgets.host,
            "lines": host,
            "lines_peak_bytes": sum(line["peak"] for line in host.values()),
            "baseline_bytes": engine.baseline_rss,
            # outside the host budget, transient: see transient_limit
            "transient_copies": {
                "limit": transient_limit(plan, engine.chunk_optimizer.whole_tensors),
                "peak": engine.chunks.manager.transient_account.peak,
            },
            "resident_peak_bytes": resident_peak_bytes(),
        },
        "device": {
            "budget_bytes": plan.budgets.device,
            "lines": device_lines(engine),
            "allocated_peak_bytes": device_peak_bytes(engine.device),
        },
        "forecast": None if engine.forecast is None else engine.forecast.as_dict(),
    }
    if store is not None:
        # A saved tensor larger than the read window is read into the tensor
        # backward computes with: the working set's, not a line's.
        out["host"]["reads_on_demand_peak_bytes"] = int(store.counters["read_on_demand_peak_bytes"])
    return out


def forecast(engine: OffloadEngine, model: nn.Module, step: StepFn, tokens: int) -> MemoryForecast:
    """The forecast of one step of ``model`` (offloaded by ``engine``): ``step(model)``
    runs a forward and returns the loss, as the training loop does (on fake tensors
    here: nothing is computed or allocated). Kept by the engine for ``stats``."""
    policy = engine.config.activations
    work = step_memory(
        model,
        step,
        engine.dtype,
        engine.device,
        policy="keep" if policy == "auto" else policy,  # auto keeps at most all
        blocks=engine.config.activation_blocks,
        min_bytes=int(engine.config.activation_min_bytes),
    )
    lines = host_lines(engine)
    store = engine.activations
    libraries = probe_libraries(engine.device, (engine.dtype, torch.float32))
    result = MemoryForecast(
        device_lines=sum(line["limit"] for line in device_lines(engine).values()),
        host_lines=sum(line["limit"] for line in lines.values()),
        working_set=work,
        resident=_resident_on_device(model),
        baseline=engine.baseline_rss,
        device_in_host=engine.device.type != "cuda",  # the fence is RAM too
        tokens=tokens,
        host_transients=(0 if store is None or store.spill is None else work.largest_moved)
        + transient_limit(engine.plan, engine.chunk_optimizer.whole_tensors),
        library_workspaces=libraries[0],
        library_host=libraries[1],
        grad_norms=grad_norm_bytes(engine.plan, device_block_bytes(engine.device)),
    )
    engine.forecast = result
    return result


def _resident_on_device(model: nn.Module) -> int:
    """Bytes of ``model``'s own storages on its device outside the chunks: its buffers,
    and the placeholders its parameters hold outside a forward, each as the device's
    allocator holds it (the H200 held two 32-byte buffers in 1 KiB)."""
    storages = {
        t.untyped_storage().data_ptr(): device_bytes(t.untyped_storage().nbytes(), t.device)
        for t in (*model.parameters(), *model.buffers())
        if t.device.type != "meta"
    }
    return sum(storages.values())


def tier_stats(chunks: ModelChunks) -> dict[str, Any]:
    """Chunk size and count, each tier's budget, reservation and peak, NVMe bytes and
    registration, and the homes per kind and tier."""
    manager, plan = chunks.manager, chunks.plan
    return {
        "chunk_size": plan.layout.chunk_bytes,
        "num_chunks": plan.layout.num_chunks,
        "device_budget_bytes": plan.budgets.device,
        "device_reserved_bytes": manager.device_account.reserved,
        "device_peak_bytes": manager.device_account.peak,
        "host_budget_bytes": plan.budgets.host,
        "host_reserved_bytes": manager.host_account.reserved,
        "host_peak_bytes": manager.host_account.peak,
        "nvme_budget_bytes": plan.budgets.nvme,
        "nvme_bytes": manager.nvme_account.used,
        # staging slabs registered with io_uring (no page pinning per transfer)
        "nvme_registered_buffers": manager.fixed_buffers is None,
        "placement": {
            kind: {tier: sum(h == tier for h in homes) for tier in (DEVICE, HOST, NVME)}
            for kind, homes in (
                ("param", plan.param_home),
                ("grad", plan.grad_home),
                ("optim", plan.optim_home),
            )
        },
    }


def io_stats(chunks: ModelChunks) -> dict[str, Any]:
    """The traffic counters since ``offload``, and why io_uring refused the staging
    buffers if it did."""
    manager = chunks.manager
    out: dict[str, Any] = {}
    if manager.fixed_buffers is not None and manager.fixed_buffers.startswith("io_uring"):
        out["nvme_registration_error"] = manager.fixed_buffers  # the kernel refused
    out.update(manager.traffic.snapshot())
    return out
