"""`infinity bench optim` runs end to end on a tiny size and reports what it promises;
`infinity bench adam` still runs, as its alias."""

from __future__ import annotations

import json

import pytest

from infinity.cli.main import main

TINY = ["--size", "64K", "--threads", "2", "--repeats", "2", "--json"]


def _report(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_optim_times_every_optimizer_against_torch(capsys: pytest.CaptureFixture[str]):
    assert main(["bench", "optim", *TINY]) == 0
    out = capsys.readouterr().out
    report = _report(out)
    assert report["params"] == 65536 and report["threads"] == 2 and report["repeats"] == 2
    assert report["optimizers"] == ["adam", "lion", "sgd"]
    assert report["bytes_per_param"] == {"adam": 28, "lion": 20, "sgd": 20}
    assert report["roofline_gbps"] > 0 and set(report["probes_gbps"]) >= {"triad", "axpy"}
    want = {
        f"{o} {side} {p}"
        for o in ("adam", "lion", "sgd")
        for side in ("ours", "torch")
        for p in ("fp32", "mixed")
    }
    assert set(report["results"]) == want
    for result in report["results"].values():
        assert result["gparams_per_s"] > 0 and result["gbps"] > 0
        assert result["roofline_fraction"] > 0
    assert set(report["ours_vs_torch"]) == {
        f"{o} {p}" for o in ("adam", "lion", "sgd") for p in ("fp32", "mixed")
    }
    assert all(ratio > 0 for ratio in report["ours_vs_torch"].values())
    assert report["isa"] in ("avx512", "avx2", "scalar")
    # The table came first, naming each torch counterpart.
    for label in ("torch AdamW(fused=True)", "Lion in torch ops", "torch SGD(foreach=True)"):
        assert label in out, label


def test_bench_optim_picks_optimizers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "optim", "--optimizers", "sgd,lion", *TINY]) == 0
    report = _report(capsys.readouterr().out)
    assert report["optimizers"] == ["sgd", "lion"]
    assert {r["optimizer"] for r in report["results"].values()} == {"sgd", "lion"}


def test_bench_adam_is_an_alias_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "adam", *TINY]) == 0
    captured = capsys.readouterr()
    report = _report(captured.out)
    assert report["optimizers"] == ["adam"]
    note = captured.err.strip().splitlines()
    assert len(note) == 1 and "infinity bench optim --optimizers adam" in note[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["--size", "lots"],
        ["--size", "0"],
        ["--repeats", "0"],
        ["--threads", "0"],
        ["--isa", "sse9"],
        ["--optimizers", "adagrad"],
        ["--optimizers", "adam,adam"],
        ["--optimizers", ","],
    ],
    ids=[
        "bad-size",
        "zero-size",
        "zero-repeats",
        "zero-threads",
        "bad-isa",
        "unknown-optimizer",
        "repeated-optimizer",
        "no-optimizer",
    ],
)
def test_bench_optim_rejects_bad_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "optim", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("infinity: error:") and len(err.strip().splitlines()) == 1


def test_bench_optim_forced_isa(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "optim", "--optimizers", "lion", "--size", "4K", "--repeats", "1"]
    assert main([*argv, "--isa", "scalar", "--json"]) == 0
    assert _report(capsys.readouterr().out)["isa"] == "scalar"
