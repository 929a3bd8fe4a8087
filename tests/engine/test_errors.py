"""Bad budgets, paths, config values and model changes: clear errors, nothing corrupted."""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import (
    batches,
    config,
    global_rel_error,
    offload_on_nvme,
    param_bytes,
    reference_pair,
    tiny_gpt,
    train,
)

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam


def test_budgets_too_small_fail_before_anything_is_touched(tmp_path):
    model = tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(infinity.PlanError, match=r"device_memory=.*at least \d+ bytes"):
        infinity.offload(model, config(device_memory=1024))
    with pytest.raises(infinity.PlanError, match="set nvme_path"):
        infinity.offload(model, config(device_memory="1MiB", host_memory=param_bytes(model, 4)))
    with pytest.raises(infinity.PlanError, match=r"host_memory=.*staging buffers alone"):
        infinity.offload(
            model, config(device_memory="1MiB", host_memory=4096, nvme_path=str(tmp_path))
        )
    # the model is untouched and still trains normally; no swap files were left
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    x, y = batches(1)[0]
    model(x, y).backward()
    assert list(tmp_path.iterdir()) == []


def test_nvme_too_small_names_nvme_memory(tmp_path):
    model = tiny_gpt()
    with pytest.raises(infinity.PlanError, match="nvme_memory"):
        infinity.offload(
            model,
            config(
                device_memory="1MiB",
                host_memory=param_bytes(model, 4) * 2,
                nvme_path=str(tmp_path),
                nvme_memory=8192,
                chunk_size="16KiB",
            ),
        )


def test_unwritable_nvme_path_is_a_clear_error(tmp_path):
    model = tiny_gpt()
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(OSError, match="does not exist"):
        infinity.offload(
            model,
            config(
                device_memory="1MiB",
                host_memory=param_bytes(model, 4) * 2,
                nvme_path=str(missing),
                chunk_size="16KiB",
            ),
        )
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(OSError, match="not a directory"):
        infinity.offload(
            model,
            config(
                device_memory="1MiB",
                host_memory=param_bytes(model, 4) * 2,
                nvme_path=str(afile / "sub"),
                chunk_size="16KiB",
            ),
        )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("device_memory", "lots", "device_memory='lots' is not a size"),
        ("host_memory", -5, "negative"),
        ("dtype", "fp8", "dtype='fp8' is not one of"),
        ("chunk_size", 5000, "multiple of 4096"),
        ("device", "tpu", "device='tpu'"),
        ("prefetch_depth", -1, "prefetch_depth"),
        ("aio", {"block_size": 1000}, "aio.block_size"),
        ("aio", {"queue_depht": 8}, "unknown key"),
    ],
)
def test_invalid_config_values_name_the_field(field, value, message):
    with pytest.raises(infinity.ConfigError, match=message):
        infinity.Config(**{field: value})


def test_config_file_round_trip(tmp_path):
    cfg = infinity.Config(
        device_memory="1GiB",
        host_memory=123456789,
        nvme_path="/tmp/x",
        dtype="fp16",
        aio={"block_size": "256K", "queue_depth": 8},
    )
    cfg.to_file(tmp_path / "c.json")
    assert infinity.Config.from_file(tmp_path / "c.json") == cfg
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(infinity.ConfigError, match="not valid JSON"):
        infinity.Config.from_file(tmp_path / "bad.json")


def test_model_changed_after_offload_is_refused():
    model = infinity.offload(tiny_gpt(), config(device_memory="1MiB"))
    x, y = batches(1)[0]
    model.extra = torch.nn.Linear(4, 4)
    with pytest.raises(infinity.ModelChangedError, match="parameters but had"):
        model(x, y)
    del model.extra
    model(x, y)  # fine again
    model.blocks[0].double()  # the model's own .double() is refused at once (test_move_guard)
    with pytest.raises(infinity.ModelChangedError, match="changed after infinity.offload"):
        model(x, y)


def _frozen(model: torch.nn.Module, prefix: str, frozen: bool = True) -> None:
    for name, param in model.named_parameters():
        if name.startswith(prefix):
            param.requires_grad_(not frozen)


