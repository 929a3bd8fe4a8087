"""The generated equivalence sweep on the fence device (NOTE [the fence device]).

Every kept example, every pinned, resumed, evaluated and fp16 case, and a drawn
slice, trained through infinity computing on the fence and judged against plain
PyTorch computing on the fence (the CPU's arithmetic), as ``tests/cuda`` judges
them on a GPU. A host tensor reaching device compute anywhere on the way (a
batch, a weight on any route, a recomputed block, a resumed model, a gathered
shard on two ranks) fails here as it would on CUDA.
"""

from __future__ import annotations

import os

import pytest
from sweep_cases import EVALUATED, EXAMPLES, FP16, PINNED, RESUMED, Case, draw_cases
from sweep_run import Outcome, check, run_case, run_two_ranks

pytest.importorskip("transformers")

SEED = int(os.environ.get("INFINITY_FENCE_SWEEP_SEED", "40"))
DRAWN = 12
CASES = [
    c.on("fence")
    for c in [*EXAMPLES, *PINNED, *RESUMED, *EVALUATED, *FP16, *draw_cases(SEED, DRAWN)]
]
WORLD1 = [c for c in CASES if c.world == 1]
WORLD2 = [c for c in CASES if c.world == 2]


def test_the_slice_takes_the_direct_route_and_every_dtype():
    """What the slice promises to cover on the fence (so a change to the case lists
    cannot quietly drop it)."""
    assert any(c.nvme_direct for c in WORLD1)
    assert {c.dtype for c in CASES} == {"fp32", "bf16", "fp16"}
    assert {c.activations for c in CASES} >= {"keep", "checkpoint", "offload"}
    assert any(c.resume_at for c in CASES) and any(c.evaluate for c in CASES)


@pytest.mark.parametrize("case", WORLD1, ids=Case.name)
def test_one_process_on_the_fence_trains_like_plain_pytorch(case: Case, tmp_path) -> None:
    check(run_case(case, str(tmp_path)))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[Case, Outcome]:
    return run_two_ranks(WORLD2, str(tmp_path_factory.mktemp("fence-w2")))


@pytest.mark.distributed
@pytest.mark.parametrize("case", WORLD2, ids=Case.name)
def test_two_gloo_ranks_on_the_fence_train_like_plain_pytorch(
    case: Case, two_ranks: dict[Case, Outcome]
) -> None:
    check(two_ranks[case])
