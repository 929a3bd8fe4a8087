"""``infinity bench adam``: CPU-Adam throughput against torch and the memory roofline.

Contenders, all on the same buffers and thread count, timed in interleaved
rounds so background load hits them alike:

- ``ours fp32``: :func:`infinity.optim.kernels.adam_step`, fp32 gradients.
- ``ours mixed``: bf16 gradients in, fp32 master and moments, bf16 params out.
- ``torch fused fp32``: ``torch.optim.AdamW(fused=True)``.
- ``torch mixed``: torch's best composition for the mixed case: upcast the
  bf16 gradients into the fp32 ``.grad``, fused AdamW, copy params to bf16.
- memory-bandwidth probes from the native module, on the same pool of
  threads: a STREAM triad (``a = b + s*c``), an in-place axpy (``a += s*b``),
  and the Adam access pattern without arithmetic (``p += g; m += g; v += g``:
  4 streams read, 3 written), without and with the kernel's software
  prefetch. The fastest probe is the roofline.

Bytes moved per parameter (what a step must read and write, the STREAM
convention): fp32 reads p, g, m, v and writes p, m, v: 7 x 4 = 28 B; mixed
reads p, m, v (4 B) and g (2 B), writes p, m, v and the bf16 copy: also 28 B.
Torch's mixed composition is credited with the same 28 B (it moves more).
``--isa`` forces the kernel's instruction set (e.g. ``avx2`` to see what a
machine without AVX-512 would get).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

from infinity._native import native
from infinity._native.adam import BANDWIDTH_KERNELS
from infinity.cli.main import CommandError
from infinity.optim import kernels
from infinity.utils.sizes import parse_size

BYTES_PER_PARAM = {"fp32": 28, "mixed": 28}
# Bytes of memory one parameter needs in this benchmark: p, g, m, v and
# torch's m, v in fp32, plus bf16 gradients and bf16 output.
_FOOTPRINT_PER_PARAM = 6 * 4 + 2 * 2
_HYPER: dict[str, Any] = {
    "lr": 1e-3,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.01,
}
# name -> (native kind, bytes per element); see cpp/adam/bandwidth.hpp
_PROBE_BYTES = {"triad": 12, "axpy": 12, "adam_pattern": 28, "adam_prefetch": 28}
_PROBES = {name: (BANDWIDTH_KERNELS[name], nbytes) for name, nbytes in _PROBE_BYTES.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``infinity bench adam``."""
    parser.add_argument(
        "--size",
        default="64M",
        help="parameters per step: a count with an optional binary suffix, "
        "K/M/G = 2^10/2^20/2^30 (64M = 67,108,864 parameters); default 64M",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for every contender, ours and torch's (default: physical cores)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds after one warm-up (default 5)"
    )
    parser.add_argument(
        "--isa",
        default="auto",
        help="kernel instruction set: auto (widest available), avx512, avx2 or scalar",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on the last line"
    )


