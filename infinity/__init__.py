"""infinity: train PyTorch models beyond GPU and host memory.

Parameters, gradients and optimizer states live in equal-size chunks spread over
the compute device, pinned host memory and NVMe, within byte budgets per tier::

    model = infinity.offload(model, infinity.Config(device_memory="2GiB", host_memory="8GiB",
                                                    nvme_path="/mnt/nvme/swap"))
    optimizer = infinity.optim.CPUAdam(model.parameters(), lr=3e-4)

See ``docs/ARCHITECTURE.md`` for the layers and the data flow of one step.
"""

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from infinity import optim
from infinity.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from infinity.config import AioConfig, Config, ConfigError
from infinity.io.request import NVMeIOError
from infinity.models.losses import causal_lm_loss
from infinity.offload import offload
from infinity.pretrained import (
    LoadResult,
    PretrainedError,
    init_empty,
    load_pretrained,
    save_pretrained,
)
from infinity.runtime.params import ModelChangedError, UnsetParameterError
from infinity.schedule.planner import PlanError
from infinity.stats import stats


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the gradients held in chunks, by parameter name (needs RAM for all)."""
    from infinity.offload import engine_of
    from infinity.runtime.state_access import gradients as _gradients

    return _gradients(model, engine_of(model))


def device_of(model: nn.Module) -> torch.device:
    """The device an offloaded ``model`` computes on (``cuda:0``, ``cpu``, ``fence:0``):
    where its inputs go, ``x.to(infinity.device_of(model))``. For a model that is not
    offloaded, the device of its first parameter (or buffer), else the CPU."""
    from infinity.offload import find_engine

    engine = find_engine(model)
    if engine is not None:
        return engine.device
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def from_pretrained(
    path: str | os.PathLike[str], config: Config | None = None, **kwargs: Any
) -> nn.Module:
    """A local ``transformers`` checkpoint, offloaded and loaded chunk by chunk
    (see :func:`infinity.pretrained.hf.from_pretrained`; needs the ``hf`` extra)."""
    from infinity.pretrained.hf import from_pretrained as _from_pretrained

    return _from_pretrained(path, config, **kwargs)


def memory_forecast(
    model: nn.Module, step: Callable[[nn.Module], torch.Tensor], tokens: int = 0
) -> Any:
    """The forecast of an offloaded ``model``'s step peak, per tier
    (:class:`~infinity.runtime.memory.MemoryForecast`): its budgets' lines at their
    limits, plus the step's working set, plus the resident set the process had when
    the model was offloaded. ``step(model)`` runs a forward at the batch shape the
    loop uses and returns its loss: it is run on fake tensors (nothing computed or
    allocated), under the model's activation policy, and backpropagated. ``tokens``:
    for the report. ``infinity.stats(model)["memory"]`` shows it beside the measured
    peaks."""
    from infinity.offload import engine_of
    from infinity.runtime.memory import forecast

    return forecast(engine_of(model), model, step, tokens)


def timeline(model: nn.Module) -> dict[str, list[Any]]:
    """The memory timeline of the last complete iteration: per moment, the phase
    (forward/backward/grad/optimizer), the chunk accessed, bytes on the device and
    host tiers, and which parameter/gradient chunks were on the device."""
    from infinity.offload import engine_of

    return engine_of(model).chunks.timeline.as_dict()


__all__ = [
    "AioConfig",
    "CheckpointError",
    "Config",
    "ConfigError",
    "LoadResult",
    "ModelChangedError",
    "NVMeIOError",
    "PlanError",
    "PretrainedError",
    "UnsetParameterError",
    "causal_lm_loss",
    "device_of",
    "from_pretrained",
    "gradients",
    "init_empty",
    "load_checkpoint",
    "load_pretrained",
    "memory_forecast",
    "offload",
    "optim",
    "save_checkpoint",
    "save_pretrained",
    "stats",
    "timeline",
]
__version__ = "0.1.0"
