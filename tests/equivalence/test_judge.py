"""The sweep's judge fails what it exists to catch: a skipped update, a stale evaluation.

Each offloaded result here is made from plain PyTorch's own run, changed the way a
bug would change it, so the judge is checked against known answers.
"""

from __future__ import annotations

import dataclasses

import pytest
from sweep_cases import Case
from sweep_run import Outcome, judge
from sweep_train import Trained, train_reference

pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_reference_itself_passes_and_a_stale_evaluation_fails(dtype: str, mode: str) -> None:
    case = Case(dtype=dtype, evaluate=mode)
    ref = train_reference(case)
    assert len(ref.evals) == case.steps + 1  # the loss before the first step, then each step's
    ours = dataclasses.replace(ref, evals=ref.evals[1:])
    assert judge(Outcome(case, trained=ours)).ok
    # Every evaluation saw the weights of the step before (an update still queued).
    stale = dataclasses.replace(ref, evals=ref.evals[:-1])
    verdict = judge(Outcome(case, trained=stale))
    assert not verdict.ok and "held-out loss after step 1" in verdict.message
    # Only the last one did.
    late = dataclasses.replace(ref, evals=[*ref.evals[1:-1], ref.evals[-2]])
    verdict = judge(Outcome(case, trained=late))
    assert not verdict.ok and f"after step {case.steps}" in verdict.message


def test_a_skipped_last_update_fails() -> None:
    case = Case()
    ref = train_reference(case)
    short = train_reference(case, steps=case.steps - 1)
    verdict = judge(Outcome(case, trained=Trained(short.state, ref.losses)))
    assert not verdict.ok and "parameters off plain PyTorch" in verdict.message