def test_unfreezing_after_offload_is_refused_and_freezing_trains_as_torch(tmp_path):
    # Frozen at offload, then unfrozen: that parameter used to train silently never.
    base = tiny_gpt()
    _frozen(base, "blocks.0.")
    ref, ref_opt = reference_pair(base)
    model = offload_on_nvme(base, tmp_path, 1.0)
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = batches(6)
    _frozen(model, "blocks.0.", frozen=False)
    with pytest.raises(infinity.ModelChangedError, match=r"'blocks\.0\..*' was frozen"):
        model(*data[0])
    with torch.no_grad():
        model(*data[0])  # no gradients asked: nothing to refuse
    _frozen(model, "blocks.0.")
    train(model, opt, data[:3])
    train(ref, ref_opt, data[:3])
    # Freezing more after offload is plain PyTorch's result.
    for m in (model, ref):
        _frozen(m, "blocks.1.")
    train(model, opt, data[3:])
    train(ref, ref_opt, data[3:])
    assert global_rel_error(model, ref) < 1e-5


def test_higher_order_gradients_are_refused_and_training_goes_on(tmp_path):
    base = tiny_gpt()
    ref, ref_opt = reference_pair(base)
    model = offload_on_nvme(base, tmp_path, 1.0)
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = batches(4)
    # It used to fail deep in backward with PoolExhausted, the device slots full.
    with pytest.raises(RuntimeError, match="gradients of gradients"):
        model(*data[0]).backward(create_graph=True)
    with pytest.raises(RuntimeError, match="gradients of gradients"):
        torch.autograd.grad(model(*data[0]), list(model.parameters()), create_graph=True)
    opt.zero_grad()
    train(model, opt, data)
    train(ref, ref_opt, data)
    assert global_rel_error(model, ref) < 1e-5


def test_a_sparse_embedding_is_refused_at_offload_and_trains_dense_as_torch(tmp_path):
    # Its sparse gradient failed mid-backward, inside torch's copy into the chunk.
    class Bag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(1000, 32, sparse=True)
            self.out = torch.nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(x).mean(1))

    torch.manual_seed(0)
    model = Bag()
    with pytest.raises(ValueError, match=r"emb \(Embedding\) has sparse=True.*model\.emb\.sparse"):
        infinity.offload(model, config(device_memory="1MiB"))
    model.emb.sparse = False  # what the message says
    ref, ref_opt = reference_pair(model, weight_decay=0.0)
    model = infinity.offload(model, config(device_memory="1MiB", chunk_size="16KiB"))
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 1000, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g))]
    for m, o in ((model, opt), (ref, ref_opt)):
        train(m, o, data * 3, loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    assert global_rel_error(model, ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.int8, torch.complex64])
def test_a_parameter_that_is_not_floating_point_is_refused_at_offload(dtype):
    # A complex one lost its imaginary part at offload (torch's copy only warned).
    model = torch.nn.Linear(4, 4)
    model.extra = torch.nn.Parameter(torch.ones(4, 4, dtype=dtype), requires_grad=False)
    with pytest.raises(ValueError, match=rf"parameter 'extra' is {dtype}.*register_buffer"):
        infinity.offload(model, config(device_memory="1MiB"))
    assert model.extra.dtype == dtype and torch.equal(model.extra, torch.ones(4, 4, dtype=dtype))


@pytest.mark.parametrize("which", ["a shared parameter", "a module inside", "the model around"])
def test_a_parameter_offloaded_already_is_refused_at_offload(which):
    # Each was offloaded a second time silently: its value was the first one's NaN placeholder.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 2)))
    x = torch.randn(3, 8)
    want = model(x).detach()
    if which == "a shared parameter":
        first, second = model, torch.nn.Sequential(torch.nn.Linear(8, 8))
        second[0].weight = model[0].weight
    elif which == "a module inside":
        first, second = model[1], model
    else:
        first, second = model, model[1]
    infinity.offload(first, config(device_memory="1MiB"))
    with pytest.raises(ValueError, match="belongs to a model offloaded already"):
        infinity.offload(second, config(device_memory="1MiB"))
    if first is model:
        assert torch.equal(model(x), want)  # the first is untouched


class _TiedByHand(torch.nn.Module):
    """A head tied by hand: the root's forward reads the embedding's weight itself."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(96, 32)
        self.mid = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.tanh(self.mid(self.emb(x))), self.emb.weight)


class _TiedByHandTwoInputs(_TiedByHand):
    """The same, with a forward the fake run at offload cannot call (two inputs)."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * scale


