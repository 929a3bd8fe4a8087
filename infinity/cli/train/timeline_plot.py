"""The memory-timeline PNG of ``infinity train``: one step, moment by moment.

Top: bytes on the device and host tiers at every moment of the last complete
iteration, against their budgets, with the phases (forward, backward,
gradients, optimizer) shaded. Bottom: which chunks were resident on the device
at each moment (parameters and gradients), the accessed chunk marked: where a
budget is tight, chunks come and go; where it is loose, they stay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infinity.utils.sizes import format_size

PHASE_COLORS = {
    "forward": "#dbe9f6",
    "backward": "#fde2c8",
    "grad": "#f9d3d3",
    "optimizer": "#dcefd7",
}
MIB = 1 << 20


def _phase_spans(phases: list[str]) -> list[tuple[str, int, int]]:
    """Runs of equal phase as ``(phase, first, last_exclusive)``."""
    spans: list[tuple[str, int, int]] = []
    for i, phase in enumerate(phases):
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], i + 1)
        else:
            spans.append((phase, i, i + 1))
    return spans


def plot_timeline(timeline: dict[str, list], stats: dict[str, Any], path: Path, title: str) -> Path:
    """Draw ``timeline`` (from ``infinity.timeline``), budgets from ``stats``, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, and never pop a window from a CLI
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    phases = timeline["phase"]
    n = len(phases)
    if n == 0:
        raise ValueError("the timeline is empty: no complete training iteration was recorded")
    x = list(range(n))
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(14, 7.5), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]}
    )
    # Phases come in short runs (the gradient moments interleave with backward);
    # shading each run keeps that interleaving visible.
    for ax in (top, bottom):
        for phase, start, stop in _phase_spans(phases):
            ax.axvspan(start - 0.5, stop - 0.5, color=PHASE_COLORS.get(phase, "#eeeeee"), lw=0)

    for key, label, color, budget_key in (
        ("device_bytes", "device", "#1f77b4", "device_budget_bytes"),
        ("host_bytes", "host", "#d62728", "host_budget_bytes"),
    ):
        values = [v / MIB for v in timeline[key]]
        budget = stats[budget_key]
        top.step(
            x,
            values,
            where="mid",
            color=color,
            lw=1.8,
            label=f"{label} (budget {format_size(budget)})",
        )
        top.axhline(budget / MIB, color=color, ls="--", lw=1)
    act_host = [v / MIB for v in timeline.get("activation_host_bytes", [])]
    act_nvme = [v / MIB for v in timeline.get("activation_nvme_bytes", [])]
    if any(act_host) or any(act_nvme):
        # activations="offload": their own band, stacked (host memory, then NVMe)
        stacked = [h + d for h, d in zip(act_host, act_nvme, strict=True)]
        top.fill_between(
            x, 0, act_host, step="mid", color="#2ca02c", alpha=0.35, label="activations, host"
        )
        top.fill_between(
            x, act_host, stacked, step="mid", color="#8c564b", alpha=0.3, label="activations, NVMe"
        )
    placed = stats["placement"]
    nvme_note = (
        f"NVMe: {format_size(stats['nvme_bytes'])} of swap files holding chunks of "
        f"parameters {placed['param']['nvme']}, gradients {placed['grad']['nvme']}, "
        f"optimizer states {placed['optim']['nvme']} (of {stats['num_chunks']})"
        if stats.get("nvme_bytes")
        else "NVMe: not used"
    )
    top.set_ylabel("MiB in use")
    top.set_ylim(bottom=0)
    top.set_title(f"{title}\n{nvme_note}", fontsize=10)
    phase_handles = [
        Patch(color=PHASE_COLORS[p], label=p) for p in PHASE_COLORS if p in set(phases)
    ]
    handles, _ = top.get_legend_handles_labels()
    top.legend(
        handles=handles + phase_handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8
    )

    for key, color, lift in (("device_chunks", "#1f77b4", 0.0), ("device_grads", "#ff7f0e", 0.3)):
        points = [(i, c + lift) for i, chunks in enumerate(timeline[key]) for c in chunks]
        if points:
            xs, ys = zip(*points, strict=True)
            bottom.scatter(xs, ys, marker="s", s=9, color=color, lw=0)
    bottom.scatter(x, timeline["chunk"], marker="x", s=14, color="black", lw=0.8)
    bottom.set_ylabel("chunk")
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("moment of the step (one chunk access each)")
    num_chunks = stats.get("num_chunks") or (max(timeline["chunk"]) + 1)
    bottom.set_ylim(-0.7, num_chunks - 0.3)
    bottom.legend(
        handles=[
            Patch(color="#1f77b4", label="parameter chunk on device"),
            Patch(color="#ff7f0e", label="gradient chunk on device"),
            plt.Line2D([], [], marker="x", color="black", ls="", label="chunk accessed"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    bottom.set_xlim(-0.5, n - 0.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
