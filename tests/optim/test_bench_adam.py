"""`infinity bench adam` runs end to end on a tiny size and reports what it promises."""

from __future__ import annotations

import json

import pytest

from infinity.cli.main import main


def test_bench_adam_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "adam", "--size", "64K", "--threads", "2", "--repeats", "2", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["params"] == 65536 and report["threads"] == 2 and report["repeats"] == 2
    for key in ("fp32_vs_torch_fused", "mixed_vs_torch", "fp32_roofline_fraction",
                "mixed_roofline_fraction", "roofline_gbps"):  # fmt: skip
        assert report[key] > 0
    assert set(report["results"]) == {"ours fp32", "torch fused fp32", "ours mixed", "torch mixed"}
    for result in report["results"].values():
        assert result["gparams_per_s"] > 0 and result["gbps"] > 0
    assert report["isa"] in ("avx512", "avx2", "scalar")
    assert "ours fp32" in out and "torch AdamW(fused=True)" in out  # the table came first


@pytest.mark.parametrize(
    "argv",
    [
        ["--size", "lots"],
        ["--size", "0"],
        ["--repeats", "0"],
        ["--threads", "0"],
        ["--isa", "sse9"],
    ],
    ids=["bad-size", "zero-size", "zero-repeats", "zero-threads", "bad-isa"],
)
def test_bench_adam_rejects_bad_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "adam", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("infinity: error:") and len(err.strip().splitlines()) == 1


def test_bench_adam_forced_isa(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "adam", "--size", "4K", "--repeats", "1", "--isa", "scalar", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["isa"] == "scalar"
