"""Train a model larger than the machine's RAM for a few steps and measure it.

The model is a ``transformers`` Llama of the family below, built under
:func:`infinity.init_empty` and offloaded with small device and host budgets, so
nearly all of its states live on the NVMe disk. The report sets each measurement
against what bounds it: the states against the RAM, the peak RSS against the
budgets, the step time against the disk's I/O bound (the time this disk needs for
one step's NVMe reads and writes, from rates measured in the same run with
:func:`infinity.io.rates.measure_mix`), and the time the disk was busy against
the step (``nvme_busy_seconds``: the disk idles while the step computes without a
transfer in flight). ``Config.device`` may be ``cuda``: the GPU computes, the
states still go through the host budget to the disk. :func:`planned_nvme_bytes`
is the planner's estimate of one step's NVMe bytes, to size a run for a disk
before building anything.

The family (:class:`Shape`, :func:`family`) is the Llama shape of the 2.24B
example in the scale issue (hidden 2560, 32 layers, head dimension 128, SwiGLU
width 8/3 of hidden) scaled in steps of 128 in ``hidden`` with the depth growing
along (``layers = hidden / 80``), so that each member is a plausible model rather
than a deep thin stack; :func:`pick_shape` picks its largest member that fits.
Parameter counts are computed in closed form (no model is built to choose one).
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch

import infinity
from infinity.config import Config
from infinity.io.rates import GB, faster, io_bound_seconds, measure_mix
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.optim.cpu_adam import ADAM
from infinity.runtime.budgets import DTYPE_OF, plan_for
from infinity.runtime.params import ParamRegistry
from infinity.utils.sizes import format_size

HIDDEN_STEP = 128
HEAD_DIM = 128
HIDDEN_PER_LAYER = 80  # 2560 hidden / 32 layers
MAX_HIDDEN = 1 << 16


@dataclass(frozen=True)
class Shape:
    """A bias-free, untied ``transformers`` Llama (multi-head attention)."""

    hidden: int
    layers: int
    vocab: int

    @property
    def intermediate(self) -> int:
        """SwiGLU width: 8/3 of hidden rounded up to a multiple of 256 (as Llama does)."""
        return -(-self.hidden * 8 // 3 // 256) * 256

    @property
    def heads(self) -> int:
        """Attention heads of dimension 128 (one head below 128 hidden)."""
        return max(1, self.hidden // HEAD_DIM)

    @property
    def num_params(self) -> int:
        """Parameters: per layer 4 attention projections, 3 MLP ones and 2 norms;
        the embedding, the output head and the final norm."""
        h, i = self.hidden, self.intermediate
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return self.layers * per_layer + 2 * self.vocab * h + h

    def llama_config(self, max_positions: int = 4096) -> Any:
        """The ``transformers.LlamaConfig`` of this shape (imports transformers)."""
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
        )

    def describe(self) -> str:
        """One line: size and shape."""
        n = self.num_params
        size = f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.1f}M"
        return f"Llama {size} (hidden {self.hidden}, {self.layers} layers, vocab {self.vocab})"


def bytes_per_param(dtype: str, state_dtype: str = "fp32") -> float:
    """Bytes of training state per parameter: the parameter and its gradient in the
    compute dtype, plus the optimizer unit (an fp32 master copy unless the compute
    dtype is fp32, and Adam's two moments stored as ``state_dtype``)."""
    element = DTYPE_OF[dtype].itemsize
    unit = ADAM.with_state_dtype(state_dtype).unit_bytes(UNIT_SAMPLE, has_master=dtype != "fp32")
    per = 2 * element + unit / UNIT_SAMPLE
    return int(per) if per == int(per) else per


# Elements of a large chunk, to read the per-element bytes of a unit off (int8's
# block scales make them fractional).
UNIT_SAMPLE = 1 << 20


def family(vocab: int) -> Iterator[Shape]:
    """Members in increasing size (hidden 128, 256, ...)."""
    for hidden in range(HIDDEN_STEP, MAX_HIDDEN + 1, HIDDEN_STEP):
        yield Shape(hidden, max(2, round(hidden / HIDDEN_PER_LAYER)), vocab)


def usable_disk(free_bytes: int, margin: float, reserved: int) -> int:
    """Bytes of states the bench lets itself put on a disk with ``free_bytes`` free:
    ``margin`` of it stays free for everyone else, ``reserved`` more for the
    bench's own bandwidth measurement file."""
    return max(0, int(free_bytes * (1 - margin)) - reserved)


def pick_shape(
    *, vocab: int, dtype: str, max_states: int | None = None, max_params: int | None = None
) -> Shape:
    """The largest member whose states fit ``max_states`` bytes and whose
    parameters are at most ``max_params``; :class:`ValueError` naming the smallest
    member's needs if none does."""
    per = bytes_per_param(dtype)
    best = None
    for shape in family(vocab):
        n = shape.num_params
        if (max_states is not None and n * per > max_states) or (
            max_params is not None and n > max_params
        ):
            break
        best = shape
    if best is None:
        smallest = next(family(vocab))
        raise ValueError(
            f"even the smallest model ({smallest.describe()}: {smallest.num_params} parameters, "
            f"{format_size(smallest.num_params * per)} of states) is above the limit "
            f"(states {format_size(max_states) if max_states is not None else 'unlimited'}, "
            f"parameters {max_params if max_params is not None else 'unlimited'}); "
            "free disk space, or use a smaller --vocab"
        )
    return best


Note = Callable[[str], None]
StepBar = Callable[[int], Any]  # wraps range(steps) in a progress bar


@dataclass(frozen=True)
class ScaleRun:
    """What to train and how."""

    shape: Shape
    config: Config
    steps: int = 3
    batch: int = 1
    seq_len: int = 256
    measure_bytes: int = 1 << 30  # size of the disk bandwidth measurement


def peak_rss() -> int:
    """Peak resident set of this process so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _init_weights(model: torch.nn.Module) -> Callable[[torch.nn.Module], None]:
    """The model's own initialisation (``transformers``' ``_init_weights``), per module."""
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        raise TypeError(f"{type(model).__name__} has no _init_weights")
    return init


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queued work (a step's wall time must include it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """The GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def planned_nvme_bytes(shape: Shape, config: Config) -> tuple[int, int]:
    """NVMe bytes (read, written) per step the planner estimates (``Plan.traffic``)
    for ``shape`` under ``config``: a meta model, nothing allocated or written."""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(shape.llama_config())
    plan = plan_for(ParamRegistry.from_model(model), config, torch.device(config.device))
    return plan.traffic["nvme_read_bytes"], plan.traffic["nvme_write_bytes"]


