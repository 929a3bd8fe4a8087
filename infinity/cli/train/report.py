"""What ``infinity train`` shows: the header, per-step progress and the final summary.

Two reporters share one interface: :class:`HumanReport` (text on stdout, a
tqdm bar on stderr) and :class:`JsonReport` (one JSON object per line on
stdout: ``start``, ``step``, ``eval``, ``checkpoint``, ``summary``), for tools.
The summary's measured rows set each memory line against its limit, the peaks
against the forecast and the step against its bound (what ``infinity.stats(model)``
reports; runtime/memory.py, runtime/stepping.py).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from infinity.utils.sizes import format_size

# sent_bytes: payload this process sent to the others in collectives (0 for one process)
TRAFFIC_KEYS = ("h2d_bytes", "d2h_bytes", "nvme_read_bytes", "nvme_write_bytes", "sent_bytes")
WAIT_KEYS = ("wait_nvme_seconds", "wait_device_seconds")
# The step's bound (infinity.stats(model)["last_step"], runtime/stepping.py).
BOUND_PARTS = {
    "device_compute_seconds": "device compute",
    "host_optimizer_seconds": "host optimizer",
    "h2d_seconds": "host→device",
    "d2h_seconds": "device→host",
    "nvme_seconds": "NVMe",
}
BOUND_KEYS = (*BOUND_PARTS, "seconds", "bound_seconds", "step_over_bound", "bound_by")
BOUND_WINDOW = 1000  # steps the summary's medians of the bound are taken over


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as the reports see it."""

    step: int
    loss: float
    lr: float
    seconds: float
    tokens_per_second: float
    traffic: dict[str, int]  # bytes moved during this step, per link (TRAFFIC_KEYS)
    waits: dict[str, float]  # seconds this step waited on each tier (WAIT_KEYS)
    grad_norm: float | None = None
    skipped: bool = False  # fp16: overflow, the update was skipped
    bound: dict[str, float | str] = field(default_factory=dict)  # the step's (BOUND_KEYS)


@dataclass
class RunSummary:
    """Totals of one invocation, printed at the end (and saved as JSON)."""

    status: str  # "finished" | "stopped" | "interrupted"
    first_step: int
    last_step: int
    losses: dict[int, float] = field(default_factory=dict)
    eval_before: float | None = None
    eval_after: float | None = None
    wall_seconds: float = 0.0
    train_seconds: float = 0.0
    tokens: int = 0
    step_totals: dict[str, float] = field(default_factory=dict)  # sums of the steps' counters
    checkpoint: str | None = None
    plot: str | None = None
    model_dir: str | None = None  # --model runs: the fine-tuned model (transformers layout)
    stats: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict[str, float]] = field(default_factory=list)  # per process, with several
    optimizer: str = "adamw"  # --optimizer
    # The last steps' bounds, the run's first step left out (it records the trace).
    _bounds: deque[dict[str, float | str]] = field(
        default_factory=lambda: deque(maxlen=BOUND_WINDOW), repr=False
    )

    def add_step(self, record: StepRecord) -> None:
        """Count one finished step in the totals."""
        self.losses[record.step] = record.loss
        self.last_step = record.step
        for key, value in (record.traffic | record.waits).items():
            self.step_totals[key] = self.step_totals.get(key, 0.0) + value
        if record.bound and record.step > self.first_step:
            self._bounds.append(record.bound)

    def bound(self) -> dict[str, float | str]:
        """Medians of the last steps' bounds (BOUND_KEYS; ``bound_by``: the most frequent)."""
        if not self._bounds:
            return {}
        out: dict[str, float | str] = {
            k: statistics.median(float(b.get(k, 0.0)) for b in self._bounds)
            for k in BOUND_KEYS[:-1]
        }
        out["bound_by"] = Counter(str(b["bound_by"]) for b in self._bounds).most_common(1)[0][0]
        return out


def _mb(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.0f}M"


