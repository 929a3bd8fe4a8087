"""The generated equivalence sweep at scale: hundreds of drawn cases against plain PyTorch.

python bench/equivalence_sweep.py [--cases 200] [--seed 0] [--world 1|2|both] [--json FILE]

Each case (``tests/equivalence/sweep_cases.py``: world size, budgets that put
each kind on each tier, tied/untied, fp32/bf16, accumulation, clipping, the
overlapped step, optimizer, state dtype, chunk size, beta2, a resume from a
checkpoint into other budgets, parameter groups with a schedule, frozen layers,
a validation loss after every step)
trains a small ``transformers`` Llama a few steps through infinity and in plain PyTorch, and
is judged by ``tests/equivalence/sweep_run.judge``. World-size-2 cases run in
one pair of gloo processes. Prints one row per case, then what the sweep
covered (cases per feature value, and chunks per kind and tier), and exits 1
if any case failed: a failing case belongs in ``sweep_cases.EXAMPLES``.
``make test`` runs the examples and a handful of drawn cases.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("tests/equivalence", "tests/optim", "tests/distributed"):
    sys.path.insert(0, os.path.join(ROOT, sub))

import torch  # noqa: E402
from harness import run_ranks  # noqa: E402
from sweep_cases import Case, draw_cases  # noqa: E402
from sweep_run import Outcome, Verdict, judge, placement_label, rank_cases, run_case  # noqa: E402

FEATURES = (
    "world",
    "dtype",
    "state_dtype",
    "tied",
    "accumulation",
    "clip",
    "overlap",
    "chunk_size",
    "host",
    "device",
    "betas",
    "optimizer",
    "defer_host",
    "nvme_direct",
    "resumes",
    "recipe",
    "frozen",
    "evaluate",
    "model",
)


def run_all(cases: list[Case], root: str) -> list[Outcome]:
    """Offloaded runs: world-1 cases here, world-2 cases in one pair of ranks."""
    outcomes: dict[int, Outcome] = {}
    pairs = [(k, c) for k, c in enumerate(cases) if c.world == 2]
    for k, case in enumerate(cases):
        if case.world == 1:
            started = time.perf_counter()
            outcomes[k] = run_case(case, os.path.join(root, f"w1-{k}"))
            print(f"  trained {case.name()} ({time.perf_counter() - started:.1f} s)", flush=True)
    if pairs:
        started = time.perf_counter()
        ranks = run_ranks(
            rank_cases,
            [c for _, c in pairs],
            os.path.join(root, "w2"),
            timeout=120.0 + 40.0 * len(pairs),
        )
        for (k, _), outcome in zip(pairs, ranks[0], strict=True):
            outcomes[k] = outcome
        print(f"  trained {len(pairs)} world-2 cases ({time.perf_counter() - started:.0f} s)")
    return [outcomes[k] for k in range(len(cases))]


def coverage(verdicts: list[Verdict]) -> str:
    """Cases per feature value, and chunks per (kind, tier) over all cases."""
    lines = ["covered:"]
    for name in FEATURES:
        counts = collections.Counter(str(getattr(v.case, name)) for v in verdicts)
        lines.append(f"  {name:13s} " + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())))
    tiers: collections.Counter[str] = collections.Counter()
    for v in verdicts:
        for kind, where in v.placement.items():
            for tier, n in where.items():
                tiers[f"{kind}@{tier}"] += n
    lines.append("  chunks       " + ", ".join(f"{k}: {n}" for k, n in sorted(tiers.items())))
    labels = collections.Counter(placement_label(v.placement) for v in verdicts if v.placement)
    for label, n in labels.most_common():
        lines.append(f"  {n:4d} cases  {label}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="cases to draw")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw")
    parser.add_argument("--world", choices=("1", "2", "both"), default="both")
    parser.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="FEATURE=VALUE",
        help="keep only drawn cases with this feature value (e.g. nvme_direct=True); repeatable",
    )
    parser.add_argument("--json", help="also write every verdict to this file")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    cases = draw_cases(args.seed, args.cases)
    if args.world != "both":
        cases = [c for c in cases if c.world == int(args.world)]
    for condition in args.where:
        name, _, value = condition.partition("=")
        if name not in Case.__dataclass_fields__ and not isinstance(
            getattr(Case, name, None), property
        ):
            parser.error(f"--where {condition}: {name!r} is not a case feature")
        cases = [c for c in cases if str(getattr(c, name)) == value]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="infinity-sweep-") as root:
        outcomes = run_all(cases, root)
    verdicts = [judge(o) for o in outcomes]
    print(f"\n{'case':72s} {'placement':36s} {'error':>9s} {'bound':>9s}  result")
    for v in verdicts:
        mark = "ok" if v.ok else "FAIL"
        raised = f" (raised {', '.join(v.raised)})" if v.raised else ""
        print(
            f"{v.case.name():72s} {placement_label(v.placement):36s} "
            f"{v.error:9.2e} {v.bound:9.2e}  {mark}{raised}"
        )
    failed = [v for v in verdicts if not v.ok]
    for v in failed:
        print(f"\nFAILED {v.case}\n{v.message}")
    print("\n" + coverage(verdicts))
    print(
        f"\n{len(verdicts) - len(failed)} passed, {len(failed)} failed "
        f"({time.perf_counter() - started:.0f} s, seed {args.seed})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {
                        "case": v.case.as_dict(),
                        "ok": v.ok,
                        "error": v.error,
                        "bound": v.bound,
                        "one_step": v.one_step,
                        "placement": v.placement,
                        "raised": v.raised,
                        "message": v.message,
                    }
                    for v in verdicts
                ],
                f,
                indent=1,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
