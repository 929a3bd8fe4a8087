"""Run sweep cases (one process, or ranks of a gloo group) and judge them.

:func:`run_case` trains one case offloaded. A budget the planner refuses (the
fractions are of the model's bytes, and staging or a module's working set has
a floor) is raised to what the :class:`~infinity.PlanError` names and tried
again; the budgets actually used and the resulting placement are reported, so
a table of many cases shows what was covered, not what was asked for.

:func:`judge` trains the plain-PyTorch references and compares: the error of
the offloaded parameters against the reference must stay within a multiple
of the noise measured in the same call (sources of difference that have
nothing to do with infinity: torch's fused against its single-tensor AdamW, or
float64 against float32 update arithmetic for quantised moments, and
data-parallel gradient averaging), and that bound must itself be far below
what one optimizer step moves the parameters, so a stale or skipped update
cannot hide in it.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from dataclasses import dataclass, field

import torch
from sweep_cases import Case
from sweep_optimizers import step_size
from sweep_train import (
    ResumePlanError,
    Trained,
    build_model,
    element_size,
    host_bytes_per_param,
    rel_error,
    train_offloaded,
    train_reference,
)

import infinity

NOISE_MULTIPLE = 4.0
# Below this the noise measure is rounding-level in fp32; a bound there would
# flag FMA contraction differences of the fused kernel.
FLOOR = {"fp32": 1e-6, "bf16": 1e-4, "fp16": 1e-4}
# The bound must be at most this fraction of one step's movement (a skipped or
# stale update then fails; bf16 data parallel measures noise near a quarter of it).
MEANINGFUL = 0.5
# Held-out losses (Case.evaluate), relative: below this, both sides' losses differ by
# rounding (fp32: ~1e-7; bf16 computes with parameters rounded from masters that
# differ within the noise above: up to ~2.5e-5 measured).
EVAL_FLOOR = {"fp32": 1e-5, "bf16": 5e-5, "fp16": 5e-5}
# A last evaluation against plain PyTorch on the run's own weights (see _judge_evals).
OWN_TOLERANCE = 1e-6
PLAN_RETRIES = 8  # NOTE: with auto chunks a larger budget can plan larger chunks, needing more


# Quantised moments: the relative gap between neighbouring stored values (int8:
# 3 fraction bits; bf16: 7), and how many values rounded the other way the bound
# allows (see _rounding_floor).
RESOLUTION = {"bf16": 2.0**-7, "int8": 2.0**-3}
FLIPS = 4


def _rounding_floor(case: Case, ref: dict[str, torch.Tensor]) -> float:
    """The error of ``FLIPS`` moment values rounded to the neighbouring code.

    NOTE: a moment that lands within an ulp of a rounding boundary is rounded
    either way by arithmetic that differs only in FMA contraction (the kernel
    against torch ops), and each such value moves one parameter's later
    updates by about lr x the format's resolution. That happens to a handful of
    elements or none, so the noise measured from one other arithmetic is a
    lottery; this floor is what a few of them cost, far below one step.
    """
    norm = sum(float(v.double().pow(2).sum()) for v in ref.values()) ** 0.5
    if case.optimizer == "lion":
        # NOTE: Lion steps each weight by the sign of a sum; a sum within rounding of
        # zero flips it either way (any state dtype, fp32 too), moving that weight by
        # twice the learning rate (the momentum, fed by the gradient, is not moved).
        flips = float(FLIPS)
        if case.state_dtype == "bf16":
            # NOTE: a stochastically rounded momentum (NOTE [bf16 stochastic rounding])
            # differs from the reference's by up to one bf16 step (2^-8 of it), so the
            # sum's sign can differ wherever the sum is that close to zero: about that
            # share of the weights at each step after the first.
            count = sum(v.numel() for v in ref.values())
            flips = max(flips, count * RESOLUTION["bf16"] * (case.steps - 1))
        return flips**0.5 * 2 * step_size(case) / norm
    if case.state_dtype not in RESOLUTION:
        return 0.0
    per_value = step_size(case) * RESOLUTION[case.state_dtype] * case.steps
    if case.state_dtype == "bf16":
        # NOTE: bf16 state is rounded stochastically, the kernel's bits a hash of chunk
        # and offset, the reference's its own (NOTE [bf16 stochastic rounding]): every
        # element may round the other way at every store, each moving its parameter's
        # later updates by up to lr x the resolution. Still far below one step's movement.
        count = sum(v.numel() for v in ref.values())
        return count**0.5 * per_value / norm
    return FLIPS**0.5 * per_value / norm


@dataclass
class Outcome:
    """How one offloaded run ended (on one rank)."""

    case: Case
    trained: Trained | None = None
    error: str | None = None  # traceback text of a failure
    raised: list[str] = field(default_factory=list)  # budgets raised after PlanErrors


@dataclass
class Verdict:
    """A case judged against plain PyTorch."""

    case: Case
    ok: bool
    message: str
    error: float = float("nan")
    bound: float = float("nan")
    one_step: float = float("nan")
    placement: dict[str, dict[str, int]] = field(default_factory=dict)
    raised: list[str] = field(default_factory=list)


def _raise_budget(
    case: Case, exc: infinity.PlanError, params: int, resume: bool = False
) -> tuple[Case, str]:
    """The case with the budget ``exc`` names raised to what it says is needed (as a
    fraction again, so the case stays a Case); re-raises errors of other kinds.
    ``resume``: the budget of the model that resumes from the checkpoint."""
    text = str(exc)
    if text.startswith("host_memory"):
        base = params * host_bytes_per_param(case)
        field_name, old = "host", case.host_after if resume else case.host
    elif text.startswith("device_memory"):
        base = params * element_size(case)
        field_name, old = "device", case.device_after if resume else case.device
    else:
        raise exc
    if resume:
        field_name = f"resume_{field_name}"
    new = max(old * 1.25, 1.02 * exc.needed / base) if exc.needed else old * 1.6
    what = f"{field_name} {old:g} -> {new:.3g}"
    return dataclasses.replace(case, **{field_name: round(new, 4)}), what


def run_case(case: Case, nvme_dir: str, rank: int = 0) -> Outcome:
    """Train ``case`` offloaded on this process; never raises (see :class:`Outcome`)."""
    raised: list[str] = []
    tried = case
    params = sum(p.numel() for p in build_model(case).parameters())
    os.makedirs(nvme_dir, exist_ok=True)  # NOTE: infinity creates its folder inside, not above
    for _ in range(PLAN_RETRIES + 1):
        try:
            return Outcome(case, train_offloaded(tried, nvme_dir, rank), raised=raised)
        except (infinity.PlanError, ResumePlanError) as exc:
            resume = isinstance(exc, ResumePlanError)
            try:
                tried, what = _raise_budget(tried, getattr(exc, "error", exc), params, resume)
            except infinity.PlanError:
                return Outcome(case, error=traceback.format_exc(), raised=raised)
            raised.append(what)
        except Exception:
            return Outcome(case, error=traceback.format_exc(), raised=raised)
    return Outcome(case, error=f"no plan after raising budgets {raised}", raised=raised)


def rank_cases(rank: int, cases: list[Case], nvme_root: str) -> list[Outcome]:
    """Every case on this rank of a group (for ``harness.run_ranks``); rank 0 keeps states."""
    torch.set_num_threads(1)
    if any(case.backend == "fence" for case in cases):
        from infinity.devices import fence

        fence.load()  # NOTE: before this process's first backward (NOTE [the fence device])
    out = []
    for k, case in enumerate(cases):
        outcome = run_case(case, os.path.join(nvme_root, f"case-{k}"), rank)
        if rank != 0 and outcome.trained is not None:
            outcome.trained.state = {}
        out.append(outcome)
    return out


def check(outcome: Outcome) -> None:
    """Fail the test (an assertion naming the case, placement and budgets) unless
    ``outcome`` trained like plain PyTorch."""
    verdict = judge(outcome)
    assert verdict.ok, (
        f"{outcome.case}\nplacement {placement_label(verdict.placement)}, "
        f"budgets raised {verdict.raised}\n{verdict.message}"
    )


def run_two_ranks(cases: list[Case], root: str) -> dict[Case, Outcome]:
    """Every 2-rank case of ``cases``, trained by two gloo ranks (rank 0's outcomes)."""
    from harness import run_ranks

    outcomes = run_ranks(rank_cases, cases, root, timeout=120.0 + 40.0 * len(cases))[0]
    return dict(zip(cases, outcomes, strict=True))


def judge(outcome: Outcome) -> Verdict:
    """Compare one offloaded run with plain PyTorch (see the module docstring)."""
    case = outcome.case
    if outcome.trained is None:
        return Verdict(case, False, f"training failed:\n{outcome.error}", raised=outcome.raised)
    ref = train_reference(case)
    ref.state = _judged(case, ref.state)

    def off(variant: str = "single", steps: int | None = None) -> float:
        return rel_error(
            _judged(case, train_reference(case, variant=variant, steps=steps).state), ref.state
        )

    noise = off("fused")
    if case.world > 1:
        noise = max(noise, off("halves"))
    if case.loss_block:
        noise = max(noise, off("blocks"))
    one_step = off(steps=case.steps - 1)
    bound = max(NOISE_MULTIPLE * noise, FLOOR[case.dtype], _rounding_floor(case, ref.state))
    error = rel_error(_judged(case, outcome.trained.state), ref.state)
    verdict = Verdict(
        case,
        False,
        "",
        error=error,
        bound=bound,
        one_step=one_step,
        placement=outcome.trained.placement,
        raised=outcome.raised,
    )
    trained = outcome.trained
    if trained.over_limits:
        verdict.message = "memory lines over their limits: " + "; ".join(trained.over_limits)
    elif trained.device_forecast is not None and not trained.device_peak <= trained.device_forecast:
        verdict.message = (
            f"the device held {trained.device_peak} bytes at once, above the forecast "
            f"{trained.device_forecast} (its budget's slots + buffers + the step's working set"
            " + the libraries' workspaces)"
        )
    elif bound > MEANINGFUL * one_step:
        verdict.message = (
            f"the tolerance {bound:.2e} (noise {noise:.2e}) is not below {MEANINGFUL} of one "
            f"step's movement {one_step:.2e}: this case cannot tell a missed update"
        )
    elif not error <= bound:
        verdict.message = (
            f"parameters off plain PyTorch by {error:.2e} (relative), bound {bound:.2e} "
            f"(noise {noise:.2e}); losses {outcome.trained.losses} vs {ref.losses}"
        )
    else:
        stale = _judge_evals(case, outcome.trained.evals, ref.evals, outcome.trained.own_eval)
        verdict.ok = stale is None
        verdict.message = stale or f"error {error:.2e} <= {bound:.2e}"
    return verdict


def _judged(case: Case, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters the error is measured on.

    NOTE: GPT-2's key bias (the middle third of each ``c_attn`` bias) has a gradient
    that is zero up to rounding (softmax ignores a shift of every score of a row).
    Adam and Lion normalise it into a full step in the direction the rounding
    points, which any other arithmetic flips: 94% of the noise of a 2-rank bf16 GPT-2
    case, past half a step's movement. It is left out of every error alike.
    """
    if case.model != "gpt2":
        return state
    out = dict(state)
    for name, value in state.items():
        if name.endswith("attn.c_attn.bias"):
            out[name] = torch.cat([value[: case.hidden], value[2 * case.hidden :]])
    return out


def _judge_evals(
    case: Case, ours: list[float], ref: list[float], own: float | None = None
) -> str | None:
    """None if every held-out loss of ``case.evaluate`` matches the reference's.

    NOTE: an evaluation that saw the weights of the step before (an update still
    queued, trailing or deferred when the validation forward ran) is off by that
    step's movement of the loss, towards the loss before it: a loss off that way is
    bounded by half the movement, never below the rounding floor; a case where no
    step's bound is above that floor cannot tell. A loss off the other way (past
    the step's) cannot be a stale evaluation; it is bounded by the whole movement
    (two ranks in bf16 with bf16 moments overshot by 0.84 of it, sweep seed 6262,
    their weights well inside their bound), never below the floor.

    The last evaluation (but on CUDA, where it is not checked bit for bit here) is
    judged exactly instead: it must be ``own``, the loss plain PyTorch computes on
    the run's final weights on the same device, within :data:`OWN_TOLERANCE` (it
    is, bit for bit, on the CPU and the fence). A stale one is then told wherever
    the last step moved the run's own loss beyond that; noise in the weights, judged
    by their own bound, moves both alike (seed 5802: a bf16 Lion case 0.62 of a
    step's movement towards the loss before it, equal to its own weights' loss to
    the bit).
    """
    if not case.evaluate:
        return None
    if len(ours) != case.steps or len(ref) != case.steps + 1:
        return f"{len(ours)} held-out losses for {case.steps} steps (reference: {len(ref)} - 1)"
    # NOTE: an fp32 case evaluated (or trained) under bf16 autocast computes its loss
    # in bf16: its rounding floor is bf16's (seed 5502: 3.7e-5 off, weights 4x inside).
    bf16_forward = case.evaluate == "autocast" or case.autocast
    floor = EVAL_FLOOR["bf16" if case.dtype == "fp32" and bf16_forward else case.dtype]
    telling = False
    exact = own is not None and case.backend != "cuda"
    for k, loss in enumerate(ours):
        if exact and k == len(ours) - 1:
            assert own is not None
            if abs(loss - own) > OWN_TOLERANCE * abs(own):
                return (
                    f"held-out loss after step {k + 1} ({case.evaluate}) is {loss!r}, but plain "
                    f"PyTorch on this run's own final weights gives {own!r}: the evaluation "
                    f"did not see them; all: {ours}"
                )
            earlier = ours[k - 1] if k else ref[0]
            telling |= abs(loss - earlier) > 2 * OWN_TOLERANCE * abs(own)
            continue
        now, before = ref[k + 1], ref[k]
        moved = abs(now - before) / abs(now)
        telling |= 0.5 * moved >= floor
        stale_side = (loss - now) * (before - now) > 0
        bound = max((0.5 if stale_side else 1.0) * moved, floor)
        if not abs(loss - now) / abs(now) <= bound:
            return (
                f"held-out loss after step {k + 1} ({case.evaluate}) is {loss!r}, plain PyTorch "
                f"{now!r} (relative {abs(loss - now) / abs(now):.2e}, bound {bound:.2e}; the "
                f"step before gave {before!r}); all: {ours} vs {ref[1:]}"
            )
    if not telling:
        return f"no step moved the held-out loss beyond {2 * floor:.1e}: cannot tell a stale one"
    return None


def placement_label(placement: dict[str, dict[str, int]]) -> str:
    """Where each kind's chunks lived, e.g. ``param:host grad:mixed optim:nvme``."""
    parts = []
    for kind, tiers in placement.items():
        host, nvme = tiers.get("host", 0), tiers.get("nvme", 0)
        where = "host" if not nvme else "nvme" if not host else "mixed"
        parts.append(f"{kind}:{where}")
    return " ".join(parts)
