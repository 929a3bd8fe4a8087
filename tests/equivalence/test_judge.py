"""The sweep's judge fails what it exists to catch: a skipped update, a stale evaluation.

Each offloaded result here is made from plain PyTorch's own run, changed the way a
bug would change it, so the judge is checked against known answers.
"""

from __future__ import annotations

import dataclasses

import pytest
from sweep_cases import Case
from sweep_run import Outcome, judge
from sweep_train import Trained, _plain_eval, train_reference

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


def test_a_held_out_loss_past_the_step_is_not_taken_for_a_stale_one() -> None:
    # A stale evaluation lies towards the loss before the step; one past the step's
    # (bf16 moments on two ranks overshot by 0.84 of the movement) is bounded by the
    # whole movement, not half of it.
    case = Case(evaluate="no_grad")
    ref = train_reference(case)
    k = max(range(case.steps), key=lambda k: abs(ref.evals[k + 1] - ref.evals[k]))
    before, now = ref.evals[k], ref.evals[k + 1]
    assert abs(now - before) / abs(now) > 4 * 1e-5  # the step moves it beyond the floor

    def judged(fraction: float) -> bool:
        evals = list(ref.evals[1:])
        evals[k] = now + fraction * (now - before)  # > 0: past the step, < 0: towards before
        return judge(Outcome(case, trained=dataclasses.replace(ref, evals=evals))).ok

    assert judged(0.8)  # past the step, within its movement
    assert not judged(1.3)  # past the step by more than it moved
    assert not judged(-0.7)  # towards the loss before the step: stale


def test_the_last_evaluation_is_the_loss_of_the_run_s_own_final_weights() -> None:
    # Plain PyTorch on the run's final weights gives the last held-out loss to the bit;
    # a last evaluation that is not it saw other weights (a stale one), and one that is
    # it passes however far noise in the weights moved both from the reference's.
    case = Case(evaluate="no_grad")
    ref = train_reference(case)
    own = _plain_eval(case, ref.state)
    assert own == ref.evals[-1]
    before, now = ref.evals[-2], ref.evals[-1]
    noisy = now - 0.7 * (now - before)  # towards the loss before the step, as a stale one

    def judged(last: float, own_eval: float | None) -> bool:
        trained = dataclasses.replace(ref, evals=[*ref.evals[1:-1], last], own_eval=own_eval)
        return judge(Outcome(case, trained=trained)).ok

    assert judged(now, own)
    assert judged(noisy, noisy)  # the weights' own noise: their loss moved alike
    assert not judged(before, own)  # the evaluation saw the weights before the step
    verdict = judge(
        Outcome(
            case, trained=dataclasses.replace(ref, evals=[*ref.evals[1:-1], before], own_eval=own)
        )
    )
    assert "did not see them" in verdict.message
    assert not judged(noisy, None)  # without the run's own loss: the movement's bound
