"""Checkpoint loads are all or nothing, and every malformed input is a CheckpointError.

The references are independent of the loader: the model's ``state_dict`` and
the optimizer's groups taken before the load, the bytes a save writes to disk
before and after, and the files of the unmodified checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from engine_helpers import batches, config, param_bytes, tiny_gpt, train
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infinity
from infinity.optim import CPUAdam

FILES = ("meta.json", "param.bin", "optim.bin")


def _offloaded(nvme: Path, seed: int, lr: float):
    model = tiny_gpt(seed=seed)
    pbytes = param_bytes(model, 2)
    cfg = config(
        dtype="bf16",
        device_memory=pbytes * 6 // 10,
        host_memory=pbytes * 4,
        nvme_path=str(nvme),
        chunk_size="12KiB",
    )
    model = infinity.offload(model, cfg)
    return model, CPUAdam(model.parameters(), lr=lr, weight_decay=0.1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A saved checkpoint of a trained model, and a differently trained target model."""
    root = tmp_path_factory.mktemp("ckpt")
    (root / "nvme").mkdir()
    source, source_opt = _offloaded(root / "nvme", seed=0, lr=3e-3)
    train(source, source_opt, batches(2, seed=4))
    saved = infinity.save_checkpoint(root / "saved", source, source_opt)
    target, target_opt = _offloaded(root / "nvme", seed=7, lr=1e-2)
    train(target, target_opt, batches(1, seed=9))
    pristine = infinity.save_checkpoint(root / "pristine", target, target_opt)
    return root, saved, target, target_opt, pristine


@pytest.fixture
def fresh(pair):
    """``(saved, target, target_opt)`` with the target back in its own, different state.

    NOTE: a successful load in an earlier test made the target equal the saved
    checkpoint, and a half-done load would then go unnoticed.
    """
    _reset(pair)
    _root, saved, target, target_opt, _pristine = pair
    return saved, target, target_opt


def _reset(pair) -> None:
    _root, saved, target, target_opt, pristine = pair
    infinity.load_checkpoint(pristine, target, target_opt)
    assert not torch.equal(next(iter(target.state_dict().values())), _saved_first(saved))


def _saved_first(saved: Path) -> torch.Tensor:
    meta = json.loads((saved / "meta.json").read_text())
    t = meta["tensors"][0]
    n = 1
    for d in t["shape"]:
        n *= d
    raw = (saved / "param.bin").read_bytes()[t["param_offset"] : t["param_offset"] + 2 * n]
    return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(t["shape"])


class Snapshot:
    """Everything a load may change, taken without the loader: values, groups, saved bytes."""

    def __init__(self, model, opt, scratch: Path) -> None:
        self.state = {k: v.clone() for k, v in model.state_dict().items()}
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        path = infinity.save_checkpoint(scratch / "snapshot", model, opt)
        self.files = {name: (path / name).read_bytes() for name in ("param.bin", "optim.bin")}
        meta = json.loads((path / "meta.json").read_text())
        self.meta = {k: v for k, v in meta.items() if k != "files"}
        shutil.rmtree(path)

    def assert_same(self, other: Snapshot) -> None:
        assert self.state.keys() == other.state.keys()
        for k, v in self.state.items():
            assert torch.equal(v, other.state[k]), k
        assert self.groups == other.groups
        assert self.files == other.files  # masters, moments: byte for byte
        assert self.meta == other.meta  # step counts, loss scaler, hyper-parameters


