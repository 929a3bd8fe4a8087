"""Output of ``infinity bench nvme``: the table, the JSON summary and the PNG plot."""

from __future__ import annotations

import json
from typing import Any

from infinity.bench.disk import Point
from infinity.bench.nvme_pick import Recommendation
from infinity.utils.sizes import format_size

BEST_RULE = (
    "least cpu_ms_per_gb among the points whose read_gbps + write_gbps is within noise "
    "of the highest"
)
UNITS = "GB/s = 1e9 bytes per second"


def _short_size(nbytes: int) -> str:
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)


def table(
    points: list[Point],
    baseline: dict[int, tuple[float, float]],
    size: int,
    choice: Recommendation | None = None,
    repeats: int = 1,
) -> str:
    """A fixed-width table of every point, the baseline rows and the recommended configuration.

    ``points`` are medians over ``repeats`` measurements of each configuration.
    """
    columns = (
        ("threads", 7),
        ("block", 6),
        ("qd", 5),
        ("write GB/s", 11),
        ("read GB/s", 10),
        ("CPU ms/GB", 10),
    )
    header = f"{'backend':<20} " + " ".join(f"{name:>{width}}" for name, width in columns)
    lines = [
        f"sequential O_DIRECT write then read of {format_size(size)} per point ({UNITS})"
        + (f", median of {repeats} interleaved repeats" if repeats > 1 else ""),
        header,
        "-" * len(header),
    ]
    for p in points:
        lines.append(
            f"{p.backend:<20} {p.threads:>7} {_short_size(p.block_size):>6} {p.queue_depth:>5} "
            f"{p.write_gbps:>11.3f} {p.read_gbps:>10.3f} {p.cpu_ms_per_gb:>10.1f}"
        )
    for bs, (w, r) in sorted(baseline.items()):
        lines.append(
            f"{'aiofiles (buffered)':<20} {'-':>7} {_short_size(bs):>6} {'-':>5} "
            f"{w:>11.3f} {r:>10.3f} {'-':>10}"
        )
    if choice is not None:
        best, fast = choice.pick, choice.fastest
        lines.append(
            f"best ({BEST_RULE}): backend={best.backend} threads={best.threads} "
            f"block_size={_short_size(best.block_size)} queue_depth={best.queue_depth}: "
            f"write {best.write_gbps:.3f} GB/s, read {best.read_gbps:.3f} GB/s, "
            f"{best.cpu_ms_per_gb:.1f} CPU ms/GB"
        )
        if fast is not best:
            lines.append(
                f"fastest: backend={fast.backend} threads={fast.threads} "
                f"block_size={_short_size(fast.block_size)} queue_depth={fast.queue_depth}"
            )
        lines.append(choice.explain())
    if baseline:
        lines.append(
            "note: the aiofiles baseline is buffered; its write includes fsync and its page "
            "cache is dropped (posix_fadvise DONTNEED) before the read"
        )
    if points:
        lines.append(
            "CPU ms/GB: process CPU time (all threads, user + kernel) per GB written or read, "
            "which training loses from compute on the same cores"
        )
    return "\n".join(lines)


def summary(
    points: list[Point],
    baseline: dict[int, tuple[float, float]],
    size: int,
    choice: Recommendation,
) -> dict[str, Any]:
    """The JSON object printed by ``--json``.

    ``best["aio"]`` is the recommended configuration (see
    :mod:`infinity.bench.nvme_pick`), in the form ``infinity.Config(aio=...)``
    loads unchanged; ``fastest`` is the one with the highest read + write GB/s.
    """
    best, fast = choice.pick, choice.fastest
    return {
        "units": UNITS,
        "size": size,
        "points": [p.as_dict() for p in points],
        "baseline": [
            {"name": "aiofiles", "block_size": bs, "write_gbps": w, "read_gbps": r}
            for bs, (w, r) in sorted(baseline.items())
        ],
        "best_rule": BEST_RULE,
        "noise": choice.noise,
        "noise_measured": choice.noise_measured,
        "best": {
            "read_gbps": best.read_gbps,
            "write_gbps": best.write_gbps,
            "cpu_ms_per_gb": best.cpu_ms_per_gb,
            "aio": best.aio(),
        },
        "fastest": {
            "read_gbps": fast.read_gbps,
            "write_gbps": fast.write_gbps,
            "cpu_ms_per_gb": fast.cpu_ms_per_gb,
            "aio": fast.aio(),
        },
    }


def json_line(data: dict[str, Any]) -> str:
    """One line of JSON (the last line of ``--json`` output)."""
    return json.dumps(data, separators=(",", ":"))


def plot(points: list[Point], baseline: dict[int, tuple[float, float]], path: str) -> None:
    """PNG: GB/s against block size, one line per queue depth (per backend/threads if several).

    Two panels, write and read; the aiofiles baseline is a dashed gray line.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    groups: dict[tuple[str, int, int], list[Point]] = {}
    for p in points:
        groups.setdefault((p.backend, p.threads, p.queue_depth), []).append(p)
    several = len({(b, t) for b, t, _ in groups}) > 1
    block_sizes = sorted({p.block_size for p in points} | set(baseline))
    for ax, kind in zip(axes, ("write", "read"), strict=True):
        for (backend, threads, qd), pts in sorted(groups.items()):
            pts = sorted(pts, key=lambda p: p.block_size)
            label = (f"{backend} threads={threads} " if several else "") + f"qd={qd}"
            ax.plot(
                [p.block_size for p in pts],
                [getattr(p, f"{kind}_gbps") for p in pts],
                marker="o",
                label=label,
            )
        if baseline:
            bss = sorted(baseline)
            values = [baseline[b][0 if kind == "write" else 1] for b in bss]
            ax.plot(
                bss, values, linestyle="--", color="gray", marker="x", label="aiofiles (buffered)"
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(block_sizes)
        ax.set_xticklabels([_short_size(b) for b in block_sizes])
        ax.set_xlabel("block size")
        ax.set_ylabel("GB/s (1e9 B/s)")
        ax.set_title(f"sequential O_DIRECT {kind}")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
