"""What ``infinity bench nvme`` found: the configuration to recommend, then the table, the
JSON summary and the PNG plot.

The recommendation is the cheapest configuration in CPU among those within noise of
the top throughput.

CPU spent on I/O is taken from compute on the same cores (an I/O thread
preempts one of torch's intra-op threads, and the whole parallel region then
waits for it), so a throughput edge that the measurement cannot tell apart from
noise is not worth paying for with more CPU per GB. The noise is measured, not
assumed: every configuration is measured ``repeats`` times (in interleaved
passes, so drift hits every configuration alike), and the noise is the median
over configurations of the relative spread ``(max - min) / median`` of their
read + write throughput. A configuration is *within noise of the top* when its
median throughput is at least ``top * (1 - noise)``.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

from infinity.bench.disk import Point
from infinity.utils.sizes import format_size

# With a single repeat the spread cannot be measured: assume this much.
ASSUMED_NOISE = 0.10
# Below this the spread of a few repeats is luck, not the disk's real stability.
MIN_NOISE = 0.03


def _key(p: Point) -> tuple[str, int, int, int]:
    return (p.backend, p.threads, p.block_size, p.queue_depth)


def _total(p: Point) -> float:
    return p.read_gbps + p.write_gbps


@dataclass
class Recommendation:
    """The pick, the fastest point, and the noise that separates them."""

    pick: Point
    fastest: Point
    noise: float  # relative: 0.05 = 5 %
    noise_measured: bool  # False: one repeat, ASSUMED_NOISE used
    candidates: list[Point]  # within noise of the fastest

    def explain(self) -> str:
        """Two lines for the table: how noise was defined and what was picked."""
        how = (
            f"noise {self.noise:.1%} = median over configurations of the (max - min) / median "
            f"spread of read + write GB/s across repeats (at least {MIN_NOISE:.0%})"
            if self.noise_measured
            else f"noise {self.noise:.0%} assumed (one repeat: use --repeats 3 to measure it)"
        )
        return (
            f"{how}; {len(self.candidates)} configuration(s) within noise of the fastest "
            f"({_total(self.fastest):.3f} GB/s read + write); recommended: the least CPU per GB "
            f"among them ({self.pick.cpu_ms_per_gb:.1f} ms/GB, fastest: "
            f"{self.fastest.cpu_ms_per_gb:.1f} ms/GB)"
        )


def combine_repeats(samples: list[Point]) -> tuple[list[Point], float | None]:
    """Per configuration, the median of its repeats; and the measured noise.

    ``samples`` holds every measurement (a configuration may appear several
    times). Returns the merged points (first-seen order) and the noise, or
    None when no configuration was measured twice.
    """
    groups: dict[tuple[str, int, int, int], list[Point]] = {}
    for p in samples:
        groups.setdefault(_key(p), []).append(p)
    merged = []
    spreads = []
    for (backend, threads, block, depth), group in groups.items():
        merged.append(
            Point(
                backend=backend,
                block_size=block,
                queue_depth=depth,
                threads=threads,
                write_gbps=statistics.median(p.write_gbps for p in group),
                read_gbps=statistics.median(p.read_gbps for p in group),
                cpu_ms_per_gb=statistics.median(p.cpu_ms_per_gb for p in group),
            )
        )
        if len(group) > 1:
            totals = [_total(p) for p in group]
            middle = statistics.median(totals)
            if middle > 0:
                spreads.append((max(totals) - min(totals)) / middle)
    return merged, (statistics.median(spreads) if spreads else None)


def recommend(points: list[Point], noise: float | None) -> Recommendation:
    """The configuration within ``noise`` of the top read + write throughput with the
    least CPU per GB (ties: the faster one). ``noise=None``: :data:`ASSUMED_NOISE`."""
    if not points:
        raise ValueError("no points measured")
    measured = noise is not None
    level = max(noise, MIN_NOISE) if noise is not None else ASSUMED_NOISE
    fastest = max(points, key=_total)
    floor = _total(fastest) * (1.0 - level)
    candidates = [p for p in points if _total(p) >= floor]
    pick = min(candidates, key=lambda p: (p.cpu_ms_per_gb, -_total(p)))
    return Recommendation(pick, fastest, level, measured, candidates)


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


def _settings(p: Point) -> str:
    return (
        f"backend={p.backend} threads={p.threads} block_size={_short_size(p.block_size)} "
        f"queue_depth={p.queue_depth}"
    )


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
            f"best ({BEST_RULE}): {_settings(best)}: "
            f"write {best.write_gbps:.3f} GB/s, read {best.read_gbps:.3f} GB/s, "
            f"{best.cpu_ms_per_gb:.1f} CPU ms/GB"
        )
        if fast is not best:
            lines.append(f"fastest: {_settings(fast)}")
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
    :func:`recommend`), in the form ``infinity.Config(aio=...)``
    loads unchanged; ``fastest`` is the one with the highest read + write GB/s.
    """
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
        **{
            name: {
                "read_gbps": p.read_gbps,
                "write_gbps": p.write_gbps,
                "cpu_ms_per_gb": p.cpu_ms_per_gb,
                "aio": p.aio(),
            }
            for name, p in (("best", choice.pick), ("fastest", choice.fastest))
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