def postfix(record: StepRecord) -> str:
    """The progress-bar text of one step: loss, speed and bytes moved per tier."""
    t = record.traffic
    return (
        f"loss {record.loss:.3f} | {record.tokens_per_second / 1000:.1f}k tok/s | "
        f"host→dev {_mb(t['h2d_bytes'])} dev→host {_mb(t['d2h_bytes'])} "
        f"nvme r {_mb(t['nvme_read_bytes'])} w {_mb(t['nvme_write_bytes'])} /step"
        + (f" | sent {_mb(t['sent_bytes'])}/step" if t.get("sent_bytes") else "")
        + (" | skipped (fp16 overflow)" if record.skipped else "")
    )


def summary_table(summary: RunSummary, stats: dict[str, Any]) -> str:
    """The end-of-run table: peaks against budgets, NVMe traffic, time waiting on I/O."""
    rows = [f"{'tier':<8}{'budget':>12}{'peak':>12}{'use':>7}"]
    for tier in ("device", "host"):
        budget, peak = stats[f"{tier}_budget_bytes"], stats[f"{tier}_peak_bytes"]
        rows.append(
            f"{tier:<8}{format_size(budget):>12}{format_size(peak):>12}{peak / budget:>7.0%}"
        )
    nvme_budget = stats.get("nvme_budget_bytes")
    rows.append(
        f"{'nvme':<8}{(format_size(nvme_budget) if nvme_budget else '-'):>12}"
        f"{format_size(stats['nvme_bytes']):>12}{'':>7}"
    )
    gb = 1e9
    steps = max(1, len(summary.losses))
    per_step = {k: summary.step_totals.get(k, 0.0) / steps for k in TRAFFIC_KEYS + WAIT_KEYS}
    rows.append(
        f"NVMe traffic: {stats['nvme_read_bytes'] / gb:.2f} GB read, "
        f"{stats['nvme_write_bytes'] / gb:.2f} GB written in all; per step "
        f"{format_size(per_step['nvme_read_bytes'])} read, "
        f"{format_size(per_step['nvme_write_bytes'])} written, host↔device "
        f"{format_size(per_step['h2d_bytes'] + per_step['d2h_bytes'])}"
    )
    train = max(summary.train_seconds, 1e-9)
    wait_nvme = summary.step_totals.get("wait_nvme_seconds", 0.0)
    wait_dev = summary.step_totals.get("wait_device_seconds", 0.0)
    rows.append(
        f"time: {summary.train_seconds:.1f} s training ({summary.wall_seconds:.1f} s in all); "
        f"waiting on NVMe {wait_nvme / train:.1%}, on device copies {wait_dev / train:.1%}, "
        f"the rest computing"
    )
    if stats.get("optimizer_tensor_state_bytes"):
        rows.append(
            f"optimizer per-tensor states: {format_size(stats['optimizer_tensor_state_bytes'])} "
            "in host memory, inside the host budget (not in the host peak, which counts chunks)"
        )
    rows.extend(row for row in [bound_row(summary.bound())] if row is not None)
    rows.extend(memory_rows(stats["memory"]))
    rows.extend(rank_rows(summary.ranks))
    if summary.train_seconds > 0:
        rows.append(f"throughput: {summary.tokens / summary.train_seconds / 1000:.1f}k tokens/s")
    act = stats.get("activations")
    if act and act.get("saved_last_forward_bytes"):
        policy = act["policy"]
        blocks = act.get("blocks")
        done = {"keep": "kept", "offload": "offloaded", "checkpoint": "checkpointed"}
        chosen = (
            ": " + ", ".join(f"{n} blocks {done[c]}" for c, n in blocks.items() if n)
            if blocks
            else ""
        )
        row = (
            f"activations ({policy}{chosen}): {format_size(act['saved_last_forward_bytes'])} "
            f"saved by the last forward ({format_size(act['saved_bytes_per_token'])} per token)"
        )
        if "packed_bytes" in act:  # offload, auto: where they went
            row += (
                f"; {format_size(act['packed_bytes'] / steps)} moved per step, "
                f"peak {format_size(act['host_peak_bytes'])} in host memory, "
                f"{format_size(act['nvme_peak_bytes'])} on NVMe; backward waited "
                f"{act['read_wait_seconds']:.2f} s for {int(act['reads_waited'])} read(s) "
                f"({int(act['reads_not_ahead'])} not read ahead)"
            )
        rows.append(row)
    if stats.get("skipped_steps"):
        rows.append(f"fp16: {stats['skipped_steps']} step(s) skipped on overflow")
    if stats.get("nvme_registration_error"):
        rows.append(
            f"note: the staging buffers could not be registered with io_uring "
            f"({stats['nvme_registration_error']}), so every transfer pins its pages (more CPU "
            "per byte); a higher locked-memory limit (ulimit -l) lets them register"
        )
    return "\n".join(rows)


