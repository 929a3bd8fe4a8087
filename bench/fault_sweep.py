"""Full fault-injection sweep: fail the n-th I/O for every n of a short training run.

For each case (backend x fault kind, plus the buffered fallback and the
overlapped optimizer), every n from 1 to just past the fault-free run's count
of I/Os (requests, pieces, or batch submissions) is run once; each run must
raise ``NVMeIOError`` or end with every parameter and optimizer-state home
bit-identical to the fault-free run. ``tests/engine/test_io_faults.py`` runs a
sample of the same property in ``make test``.

The case ``activations/eio`` fails the n-th request of the activations' own I/O
engine (``activations="offload"``, every saved tensor on NVMe) for n = 1, 2, ...
until 10 runs in a row end identical (the faults fell past the run's last
request); ``tests/activations/test_faults.py`` runs a sample in ``make test``.

    PYTHONPATH=. python bench/fault_sweep.py                  # every case, every n
    PYTHONPATH=. python bench/fault_sweep.py --cases io_uring/eio threads/short --stride 5

Exit status 1 if any run violated the property.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "activations"))

import torch
from fault_harness import Case, check, fired, run

from infinity.io import available_backends


def all_cases() -> list[Case]:
    """Every backend with every fault kind, plus the buffered and overlapped variants."""
    backends = available_backends()
    cases = []
    for backend in backends:
        for kind in ("eio", "enospc", "eio-piece", "short"):
            cases.append(Case(backend, kind))
        if backend != "threads":  # the thread pool submits no batches
            cases.append(Case(backend, "submit"))
            cases.append(Case(backend, "submit-eagain"))
    cases.append(Case(backends[-1], "eio", buffered=True))
    cases.append(Case(backends[-1], "short", buffered=True))
    cases.append(Case(backends[0], "eio", overlap=True))
    cases.append(Case(backends[0], "eio", homes=True))
    cases.append(Case(backends[0], "short", homes=True))
    return cases


def sweep(case: Case, stride: int) -> dict:
    """Run every n (every ``stride``-th) of one case; returns its counts."""
    ref = run(Case(case.backend, "eio", case.buffered, case.overlap, case.homes))
    if ref.error is not None:
        raise SystemExit(f"{case}: the fault-free run failed: {ref.error}")
    if case.kind.startswith("submit"):
        total = ref.requests // 2  # batches of one or more requests each
    elif case.kind in ("eio-piece", "short"):
        total = ref.pieces + 5
    else:
        total = ref.requests + 5  # a few past the end: I/O counts vary a little
    counts = {"runs": 0, "raised": 0, "identical": 0, "not fired": 0, "failures": 0}
    start = time.monotonic()
    for nth in range(1, total + 1, stride):
        outcome = run(case, nth)
        counts["runs"] += 1
        try:
            verdict = check(outcome, ref)
        except AssertionError as exc:
            counts["failures"] += 1
            print(f"  FAIL {case} n={nth}: {exc}", flush=True)
            continue
        counts[verdict] += 1
        if verdict == "identical" and fired(case, nth, outcome) is False:
            counts["not fired"] += 1
        if counts["runs"] % 25 == 0:
            print(f"  {case}: n={nth}/{total} {counts}", flush=True)
    counts["seconds"] = round(time.monotonic() - start, 1)
    counts["I/Os"] = f"{ref.reads}r+{ref.writes}w ({ref.pieces} pieces)"
    return counts


ACTIVATIONS = "activations/eio"


def sweep_activations(stride: int) -> dict:
    """Fail the n-th activation request, for n = 1, 1 + stride, ... (see the docstring)."""
    import tempfile

    from test_faults import _run as run_activations

    counts = {"runs": 0, "raised": 0, "identical": 0, "not fired": 0, "failures": 0}
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        clean = run_activations(f"{tmp}/clean", 0)
        assert clean is not None, "the fault-free run failed"
        streak, nth = 0, 1
        while streak < 10:
            got = run_activations(f"{tmp}/n{nth}", nth)
            counts["runs"] += 1
            if got is None:
                counts["raised"] += 1
                streak = 0
            elif all(torch.equal(got[k], v) for k, v in clean.items()):
                counts["identical"] += 1
                streak += 1
            else:
                counts["failures"] += 1
                streak = 0
                print(f"  FAIL {ACTIVATIONS} n={nth}: weights differ silently", flush=True)
            nth += stride
    counts["seconds"] = round(time.monotonic() - start, 1)
    counts["I/Os"] = f"about {nth - 10 * stride} requests"
    return counts


def main() -> int:
    """Run the sweep and print a summary table."""
    # NOTE: the model is tiny: one compute thread is ~10x faster than a pool
    # contending for the cores with the I/O workers.
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="e.g. io_uring/eio threads/short+buffered")
    parser.add_argument("--stride", type=int, default=1, help="run every k-th n (default 1)")
    args = parser.parse_args()
    cases: list = [*all_cases(), ACTIVATIONS]
    if args.cases:
        known = {str(c): c for c in cases}
        unknown = [name for name in args.cases if name not in known]
        if unknown:
            parser.error(f"unknown case(s) {unknown}; known: {', '.join(known)}")
        cases = [known[name] for name in args.cases]
    rows = []
    for case in cases:
        print(f"{case} ...", flush=True)
        counts = sweep_activations(args.stride) if case == ACTIVATIONS else sweep(case, args.stride)
        rows.append((str(case), counts))
    columns = ["runs", "raised", "identical", "not fired", "failures", "seconds", "I/Os"]
    print()
    print(f"{'case':28}" + "".join(f"{c:>12}" for c in columns[:-1]) + "  fault-free I/Os")
    for name, counts in rows:
        cells = "".join(f"{counts[c]!s:>12}" for c in columns[:-1])
        print(f"{name:28}{cells}  {counts['I/Os']}")
    totals = {c: sum(counts[c] for _, counts in rows) for c in columns[1:5]}
    runs = sum(counts["runs"] for _, counts in rows)
    print(f"{'total':28}{runs:>12}" + "".join(f"{totals[c]:>12}" for c in columns[1:5]))
    return 1 if totals["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
