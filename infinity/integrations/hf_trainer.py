"""``transformers.Trainer`` checkpoints of an offloaded model that stream, atomically.

The Trainer's own checkpoint copies ``model.state_dict()`` and
``optimizer.state_dict()`` into RAM, which a model larger than host memory
cannot afford. With :class:`StreamedCheckpoints` mixed in (or the ready-made
:class:`Trainer`), ``save_strategy="steps"`` writes, into each
``checkpoint-N`` folder, the model's weights with :func:`infinity.save_pretrained`
(``transformers`` loads them) and an ``infinity/`` folder holding
:func:`infinity.save_checkpoint` (fp32 masters, moments, step counts), both
streamed chunk by chunk; the scheduler, RNG and trainer state are the
Trainer's own (small) files. ``trainer.train(resume_from_checkpoint=...)``
restores the model and optimizer from ``infinity/`` and resumes exactly.
Built without an optimizer, it trains an offloaded model with
:class:`~infinity.optim.CPUAdam` from the ``TrainingArguments`` (torch's AdamW, the
Trainer's default, for a model that is not offloaded).

::

    from infinity.integrations.hf_trainer import Trainer      # or StreamedCheckpoints
    trainer = Trainer(model=offloaded, args=args, optimizers=(CPUAdam(...), scheduler), ...)

For a model that is not offloaded, everything is the Trainer's own behaviour.
A mixin over documented Trainer methods (``save_model``, the optimizer's choice and
the optimizer/scheduler save and load hooks); nothing of transformers is patched.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from torch import nn

from infinity.checkpoint import load_checkpoint, save_checkpoint
from infinity.offload import find_engine
from infinity.optim import CPUAdam
from infinity.pretrained import save_pretrained

# The folder inside each checkpoint-N that holds infinity's checkpoint.
STATE_DIR = "infinity"
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's own name for it


# TrainingArguments.optim values that mean torch's AdamW: CPUAdam steps an offloaded model.
_TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")


def _offloaded(model: Any) -> nn.Module | None:
    """The offloaded model behind ``model`` (unwrapped), or ``None``."""
    inner = getattr(model, "module", model)  # DDP-style wrappers
    return inner if isinstance(inner, nn.Module) and find_engine(inner) is not None else None


class StreamedCheckpoints:
    """Mix into a ``transformers.Trainer`` subclass (first in the bases) for streamed
    checkpoints of an offloaded model; see the module docstring."""

    model: Any
    optimizer: Any
    lr_scheduler: Any
    args: Any
    processing_class: Any

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model's weights, streamed with :func:`infinity.save_pretrained`."""
        model = _offloaded(self.model)
        if model is None:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        output_dir = output_dir or self.args.output_dir
        _save_weights_into(model, output_dir, self.args.should_save)
        if self.processing_class is not None and self.args.should_save:
            self.processing_class.save_pretrained(output_dir)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, Any]:
        """The optimizer the Trainer builds when none was given: for an offloaded model,
        :class:`~infinity.optim.CPUAdam` where ``args.optim`` is torch's AdamW (the
        default), with the arguments' learning rate, betas and epsilon (the Trainer
        groups the parameters and sets each group's weight decay, as for AdamW);
        another choice raises, naming what to do. Otherwise the Trainer's own."""
        import transformers

        if model is None or _offloaded(model) is None:
            return transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        optim = getattr(args.optim, "value", args.optim)
        if optim not in _TORCH_ADAMW:
            raise ValueError(
                f"TrainingArguments(optim={optim!r}) cannot step an offloaded model: its "
                "parameters are updated by infinity's optimizers only. Leave optim at its "
                "default (torch's AdamW, run as infinity.optim.CPUAdam), or construct one of "
                "infinity.optim's optimizers and pass optimizers=(optimizer, scheduler)"
            )
        betas = (args.adam_beta1, args.adam_beta2)
        return CPUAdam, {"lr": args.learning_rate, "betas": betas, "eps": args.adam_epsilon}

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        model = _offloaded(self.model)
        if model is None:
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
            return
        # Collective under data parallel: every rank calls it, rank 0 writes.
        save_checkpoint(os.path.join(output_dir, STATE_DIR), model, _inner(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if _offloaded(model if model is not None else self.model) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        # Offloaded: weights come back with the optimizer, from the streamed state.

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        model = _offloaded(self.model)
        if model is None or checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        state = os.path.join(checkpoint, STATE_DIR)
        if not os.path.isdir(state):
            raise FileNotFoundError(
                f"{checkpoint} has no {STATE_DIR}/ folder: it was not written by "
                "infinity.integrations.hf_trainer (resume from one of its checkpoints, or "
                "load the weights with infinity.load_pretrained and start a new run)"
            )
        load_checkpoint(state, model, _inner(self.optimizer))
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _save_weights_into(model: nn.Module, output_dir: str, writer: bool) -> None:
    """:func:`infinity.save_pretrained` into a folder that holds other files too.

    ``save_pretrained`` replaces a whole directory atomically and refuses one
    with files it would not write (the Trainer's output folder holds its
    checkpoints), so the weights are saved into a fresh folder beside it and
    each file is then renamed into place: every file is replaced atomically,
    and nothing else in the folder is touched.
    """
    parent = os.path.dirname(os.path.abspath(output_dir))
    # The same path on every rank (a sharded save checks that they agree).
    staging = os.path.join(parent, f".{os.path.basename(os.path.abspath(output_dir))}.weights")
    if writer:
        shutil.rmtree(staging, ignore_errors=True)  # a save that died before its renames
    try:
        save_pretrained(model, staging)  # collective under data parallel; rank 0 writes
        if writer:
            os.makedirs(output_dir, exist_ok=True)
            for name in os.listdir(staging):
                os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
    finally:
        if writer:
            shutil.rmtree(staging, ignore_errors=True)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The user's optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def __getattr__(name: str) -> Any:
    """``Trainer``: ``transformers.Trainer`` with :class:`StreamedCheckpoints`.

    Built on first use (PEP 562) so that this module imports without the
    optional ``transformers``; ``from infinity.integrations.hf_trainer import
    Trainer`` works the same.
    """
    if name != "Trainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import transformers

    trainer = type(
        "Trainer",
        (StreamedCheckpoints, transformers.Trainer),
        {"__doc__": __getattr__.__doc__, "__module__": __name__, "__qualname__": "Trainer"},
    )
    globals()["Trainer"] = trainer
    return trainer
