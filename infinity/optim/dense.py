"""Plain CPU tensors under an infinity optimizer: the checks and flat views every
front-end (:mod:`infinity.optim.front_end`) uses for parameters that were not offloaded."""

from __future__ import annotations

import torch


def check_dense_param(owner: str, p: torch.Tensor) -> None:
    """Raise a clear error if optimizer ``owner`` (its class name) cannot step ``p``
    as a plain CPU tensor."""
    if p.is_cpu is True and p.dtype is torch.float32 and p.layout is torch.strided:
        return  # the common case, tested with the cheapest attributes
    where = f"a parameter of shape {tuple(p.shape)}"
    if p.device.type != "cpu":
        raise ValueError(
            f"{owner} updates parameters in CPU memory, but {where} is on '{p.device}'. "
            "Keep the parameters on the CPU, or use infinity.offload(model, config), whose "
            "chunks hold fp32 master copies in CPU memory."
        )
    if p.layout != torch.strided:
        raise ValueError(f"{owner} needs dense parameters; {where} has layout {p.layout}")
    if p.dtype in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"{owner} keeps fp32 master parameters, but {where} is {str(p.dtype)[6:]}: updating "
            "16-bit weights in place loses most small updates to rounding. Give "
            f"{owner} fp32 parameters (keep a 16-bit copy for compute), or use "
            "infinity.offload(model, Config(dtype='bf16')), which keeps fp32 masters and writes "
            "16-bit copies in the step."
        )
    if p.dtype != torch.float32:
        raise TypeError(f"{owner} supports fp32 parameters only; {where} is {str(p.dtype)[6:]}")


def check_grad(owner: str, p: torch.Tensor, grad: torch.Tensor) -> None:
    """Raise if ``grad`` cannot update ``p`` (sparse, or another shape)."""
    if grad.is_sparse:
        raise RuntimeError(f"{owner} does not support sparse gradients; use torch.optim.SparseAdam")
    if grad.shape != p.shape:
        raise ValueError(
            f"gradient of shape {tuple(grad.shape)} does not match its parameter "
            f"of shape {tuple(p.shape)}"
        )


def flat_memory(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of ``t``'s elements in memory order, if they fill a gap-free block.

    True for contiguous tensors and for permuted ones such as channels_last
    weights; ``None`` for views with gaps, overlaps or negative strides.
    """
    if t.is_contiguous():
        return t.view(-1)
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda ss: ss[1]):
        if size == 1:
            continue
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def flat_buffers(*tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors as flat views of their memory, if a kernel can update them in place.

    True when all are contiguous, or all share one gap-free layout (e.g.
    channels_last): then element i of each view is the same logical element.
    """
    if all(t.is_contiguous() for t in tensors):
        return [t.view(-1) for t in tensors]
    first = tensors[0].stride()
    if any(t.stride() != first for t in tensors):
        return None
    flats = [flat_memory(t) for t in tensors]
    return None if any(f is None for f in flats) else flats  # type: ignore[return-value]


def step_dtype() -> torch.dtype:
    """The dtype of a parameter's ``step`` state, as torch keeps it."""
    # torch keeps `step` as a CPU float tensor (float64 under a float64
    # default dtype); matching it keeps state dicts interchangeable.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
