"""Data parallel (issue 19): state and weights are collective and world-size independent.

Two gloo ranks train a tiny tied ``transformers`` Llama (fp32 on host; bf16 with
NVMe) and then, on the same ranks, go through every way state leaves or enters
a sharded model. Each result is checked in this process against an independent
reference: plain PyTorch training (within the data-parallel noise measured as in
``test_sharded_training.py``), ``transformers``' own ``from_pretrained`` /
``save_pretrained``, plain-PyTorch gradients of each rank's half batch, and a
single-process offloaded model for optimizer states; and the two ranks' copies
against each other, bit for bit.
"""

from __future__ import annotations

import copy
import errno
import os

import pytest
import torch
from engine_helpers import tiny_llama
from harness import run_ranks, state_rel_error

import infinity
from infinity.chunks.pools import is_split
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.pretrained.safetensors_io import ShardWriter

pytestmark = pytest.mark.distributed

VOCAB, SEQ, B, STEPS, LR = 128, 16, 2, 3, 1e-2
NOISE_MULTIPLE = 4
CLIP = 0.1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = {"fp32-host": ("fp32", False), "bf16-nvme": ("bf16", True)}


def _model(seed: int = 0) -> torch.nn.Module:
    return tiny_llama(VOCAB, hidden=64, tie=True, seed=seed)  # tied embedding and head


def _config(dtype: str, nvme: str | None) -> infinity.Config:
    return infinity.Config(
        device="cpu",
        dtype=dtype,
        device_memory="512KiB",
        host_memory="400KiB" if nvme else "64MiB",
        nvme_path=nvme,
        chunk_size="32KiB",
    )


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2 * B, SEQ), generator=g) for _ in range(STEPS)]


