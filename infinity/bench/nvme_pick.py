"""Which ``infinity bench nvme`` configuration to recommend: the cheapest in CPU among
those within noise of the top throughput.

NOTE: CPU spent on I/O is taken from compute on the same cores (an I/O thread
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

import statistics
from dataclasses import dataclass

from infinity.bench.disk import Point

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