def run_scale(run: ScaleRun, note: Note, bar: StepBar) -> dict[str, Any]:
    """Build, offload and train the model; the report as a JSON-ready dict."""
    import transformers

    config = run.config
    device = torch.device(config.device)
    base_rss = psutil.Process().memory_info().rss
    note(f"measuring the disk ({run.measure_bytes / GB:.1f} GB written and read)")
    before = measure_mix(str(config.nvme_path), run.measure_bytes, config.aio)
    note(f"building {run.shape.describe()}")
    llama = transformers.LlamaForCausalLM  # NOTE: a lazy import, kept out of the timing
    start = time.perf_counter()
    with infinity.init_empty():
        model: torch.nn.Module = llama(run.shape.llama_config(run.seq_len))
    construct_s = time.perf_counter() - start
    start = time.perf_counter()  # one plan of the meta model (offload plans once more)
    plan_for(ParamRegistry.from_model(model), config, device)
    planner_s = time.perf_counter() - start
    note("offloading: initialising the chunks (and writing them to the disk)")
    start = time.perf_counter()
    model = infinity.offload(model, config, init=_init_weights(model))
    offload_s = time.perf_counter() - start
    engine = engine_of(model)
    params = sum(e.param.numel() for e in engine.registry.entries)
    try:
        optimizer = CPUAdam(model.parameters(), lr=1e-4)
        # One batch, repeated: its loss must fall step after step, a check
        # that the offloaded states round-trip through the disk intact.
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, run.shape.vocab, (run.batch, run.seq_len), generator=g)
        tokens = tokens.to(device)
        steps: list[dict[str, float]] = []
        losses: list[float] = []
        for _ in bar(run.steps):
            start = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            _sync(device)
            lap = dict(engine.pipeline.step_timer.last)
            lap["wall_seconds"] = time.perf_counter() - start
            steps.append(lap)
            losses.append(float(loss.detach()))
        stats = infinity.stats(model)
    finally:
        engine.close()
    note("measuring the disk again")
    after = measure_mix(str(config.nvme_path), run.measure_bytes, config.aio)
    # On a shared disk the bandwidth drifts over minutes; the faster of the
    # two measurements of each rate gives the lower (stricter) bound.
    disk = faster(before, after)
    # The first step records the warm-up trace; the steady state starts after it.
    timed = steps[1:] or steps
    step_s = statistics.median(s["wall_seconds"] for s in timed)
    read_b = statistics.median(s.get("nvme_read_bytes", 0.0) for s in timed)
    write_b = statistics.median(s.get("nvme_write_bytes", 0.0) for s in timed)
    # The bound is what this disk needs for the step's reads and writes,
    # overwriting (as a step does) and doing both at once at the rate measured
    # for that (measure_mix). The slower direction alone (``io_duplex_seconds``)
    # is the bound of a disk that reads and writes at full speed at once; the
    # sum (``io_serial_seconds``), of one that serialises them.
    read_s, write_s = read_b / (disk.read_gbps * GB), write_b / (disk.write_gbps * GB)
    io_bound = io_bound_seconds(read_b, write_b, disk)
    busy = statistics.median(s.get("nvme_busy_seconds", 0.0) for s in timed)
    # The step timer splits each step into waiting on each tier and the
    # rest; a step far above the I/O bound with little waiting is compute-bound.
    wait_nvme = statistics.median(s.get("wait_nvme_seconds", 0.0) for s in timed)
    compute = statistics.median(s.get("compute_seconds", 0.0) for s in timed)
    per = bytes_per_param(config.dtype, config.optimizer_state_dtype)
    return {
        "model": run.shape.describe(),
        "hidden": run.shape.hidden,
        "layers": run.shape.layers,
        "vocab": run.shape.vocab,
        "intermediate": run.shape.intermediate,
        "heads": run.shape.heads,
        "dtype": config.dtype,
        "device": device_name(device),
        "optimizer_state_dtype": config.optimizer_state_dtype,
        "overlap_optimizer": config.overlap_optimizer,
        "params": params,
        "bytes_per_param": per,
        "states_bytes": int(params * per),
        "ram_bytes": psutil.virtual_memory().total,
        "nvme_bytes": stats["nvme_bytes"],
        "device_budget_bytes": stats["device_budget_bytes"],
        "host_budget_bytes": stats["host_budget_bytes"],
        "device_peak_bytes": stats["device_peak_bytes"],
        "host_peak_bytes": stats["host_peak_bytes"],
        "base_rss_bytes": base_rss,
        "peak_rss_bytes": peak_rss(),
        "construct_seconds": construct_s,
        "planner_seconds": planner_s,
        "offload_seconds": offload_s,
        "step_seconds": step_s,
        "steps": [s["wall_seconds"] for s in steps],
        "losses": losses,
        "nvme_read_bytes_per_step": read_b,
        "nvme_write_bytes_per_step": write_b,
        "disk_read_gbps": disk.read_gbps,
        "disk_write_gbps": disk.write_gbps,
        "disk_both_gbps": disk.both_gbps,
        "disk_first_write_gbps": disk.first_write_gbps,
        # before building the model and after training it
        "disk_measured": [m.as_dict() for m in (before, after)],
        "io_bound_seconds": io_bound,
        "io_serial_seconds": read_s + write_s,
        "io_duplex_seconds": max(read_s, write_s),
        # the disk had a transfer of the step in flight this long (median of steps 2+)
        "nvme_busy_seconds": busy,
        # NVMe bytes over the step's time, and over the time the disk was busy
        "nvme_gbps": (read_b + write_b) / step_s / GB if step_s else 0.0,
        "nvme_busy_gbps": (read_b + write_b) / busy / GB if busy else 0.0,
        "wait_nvme_seconds": wait_nvme,
        "compute_seconds": compute,
        "vs_io_bound": step_s / io_bound if io_bound else None,
        "batch": run.batch,
        "seq_len": run.seq_len,
    }