def _half(ids: torch.Tensor, rank: int) -> torch.Tensor:
    return ids[rank * B : (rank + 1) * B]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int | None) -> None:
    """Train ``STEPS`` steps on the whole batches, or on ``rank``'s half of each."""
    for ids in _batches():
        ids = ids if rank is None else _half(ids, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _cloned(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def _rank_checks(rank: int, root: str, hf_dir: str, plain: dict, optim_1p: dict) -> dict:
    """Every check's values on one rank, per case."""
    out = {}
    for case, (dtype, nvme) in CASES.items():
        cfg = _config(dtype, f"{root}/{case}-nvme" if nvme else None)
        got: dict = {}
        model = infinity.offload(_model(), cfg)
        plan = engine_of(model).plan
        assert plan.sharded and not any(is_split(plan, c) for c in range(plan.layout.num_chunks))
        optimizer = CPUAdam(model.parameters(), lr=LR, weight_decay=0.1)
        _train(model, optimizer, rank)
        got["trained"] = _cloned(model.state_dict())
        got["optim"] = copy.deepcopy(optimizer.state_dict())
        got["saved"] = str(infinity.save_pretrained(model, f"{root}/{case}-saved"))
        if case == "fp32-host":
            got["failures"] = _failures(rank, model, root, hf_dir)
            got["after_failures"] = _cloned(model.state_dict())  # collectives still aligned
        optimizer.load_state_dict(optim_1p[case])  # a single process's moments
        got["optim_in"] = copy.deepcopy(optimizer.state_dict())
        model.load_state_dict(plain)
        got["load_state_dict"] = _cloned(model.state_dict())
        engine_of(model).close()

        model = infinity.offload(_model(seed=7), cfg)
        infinity.load_pretrained(model, hf_dir)
        got["load_pretrained"] = _cloned(model.state_dict())
        ids = _half(_batches()[0], rank)
        model(input_ids=ids, labels=ids).loss.backward()
        got["gradients"] = infinity.gradients(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        ids = _half(_batches()[1], rank)
        model(input_ids=ids, labels=ids).loss.backward()  # onto the clipped gradients
        got["accumulated"] = infinity.gradients(model)
        engine_of(model).close()

        model = infinity.from_pretrained(hf_dir, cfg)
        got["from_pretrained"] = _cloned(model.state_dict())
        engine_of(model).close()
        out[case] = got
    return out


def _error(fn, *args, **kwargs) -> str:
    """``fn``'s error as "Type: message" (it must raise)."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{fn.__name__} did not raise")


def _failures(rank: int, model: torch.nn.Module, root: str, hf_dir: str) -> dict[str, str]:
    """One rank fails in each collective load or save: every rank's error."""
    missing = f"{root}/none"
    out = {"load": _error(infinity.load_pretrained, model, missing if rank else hf_dir)}
    cfg = _config("fp32", None)
    out["from"] = _error(infinity.from_pretrained, hf_dir if rank else missing, cfg)
    if rank == 0:
        os.makedirs(f"{root}/foreign", exist_ok=True)
        open(f"{root}/foreign/notes.txt", "w").close()
    out["refused"] = _error(infinity.save_pretrained, model, f"{root}/foreign")
    # A disk that fills up on rank 0 once the first tensor is written.
    real, calls = ShardWriter.write, []

    def full_disk(writer: ShardWriter, name: str, data) -> None:
        calls.append(name)
        if rank == 0 and len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        real(writer, name, data)

    ShardWriter.write = full_disk  # type: ignore[method-assign]
    try:
        out["full"] = _error(infinity.save_pretrained, model, f"{root}/full", max_shard_size="1")
    finally:
        ShardWriter.write = real  # type: ignore[method-assign]
    out["full_exists"] = str(os.path.exists(f"{root}/full"))
    return out


def _plain(dtype: torch.dtype, *, fused: bool = False, halves: bool = False) -> dict:
    """Plain PyTorch mixed precision: fp32 masters stepped by ``torch.optim.AdamW``,
    forward and backward on a ``dtype`` copy; ``halves``: the mean of the half
    batches' gradients, as two data-parallel ranks compute it."""
    master = _model()
    optimizer = torch.optim.AdamW(
        master.parameters(), lr=LR, weight_decay=0.1, fused=fused or None, foreach=False
    )
    compute = master if dtype is torch.float32 else copy.deepcopy(master).to(dtype)
    for ids in _batches():
        with torch.no_grad():
            for p, c in zip(master.parameters(), compute.parameters(), strict=True):
                c.copy_(p)
        parts = [_half(ids, 0), _half(ids, 1)] if halves else [ids]
        for part in parts:
            (compute(input_ids=part, labels=part).loss / len(parts)).backward()
        if compute is not master:
            for p, c in zip(master.parameters(), compute.parameters(), strict=True):
                p.grad = c.grad.float()
                c.grad = None
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.to(dtype) for k, v in master.state_dict().items()}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k


def _moments(state: dict) -> list[tuple[int, str, torch.Tensor]]:
    return [
        (i, name, value)
        for i, s in sorted(state["state"].items())
        for name, value in sorted(s.items())
    ]


def _equal_moments(a: dict, b: dict) -> None:
    ma, mb = _moments(a), _moments(b)
    assert [(i, n) for i, n, _ in ma] == [(i, n) for i, n, _ in mb]
    assert ma, "no optimizer state"
    for (i, name, x), (_j, _n, y) in zip(ma, mb, strict=True):
        assert torch.equal(x, y), (i, name)


def _one_process_optimizer(dtype: str, nvme: str | None, state: dict | None = None):
    """A single-process offloaded model's CPUAdam: trained on whole batches, or
    loaded with ``state``."""
    model = infinity.offload(_model(), _config(dtype, nvme))
    optimizer = CPUAdam(model.parameters(), lr=LR, weight_decay=0.1)
    if state is None:
        _train(model, optimizer, None)
    else:
        optimizer.load_state_dict(state)
    return model, optimizer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_state")
    plain = _model(seed=3)
    plain.save_pretrained(root / "hf")  # transformers' own files (fp32)
    optim_1p = {}
    for case, (dtype, nvme) in CASES.items():
        model, optimizer = _one_process_optimizer(dtype, str(root / "1p") if nvme else None)
        optim_1p[case] = copy.deepcopy(optimizer.state_dict())
        engine_of(model).close()
    ranks = run_ranks(
        _rank_checks,
        str(root),
        str(root / "hf"),
        plain.state_dict(),
        optim_1p,
        timeout=300.0,
    )
    return {"plain": plain, "optim_1p": optim_1p, "ranks": ranks, "root": root}


@pytest.mark.parametrize("case", list(CASES))
def test_trained_state_dict_matches_plain_pytorch_and_is_the_same_on_every_rank(run, case):
    dtype = DTYPES[CASES[case][0]]
    r0, r1 = (r[case]["trained"] for r in run["ranks"])
    _equal(r0, r1)
    ref = _plain(dtype)
    gap = max(
        state_rel_error(_plain(dtype, fused=True), ref),
        state_rel_error(_plain(dtype, halves=True), ref),
    )
    error = state_rel_error(r0, ref)
    assert error <= NOISE_MULTIPLE * gap, (case, error, gap)
    # NOTE: the bound must be able to fail: far below what training changed.
    initial = {k: v.to(dtype) for k, v in _model().state_dict().items()}
    assert NOISE_MULTIPLE * gap < 0.25 * state_rel_error(initial, ref), (case, gap)


@pytest.mark.parametrize("case", list(CASES))
def test_save_pretrained_at_two_ranks_loads_in_transformers_exactly(run, case):
    transformers = pytest.importorskip("transformers")
    trained = run["ranks"][0][case]["trained"]
    saved = run["ranks"][0][case]["saved"]
    assert saved == run["ranks"][1][case]["saved"]
    back = transformers.AutoModelForCausalLM.from_pretrained(saved)  # dtype from config.json
    _equal(back.state_dict(), trained)


@pytest.mark.parametrize("case", list(CASES))
def test_loading_at_two_ranks_gives_the_files_values_on_every_rank(run, case):
    dtype = DTYPES[CASES[case][0]]
    want = {k: v.to(dtype) for k, v in run["plain"].state_dict().items()}
    for how in ("load_pretrained", "from_pretrained", "load_state_dict"):
        for r in run["ranks"]:
            _equal(r[case][how], want)


def _mean_gradients(plain: torch.nn.Module, ids: torch.Tensor) -> list[dict]:
    """Plain PyTorch: each rank's half-batch gradients (fp32 copies), then their mean."""
    grads = []
    for rank in range(2):
        plain.zero_grad()
        part = _half(ids, rank)
        plain(input_ids=part, labels=part).loss.backward()
        grads.append({n: p.grad.float() for n, p in plain.named_parameters()})
    return [*grads, {n: (grads[0][n] + grads[1][n]) / 2 for n in grads[0]}]


def _close_per_tensor(ours: dict, want: dict, bound: float) -> None:
    assert ours.keys() == want.keys()
    for n, value in want.items():
        error = state_rel_error({n: ours[n]}, {n: value.to(ours[n].dtype)})
        assert error <= bound, (n, error)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_at_two_ranks_are_the_mean_of_the_ranks_plain_gradients(run, case):
    dtype = DTYPES[CASES[case][0]]
    plain = copy.deepcopy(run["plain"]).to(dtype)
    first, _second, mean = _mean_gradients(plain, _batches()[0])
    next_mean = _mean_gradients(plain, _batches()[1])[2]
    norm = sum(float(g.double().pow(2).sum()) for g in mean.values()) ** 0.5
    factor = min(1.0, CLIP / (norm + 1e-6))
    assert factor < 0.5  # the clip changes the sum
    accumulated = {n: mean[n] * factor + next_mean[n] for n in mean}
    g0, g1 = (r[case]["gradients"] for r in run["ranks"])
    _equal(g0, g1)
    a0, a1 = (r[case]["accumulated"] for r in run["ranks"])
    _equal(a0, a1)
    # NOTE: per tensor, relative to its norm: the two accumulate a tied gradient and
    # the rank mean in a different order, which bf16 rounds differently.
    bound = 1e-5 if dtype is torch.float32 else 2e-2
    _close_per_tensor(g0, mean, bound)
    _close_per_tensor(a0, accumulated, bound)
    # NOTE: the bound must be able to fail: a rank's own gradient is far off the mean.
    with pytest.raises(AssertionError):
        _close_per_tensor(g0, first, 10 * bound)


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_state_moves_between_two_ranks_and_one_process(run, case, tmp_path):
    dtype, nvme = CASES[case]
    o0, o1 = (r[case]["optim"] for r in run["ranks"])
    _equal_moments(o0, o1)
    assert o0["param_groups"] == o1["param_groups"]
    # 2 ranks -> 1 process
    model, optimizer = _one_process_optimizer(dtype, str(tmp_path) if nvme else None, o0)
    _equal_moments(optimizer.state_dict(), o0)
    engine_of(model).close()
    # 1 process -> 2 ranks (their own moments, trained on half batches, differ)
    with pytest.raises(AssertionError):
        _equal_moments(o0, run["optim_1p"][case])
    for r in run["ranks"]:
        _equal_moments(r[case]["optim_in"], run["optim_1p"][case])


def test_a_rank_that_fails_makes_every_rank_raise_naming_it(run):
    r0, r1 = (r["fp32-host"]["failures"] for r in run["ranks"])
    # rank 1's checkpoint is missing: rank 0 raises naming it, and loaded nothing
    assert r0["load"].startswith("PretrainedError: rank 1 could not load"), r0["load"]
    assert "nothing was loaded" in r0["load"] and "no checkpoint at" in r0["load"]
    assert r1["load"].startswith("PretrainedError: no checkpoint at"), r1["load"]
    # rank 0 cannot build the model from a missing directory: neither offloads
    assert r1["from"].startswith("PretrainedError: rank 0 could not load"), r1["from"]
    assert "nothing was offloaded" in r1["from"]
    assert r0["from"].startswith("PretrainedError:") and "none' is not a directory" in r0["from"]
    # rank 0 refuses to replace a directory with other files: rank 1 learns why
    assert "already holds notes.txt" in r0["refused"], r0["refused"]
    assert r1["refused"].startswith("PretrainedError: rank 0 could not save"), r1["refused"]
    assert "already holds notes.txt" in r1["refused"]
    # rank 0's disk fills mid-save: it keeps gathering, both raise, nothing is left behind
    assert r0["full"].startswith("OSError") and "No space left" in r0["full"], r0["full"]
    assert r1["full"].startswith("PretrainedError: rank 0 could not save"), r1["full"]
    assert r0["full_exists"] == r1["full_exists"] == "False"
    assert not [p for p in run["root"].iterdir() if p.name.startswith(".full.tmp")]
    for r in run["ranks"]:
        _equal(r["fp32-host"]["after_failures"], r["fp32-host"]["trained"])