def _rechecksum(meta: dict) -> dict:
    """The documented checksum: SHA-256 of the canonical JSON without it."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return {**body, "meta_sha256": hashlib.sha256(text.encode()).hexdigest()}


def _copy(saved: Path, into: Path) -> Path:
    shutil.copytree(saved, into / "c")
    return into / "c"


def _rewrite_meta(path: Path, change, recheck: bool = True) -> None:
    meta = json.loads((path / "meta.json").read_text())
    change(meta)
    (path / "meta.json").write_text(json.dumps(_rechecksum(meta) if recheck else meta))


def test_failed_load_half_way_leaves_model_and_optimizer_as_they_were(fresh, tmp_path):
    """The optimizer check comes after every tensor was read in the old code."""
    saved, target, target_opt = fresh
    before = Snapshot(target, target_opt, tmp_path)
    two_groups = CPUAdam(
        [
            {"params": list(target.parameters())[:3]},
            {"params": list(target.parameters())[3:]},
        ]
    )
    with pytest.raises(infinity.CheckpointError, match="parameter groups"):
        infinity.load_checkpoint(saved, target, two_groups)
    Snapshot(target, target_opt, tmp_path).assert_same(before)


def _set_lr_fast(meta):
    meta["optimizer"][0]["hyper"]["lr"] = "fast"


def _shift_offset(meta):
    meta["tensors"][3]["param_offset"] += 2


def _past_end(meta):
    meta["tensors"][-1]["param_offset"] = meta["files"]["param.bin"]["bytes"] - 2


def _drop_files(meta):
    del meta["files"]


def _bad_scaler(meta):
    meta["loss_scaler"] = {"scale": "big", "good_steps": 0, "skipped_steps": 0}


def _escape_path(meta):
    meta["files"]["../param.bin"] = meta["files"].pop("param.bin")


@pytest.mark.parametrize(
    ("change", "recheck", "needle"),
    [
        (_set_lr_fast, True, "'lr' is 'fast'"),
        (_shift_offset, False, "meta_sha256"),  # shifted offsets: refused, not wrong weights
        (_past_end, True, "needs bytes"),
        (_drop_files, True, "has no 'files'"),
        (_bad_scaler, True, "loss_scaler.scale"),
        (_escape_path, True, "files"),
        (lambda meta: meta["tensors"][0].pop("shape"), True, "has no 'shape'"),
        (lambda meta: meta["tensors"].append(7), True, r"tensors\[\d+\] is 7"),
        (lambda meta: meta.update(step_count=-1), True, "step_count"),
        (lambda meta: meta.update(dtype="fp8"), True, "dtype"),
    ],
)
def test_malformed_meta_is_a_checkpoint_error_and_changes_nothing(
    fresh, tmp_path, change, recheck, needle
):
    saved, target, target_opt = fresh
    path = _copy(saved, tmp_path)
    _rewrite_meta(path, change, recheck)
    before = Snapshot(target, target_opt, tmp_path)
    with pytest.raises(infinity.CheckpointError, match=needle):
        infinity.load_checkpoint(path, target, target_opt)
    Snapshot(target, target_opt, tmp_path).assert_same(before)


@pytest.mark.parametrize(
    "content",
    [b"[]", b"{}", b'{"format": "infinity-checkpoint"}', b"\xff\xfe\x00\xd8", b"[" * 10**5],
)
def test_junk_meta_json_is_a_checkpoint_error(fresh, tmp_path, content):
    saved, target, target_opt = fresh
    path = _copy(saved, tmp_path)
    (path / "meta.json").write_bytes(content)
    with pytest.raises(infinity.CheckpointError, match="meta.json"):
        infinity.load_checkpoint(path, target, target_opt)


def test_version_1_checkpoint_without_checksum_still_loads(fresh, tmp_path):
    """Checkpoints written before meta.json had a checksum load unchanged."""
    saved, target, target_opt = fresh
    path = _copy(saved, tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    del meta["meta_sha256"]
    (path / "meta.json").write_text(json.dumps({**meta, "version": 1}))
    infinity.load_checkpoint(path, target, target_opt)
    loaded = infinity.save_checkpoint(tmp_path / "again", target, target_opt)
    for name in ("param.bin", "optim.bin"):
        assert (loaded / name).read_bytes() == (saved / name).read_bytes()


# --- the property: any mutation is refused, or changes nothing ---------------------------

_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.just([]),
    st.just({}),
)


def _leaves(node, path=()):
    """Paths of every value inside a parsed JSON document."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        yield (*path, key)
        if isinstance(value, (dict, list)) and value:
            yield from _leaves(value, (*path, key))


@st.composite
def mutations(draw):
    """``(description, apply(path) -> bool)``; apply returns True if meta was re-checksummed."""
    kind = draw(st.sampled_from(["flip", "truncate", "append", "leaf", "leaf-rechecked"]))
    if kind in ("flip", "truncate", "append"):
        name = draw(st.sampled_from(FILES))
        where = draw(st.floats(0, 1, exclude_max=True))
        value = draw(st.integers(1, 255))

        def apply(path: Path) -> bool:
            data = bytearray((path / name).read_bytes())
            at = int(where * len(data))
            if kind == "flip":
                data[at] ^= value
            elif kind == "truncate":
                del data[at:]
            else:
                data += bytes([value]) * (1 + at % 7)
            (path / name).write_bytes(bytes(data))
            return False

        return f"{kind} {name} at {where:.3f} ({value})", apply
    index = draw(st.integers(0, 10**6))
    junk = draw(_JUNK)
    delete = draw(st.booleans())

    def apply_leaf(path: Path) -> bool:
        meta = json.loads((path / "meta.json").read_text())
        leaves = list(_leaves(meta))
        *parent_path, key = leaves[index % len(leaves)]
        parent = meta
        for step in parent_path:
            parent = parent[step]
        if delete and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = copy.deepcopy(junk)
        recheck = kind == "leaf-rechecked"
        (path / "meta.json").write_text(json.dumps(_rechecksum(meta) if recheck else meta))
        return recheck

    return f"{kind} {index} -> {'delete' if delete else repr(junk)}", apply_leaf


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mutation=mutations())
def test_any_mutation_is_refused_or_changes_nothing(pair, mutation):
    _root, saved, target, target_opt, _pristine = pair
    _reset(pair)
    _description, apply = mutation
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        path = _copy(saved, scratch)
        rechecked = apply(path)
        before = Snapshot(target, target_opt, scratch)
        try:
            infinity.load_checkpoint(path, target, target_opt)
        except infinity.CheckpointError:
            Snapshot(target, target_opt, scratch).assert_same(before)
            return
        if rechecked:
            return  # a valid (re-checksummed) change may load: it only must not crash
        # Accepted without a checksum change: the mutation was a no-op (whitespace),
        # so the model holds exactly the saved checkpoint's bytes.
        after = infinity.save_checkpoint(scratch / "after", target, target_opt)
        for name in ("param.bin", "optim.bin"):
            assert (after / name).read_bytes() == (saved / name).read_bytes(), name


def test_an_optimizer_over_other_parameters_is_named_and_nothing_changes(tmp_path):
    # The message said only that the groups differed: now which, and why that happens.
    model, opt = _offloaded(tmp_path / "a", seed=0, lr=1e-3)
    train(model, opt, batches(2))
    infinity.save_checkpoint(tmp_path / "ck", model, opt)
    frozen = tiny_gpt(seed=3)
    for name, param in frozen.named_parameters():
        param.requires_grad_(not name.startswith("blocks.0."))
    other = infinity.offload(frozen, config(dtype="bf16", device_memory="1MiB", chunk_size="12KiB"))
    other_opt = CPUAdam([p for p in other.parameters() if p.requires_grad], lr=1e-3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        infinity.CheckpointError, match=r"group 0 .*only the checkpoint's holds 'blocks\.0\."
    ):
        infinity.load_checkpoint(tmp_path / "ck", other, other_opt)
    after = other.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
