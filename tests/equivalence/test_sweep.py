"""The generated equivalence sweep (issue 26 part 3): combinations against plain PyTorch.

Every case trains a small ``transformers`` Llama a few steps through infinity
and in plain PyTorch and is judged by :func:`sweep_run.judge` (the tolerance
is torch's own noise measured in the same test). ``make test`` runs the kept
examples (cases that once failed), the pinned cases (every kind on each tier
at each world size) and a handful of drawn ones; ``INFINITY_SWEEP_SEED`` draws
another handful, and ``bench/equivalence_sweep.py`` draws hundreds.
"""

from __future__ import annotations

import os

import pytest
from sweep_cases import (
    AUTOCAST,
    EVALUATED,
    EXAMPLES,
    FP16,
    PINNED,
    RESUMED,
    Case,
    draw_cases,
)
from sweep_run import Outcome, check, run_case, run_two_ranks

pytest.importorskip("transformers")

SEED = int(os.environ.get("INFINITY_SWEEP_SEED", "26"))
DRAWN = 6
CASES: list[Case] = [
    *EXAMPLES, *PINNED, *RESUMED, *EVALUATED, *FP16, *AUTOCAST, *draw_cases(SEED, DRAWN)
]  # fmt: skip
WORLD1 = [c for c in CASES if c.world == 1]
WORLD2 = [c for c in CASES if c.world == 2]


@pytest.mark.parametrize("case", WORLD1, ids=Case.name)
def test_one_process_trains_like_plain_pytorch(case: Case, tmp_path) -> None:
    check(run_case(case, str(tmp_path)))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[Case, Outcome]:
    return run_two_ranks(WORLD2, str(tmp_path_factory.mktemp("sweep-w2")))


@pytest.mark.distributed
@pytest.mark.parametrize("case", WORLD2, ids=Case.name)
def test_two_ranks_train_like_plain_pytorch_on_the_whole_batch(
    case: Case, two_ranks: dict[Case, Outcome]
) -> None:
    check(two_ranks[case])


def _tiers(placements: list[dict[str, dict[str, int]]]) -> set[tuple[str, str]]:
    return {
        (kind, str(tier.value if hasattr(tier, "value") else tier))
        for placement in placements
        for kind, tiers in placement.items()
        for tier, count in tiers.items()
        if count
    }


EVERY = {(k, t) for k in ("param", "grad", "optim") for t in ("host", "nvme")}
# One process also homes chunks on the device (NOTE [chunks homed on the device]); a
# sharded plan never does.
EVERY_ALONE = EVERY | {(k, "device") for k in ("param", "grad", "optim")}


def test_pinned_cases_put_every_kind_on_each_tier_in_one_process(tmp_path) -> None:
    """The coverage the pinned cases promise, from the plans alone."""
    from sweep_train import build_model, config

    import infinity
    from infinity.offload import engine_of

    placements = []
    for case in [c for c in PINNED if c.world == 1]:
        model = build_model(case)
        model = infinity.offload(model, config(case, model, str(tmp_path)))
        placements.append(infinity.stats(model)["placement"])
        engine_of(model).close()
    assert _tiers(placements) == EVERY_ALONE


@pytest.mark.distributed
def test_pinned_cases_put_every_kind_on_each_tier_on_two_ranks(two_ranks) -> None:
    placements = [
        o.trained.placement for c, o in two_ranks.items() if c in PINNED and o.trained is not None
    ]
    assert _tiers(placements) == EVERY
