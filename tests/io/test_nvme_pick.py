"""The ``infinity bench nvme`` recommendation on fabricated measurements.

Expected picks are worked out by hand from the rows below (the rule: the
least CPU per GB among the configurations whose median read + write GB/s is
within the measured noise of the highest).
"""

from __future__ import annotations

import pytest

from infinity.bench.disk import Point
from infinity.bench.nvme_report import ASSUMED_NOISE, MIN_NOISE, combine_repeats, recommend


def _p(backend: str, block: int, depth: int, w: float, r: float, cpu: float) -> Point:
    return Point(backend, block << 10, depth, 1, w, r, cpu)


def test_cheapest_within_noise_beats_a_marginally_faster_expensive_one():
    # Two repeats each; spreads of read + write: 2.0 vs 2.1 -> 0.1/2.05, and so on.
    samples = [
        _p("threads", 256, 8, 1.00, 1.10, 240.0),  # fastest, expensive
        _p("io_uring", 4096, 32, 0.98, 1.06, 12.0),  # 2 % slower, 20x cheaper
        _p("aio", 1024, 32, 0.80, 0.85, 30.0),  # clearly slower
        _p("threads", 256, 8, 0.98, 1.02, 250.0),
        _p("io_uring", 4096, 32, 1.00, 1.04, 14.0),
        _p("aio", 1024, 32, 0.78, 0.84, 34.0),
    ]
    points, noise = combine_repeats(samples)
    # medians: threads 2.05 (spread 0.10/2.05), io_uring 2.04 (0.0/2.04), aio 1.635 (0.03/1.635)
    assert noise == pytest.approx(0.03 / 1.635)
    choice = recommend(points, noise)
    assert choice.fastest.backend == "threads"
    assert choice.noise == pytest.approx(max(0.03 / 1.635, MIN_NOISE))
    assert [p.backend for p in choice.candidates] == ["threads", "io_uring"]
    assert choice.pick.backend == "io_uring"
    assert choice.pick.cpu_ms_per_gb == pytest.approx(13.0)  # median of 12 and 14


def test_a_faster_config_outside_the_noise_wins_even_if_it_costs_more():
    samples = [
        _p("threads", 256, 8, 1.5, 1.5, 240.0),
        _p("io_uring", 4096, 32, 1.0, 1.0, 12.0),
        _p("threads", 256, 8, 1.5, 1.5, 240.0),
        _p("io_uring", 4096, 32, 1.0, 1.0, 12.0),
    ]
    points, noise = combine_repeats(samples)
    assert noise == 0.0  # identical repeats
    choice = recommend(points, noise)
    assert choice.noise == MIN_NOISE  # the floor, not zero
    assert choice.pick.backend == "threads"


def test_one_repeat_assumes_the_default_noise():
    samples = [_p("threads", 256, 8, 1.0, 1.0, 240.0), _p("aio", 1024, 32, 0.95, 0.95, 30.0)]
    points, noise = combine_repeats(samples)
    assert noise is None and len(points) == 2
    choice = recommend(points, noise)
    assert not choice.noise_measured and choice.noise == ASSUMED_NOISE
    assert choice.pick.backend == "aio"  # 5 % slower, within the assumed 10 %
    assert "assumed" in choice.explain()


def test_equal_cpu_prefers_the_faster_and_empty_input_raises():
    points = [_p("aio", 1024, 32, 1.0, 1.0, 20.0), _p("io_uring", 1024, 32, 1.01, 1.0, 20.0)]
    assert recommend(points, 0.05).pick.backend == "io_uring"
    with pytest.raises(ValueError, match="no points"):
        recommend([], 0.05)