def test_a_weight_read_outside_its_modules_forward_trains_as_torch(tmp_path):
    # F.linear(h, self.emb.weight) in the root's forward read the embedding's NaN
    # placeholder: NaN losses, and NaN written into the weights, silently. The fake
    # forward at offload finds the read, and the root binds the embedding.
    torch.manual_seed(0)
    base = _TiedByHand()
    ref, ref_opt = reference_pair(base)
    model = offload_on_nvme(base, tmp_path, 4.0, chunk_size="8KiB", device_memory="96KiB")
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = batches(3)
    for m, o in ((model, opt), (ref, ref_opt)):
        train(m, o, data, loss_fn=lambda m, b: torch.nn.functional.cross_entropy(
            m(b[0]).flatten(0, 1), b[1].flatten()))  # fmt: skip
    assert global_rel_error(model, ref) < 1e-6


def test_a_weight_read_the_fake_run_cannot_see_is_refused_naming_it():
    # Where the fake forward at offload cannot run, the pack hook still refuses the
    # placeholder, naming the parameter, before anything is written.
    torch.manual_seed(0)
    model = _TiedByHandTwoInputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model = infinity.offload(model, config(device_memory="1MiB", chunk_size="16KiB"))
    x, _ = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"parameter 'emb\.weight' was used outside the forward"):
        model(x, torch.tensor(2.0))
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_offloading_twice_and_optimizer_errors():
    model = infinity.offload(tiny_gpt(), config(device_memory="1MiB"))
    with pytest.raises(ValueError, match="already offloaded"):
        infinity.offload(model, config(device_memory="1MiB"))
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam(model.parameters(), amsgrad=True)


def test_other_ops_on_a_gradient_fail_loudly_and_the_optimizer_alias_clips():
    model = tiny_gpt()
    import copy

    ref = copy.deepcopy(model)
    model = infinity.offload(model, config(device_memory="1MiB", chunk_size="16KiB"))
    opt = CPUAdam(model.parameters(), lr=1e-3)
    x, y = batches(1)[0]
    model(x, y).backward()
    ref(x, y).backward()
    grad = next(model.parameters()).grad
    for op in (lambda g: g.sum(), lambda g: g.add_(1.0), lambda g: g.clone()):
        with pytest.raises(RuntimeError, match="infinity.gradients"):
            op(grad)
    ours = opt.clip_grad_norm_(0.5)
    theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


def test_fp16_without_loss_scaling_is_refused(tmp_path):
    model = infinity.offload(tiny_gpt(), config(dtype="fp16", device_memory="1MiB"))
    opt = CPUAdam(model.parameters())
    x, y = batches(1)[0]
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()


def _on_nvme(tmp_path):
    """A tiny GPT whose host budget forces states onto NVMe in ``tmp_path``."""
    model = tiny_gpt()
    return infinity.offload(
        model,
        config(
            device_memory="1MiB",
            host_memory=param_bytes(model, 4) * 2,
            nvme_path=str(tmp_path),
            chunk_size="16KiB",
        ),
    )


def test_no_swap_files_remain_after_close(tmp_path):
    model = _on_nvme(tmp_path)
    CPUAdam(model.parameters())  # NOTE [the layout is decided once, late]: allocates
    assert any(tmp_path.iterdir())
    engine_of(model).close()
    assert not any(os.scandir(tmp_path))


def test_disk_error_mid_training_is_a_clear_error_and_cleanup_still_works(tmp_path):
    import errno

    from infinity.io import NVMeIOError

    model = _on_nvme(tmp_path)
    engine = engine_of(model)
    opt = CPUAdam(model.parameters(), lr=1e-3)
    x, y = batches(1)[0]
    model(x, y).backward()
    engine.swap.engine.inject_fault(1, errno.ENOSPC, per="request")
    with pytest.raises(NVMeIOError) as info:
        opt.step()
        engine.manager.synchronize()
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert str(tmp_path) in message and "offset" in message
    engine.close()
    assert not any(os.scandir(tmp_path))


def test_interrupted_backward_behaves_like_torch():
    """An exception inside backward leaves partial gradients, exactly as in torch."""
    from engine_helpers import global_rel_error, reference_pair

    model = tiny_gpt()
    ref, ref_opt = reference_pair(model)
    model = infinity.offload(model, config(device_memory="1MiB", chunk_size="16KiB"))
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)

    def boom(grad):
        raise KeyboardInterrupt

    data = batches(3)
    for m, o in ((model, opt), (ref, ref_opt)):
        handle = m.blocks[0].fc.weight.register_hook(boom)
        x, y = data[0]
        with pytest.raises(KeyboardInterrupt):
            m(x, y).backward()
        handle.remove()
        for x, y in data[1:]:
            m(x, y).backward()
            o.step()
            o.zero_grad()
    assert global_rel_error(model, ref) < 1e-5
