"""The measured rows of ``infinity train``'s summary: each memory line against its limit,
the peaks against the forecast, and the step against its bound (what
``infinity.stats(model)`` reports; runtime/memory.py, runtime/stepping.py)."""

from __future__ import annotations

from typing import Any

from infinity.utils.sizes import format_size

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