def bound_row(bound: dict[str, float | str]) -> str | None:
    """The summary's line on the step's bound: the median step against the slowest of
    its resources, and each resource's seconds."""
    if not bound:
        return None
    parts = ", ".join(f"{name} {float(bound.get(k, 0.0)):.3f} s" for k, name in BOUND_PARTS.items())
    return (
        f"step bound: a step took {float(bound['seconds']):.3f} s, "
        f"{float(bound['step_over_bound']):.2f}x its bound {float(bound['bound_seconds']):.3f} s "
        f"({bound['bound_by']}); per step {parts} (median over steps)"
    )


def memory_rows(memory: dict[str, Any]) -> list[str]:
    """Each budget's lines, their peaks against their limits; the device allocator's peak
    and the resident set's against the forecast (``infinity.stats(model)["memory"]``)."""
    rows = [f"{'memory line':<36}{'limit':>12}{'peak':>12}"]
    for tier in ("host", "device"):
        rows.append(f"{tier} (budget {format_size(memory[tier]['budget_bytes'])})")
        lines = dict(memory[tier]["lines"])
        if tier == "host" and memory["host"]["transient_copies"]["limit"]:
            lines["transient copies, beside it"] = memory["host"]["transient_copies"]
        if tier == "host" and memory["host"].get("pretrained_read_block", {}).get("peak"):
            lines["pretrained read block, beside it"] = memory["host"]["pretrained_read_block"]
        for name, line in lines.items():
            rows.append(
                f"  {name:<34}{format_size(line['limit']):>12}{format_size(line['peak']):>12}"
            )
    forecast = memory.get("forecast") or {}

    def against(measured: int, key: str) -> str:
        if not forecast:
            return format_size(measured)
        return (
            f"{format_size(measured)}, forecast {format_size(forecast[key])} "
            f"({measured / forecast[key]:.2f}x)"
        )

    allocated = memory["device"].get("allocated_peak_bytes")
    if allocated is not None:
        rows.append(f"device allocator peak: {against(allocated, 'device_peak')}")
    rows.append(
        f"resident set peak: {against(memory['host']['resident_peak_bytes'], 'resident_peak')} "
        f"(baseline {format_size(memory['host']['baseline_bytes'])} at offload)"
    )
    return rows


def rank_rows(ranks: list[dict[str, float]]) -> list[str]:
    """Per process: peak memory and bytes sent to the others per step (none for one)."""
    if len(ranks) < 2:
        return []
    rows = [f"{'process':<8}{'device peak':>12}{'host peak':>12}{'nvme':>12}{'sent/step':>12}"]
    for r, row in enumerate(ranks):
        rows.append(
            f"{f'rank {r}':<8}{format_size(row['device_peak_bytes']):>12}"
            f"{format_size(row['host_peak_bytes']):>12}{format_size(row['nvme_bytes']):>12}"
            f"{format_size(row['sent_bytes_per_step']):>12}"
        )
    return rows


def loss_line(summary: RunSummary) -> str:
    """First, best and last training loss (and held-out loss before/after)."""
    losses = list(summary.losses.values())
    text = ""
    if losses:
        text = (
            f"train loss {losses[0]:.3f} (step {summary.first_step}) → {losses[-1]:.3f} "
            f"(step {summary.last_step}), best {min(losses):.3f}"
        )
    if summary.eval_before is not None and summary.eval_after is not None:
        text += f"; held-out loss {summary.eval_before:.3f} → {summary.eval_after:.3f}"
    return text or "no step was run"