def _parse_args(args: argparse.Namespace) -> tuple[int, int, int]:
    try:
        n = parse_size(args.size, name="--size")
    except ValueError:
        raise CommandError(
            f"--size={args.size!r} is not a parameter count; use e.g. 64M "
            "(= 64 x 2^20 parameters), 1G or 500000"
        ) from None
    if n < 1:
        raise CommandError(f"--size={args.size!r} must be at least 1 parameter")
    threads = kernels.default_num_threads() if args.threads is None else args.threads
    if threads < 1:
        raise CommandError(f"--threads={threads} must be >= 1")
    if args.repeats < 1:
        raise CommandError(f"--repeats={args.repeats} must be >= 1")
    if args.isa != "auto" and args.isa not in kernels.available_isas():
        raise CommandError(
            f"--isa={args.isa!r} is not available on this CPU; "
            f"choose auto or one of {', '.join(kernels.available_isas())}"
        )
    need, have = n * _FOOTPRINT_PER_PARAM, psutil.virtual_memory().available
    if need > 0.8 * have:
        raise CommandError(
            f"--size={args.size} needs ~{need / 2**30:.1f} GiB of RAM, "
            f"only {have / 2**30:.1f} GiB is available; use a smaller --size"
        )
    return n, threads, args.repeats


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _contenders(n: int) -> dict[str, Callable[[], object]]:
    """The timed closures; they share buffers to keep the footprint at ~28 B/param."""
    # NOTE: uniform [0, 1) values keep every intermediate a normal float:
    # subnormals would trigger microcode assists and time something else.
    p, g, m, v = (torch.rand(n) for _ in range(4))
    g16 = torch.rand(n).to(torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    step = {"ours": 0}

    def ours(grad: torch.Tensor, out: torch.Tensor | None) -> None:
        step["ours"] += 1
        kernels.adam_step(p, grad, m, v, step=step["ours"], out16=out, **_HYPER)

    # torch's optimizer steps the same parameter tensor with its own moments
    # (allocated at its first step); `.grad` is the fp32 gradient buffer.
    p.grad = g
    opt = torch.optim.AdamW(
        [p], lr=_HYPER["lr"], betas=(_HYPER["beta1"], _HYPER["beta2"]), eps=_HYPER["eps"],
        weight_decay=_HYPER["weight_decay"], fused=True,
    )  # fmt: skip

    def torch_mixed() -> None:
        g.copy_(g16)
        opt.step()
        out16.copy_(p)

    adam = native().adam

    def probe(kind: int) -> Callable[[], object]:
        # NOTE: the probes reuse the Adam buffers; `p += g`-style passes keep
        # the values normal floats, so the Adam timings are unaffected.
        return lambda: adam.bandwidth_probe(
            kind, p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n
        )

    return {
        **{f"probe {name}": probe(kind) for name, (kind, _) in _PROBES.items()},
        "ours fp32": lambda: ours(g, None),
        "torch fused fp32": opt.step,
        "ours mixed": lambda: ours(g16, out16),
        "torch mixed": torch_mixed,
    }


def _measure(n: int, threads: int, repeats: int) -> dict[str, list[float]]:
    saved_threads = (kernels.get_num_threads(), torch.get_num_threads())
    kernels.set_num_threads(threads)
    torch.set_num_threads(threads)
    try:
        fns = _contenders(n)
        for fn in fns.values():  # warm-up: page faults, torch's state allocation
            fn()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                times[name].append(_timed(fn))
        return times
    finally:
        kernels.set_num_threads(saved_threads[0])
        torch.set_num_threads(saved_threads[1])


def _report(n: int, threads: int, repeats: int, times: dict[str, list[float]]) -> dict:
    probes = {
        name: nbytes * n / min(times[f"probe {name}"]) / 1e9
        for name, (_, nbytes) in _PROBES.items()
    }
    roofline = max(probes.values())
    results = {}
    for name in ("ours fp32", "torch fused fp32", "ours mixed", "torch mixed"):
        best, median = min(times[name]), statistics.median(times[name])
        gbps = BYTES_PER_PARAM[name.split()[-1]] * n / best / 1e9
        results[name] = {
            "gparams_per_s": n / best / 1e9,
            "gparams_per_s_median": n / median / 1e9,
            "gbps": gbps,
            "roofline_fraction": gbps / roofline,
        }
    speed = {name: r["gparams_per_s"] for name, r in results.items()}
    return {
        "params": n,
        "threads": threads,
        "repeats": repeats,
        "isa": kernels.active_isa(),
        "bytes_per_param": BYTES_PER_PARAM,
        "probes_gbps": probes,
        "roofline_gbps": roofline,
        "results": results,
        "fp32_vs_torch_fused": speed["ours fp32"] / speed["torch fused fp32"],
        "mixed_vs_torch": speed["ours mixed"] / speed["torch mixed"],
        "fp32_roofline_fraction": results["ours fp32"]["roofline_fraction"],
        "mixed_roofline_fraction": results["ours mixed"]["roofline_fraction"],
    }


def _print_table(report: dict) -> None:
    n = report["params"]
    print(
        f"infinity bench adam: {n:,} parameters, {report['threads']} threads, "
        f"best of {report['repeats']} rounds, kernel ISA {report['isa']}"
    )
    print(
        f"{'contender':<34}{'Gparams/s':>10}{'(median)':>10}{'GB/s':>8}{'roofline':>10}{'ratio':>8}"
    )
    for name, gbps in report["probes_gbps"].items():
        fraction = gbps / report["roofline_gbps"]
        print(f"{'memory probe: ' + name:<34}{'':>20}{gbps:>8.1f}{fraction:>10.0%}")
    ratios = {"ours fp32": report["fp32_vs_torch_fused"], "ours mixed": report["mixed_vs_torch"]}
    labels = {
        "ours fp32": "ours fp32",
        "torch fused fp32": "torch AdamW(fused=True) fp32",
        "ours mixed": "ours mixed (bf16 grad/param out)",
        "torch mixed": "torch upcast + fused + bf16 copy",
    }
    for name, r in report["results"].items():
        ratio = f"{ratios[name]:.2f}x" if name in ratios else ""
        print(
            f"{labels[name]:<34}{r['gparams_per_s']:>10.3f}{r['gparams_per_s_median']:>10.3f}"
            f"{r['gbps']:>8.1f}{r['roofline_fraction']:>10.0%}{ratio:>8}"
        )
    print(
        f"bytes/param: {report['bytes_per_param']['fp32']} (fp32 and mixed); "
        f"roofline {report['roofline_gbps']:.1f} GB/s; ratio = ours / torch, same run"
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table, and with ``--json`` one JSON object on the last line."""
    n, threads, repeats = _parse_args(args)
    kernels.force_isa(None if args.isa == "auto" else args.isa)
    try:
        report = _report(n, threads, repeats, _measure(n, threads, repeats))
    finally:
        kernels.force_isa(None)
    _print_table(report)
    if args.json:
        print(json.dumps(report))
    return 0