def loss_curve(losses: dict[int, float], points: int = 10) -> str:
    """The loss at ``points`` places of the run, each the mean of a window of steps."""
    steps = sorted(losses)
    if not steps:
        return ""
    points = min(points, len(steps))
    cells = []
    for k in range(points):
        window = steps[k * len(steps) // points : (k + 1) * len(steps) // points]
        mean = sum(losses[s] for s in window) / len(window)
        cells.append(f"{mean:.2f}@{window[-1]}")
    return "loss curve (mean over windows, @ last step): " + "  ".join(cells)


class HumanReport:
    """Text for people: header and summary on stdout, a progress bar on stderr."""

    def __init__(self, quiet: bool = False, out: TextIO | None = None) -> None:
        self.quiet = quiet
        self.out = out or sys.stdout
        self._bar = None

    def _print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def start(self, lines: list[str]) -> None:
        """Print what will run, and where the states live."""
        if not self.quiet:
            self._print("\n".join(lines))

    def begin_steps(self, first: int, last: int) -> None:
        """Open the progress bar for steps ``first..last``."""
        if self.quiet:
            return
        from tqdm import tqdm

        self._bar = tqdm(
            total=last, initial=first - 1, unit="step", dynamic_ncols=True, file=sys.stderr
        )

    def step(self, record: StepRecord) -> None:
        """One optimizer step finished."""
        if self._bar is not None:
            self._bar.set_postfix_str(postfix(record), refresh=False)
            self._bar.update(1)

    def end_steps(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def note(self, text: str) -> None:
        """A line worth showing (checkpoint written, eval loss, stopping)."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        elif not self.quiet:
            self._print(text)

    def event(self, kind: str, **data: Any) -> None:
        """Structured events are for :class:`JsonReport`; people get notes instead."""

    def alert(self, text: str) -> None:
        """A line that must be seen even with ``--quiet`` (on stderr)."""
        self.end_steps()
        print(f"infinity: {text}", file=sys.stderr, flush=True)

    def finish(self, summary: RunSummary) -> None:
        """Print the summary table."""
        self.end_steps()
        self._print(loss_line(summary))
        if not self.quiet:
            self._print(loss_curve(summary.losses))
            self._print(summary_table(summary, summary.stats))
            if summary.plot:
                self._print(f"memory timeline: {summary.plot}")
        if summary.checkpoint:
            self._print(f"checkpoint: {summary.checkpoint}")
        if summary.model_dir:
            self._print(
                f"fine-tuned model: {summary.model_dir} "
                "(transformers.AutoModelForCausalLM.from_pretrained loads it)"
            )


class JsonReport:
    """One JSON object per line on stdout, for scripts and tests."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    def event(self, kind: str, **data: Any) -> None:
        """Write one event line."""
        print(json.dumps({"event": kind, **data}), file=self.out, flush=True)

    def start(self, lines: list[str]) -> None:
        """The header as text lines (the ``start`` event)."""
        self.event("start", lines=lines)

    def begin_steps(self, first: int, last: int) -> None:
        """Steps ``first..last`` follow."""

    def step(self, record: StepRecord) -> None:
        """One ``step`` event."""
        self.event("step", **asdict(record))

    def end_steps(self) -> None:
        """No bar to close."""

    def note(self, text: str) -> None:
        """Notes become ``note`` events."""
        self.event("note", text=text)

    def alert(self, text: str) -> None:
        """An ``alert`` event, and the line on stderr for the person watching."""
        self.event("alert", text=text)
        print(f"infinity: {text}", file=sys.stderr, flush=True)

    def finish(self, summary: RunSummary) -> None:
        """The ``summary`` event (losses keyed by step)."""
        data = asdict(summary)
        data["bound"] = summary.bound()
        data.pop("_bounds")
        data["losses"] = {str(k): v for k, v in summary.losses.items()}
        self.event("summary", **data)
