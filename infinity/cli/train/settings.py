"""Settings of an ``infinity train`` run: presets, flags, a config file and a resumed run.

Precedence, highest first: a flag on the command line, the run being resumed
(``--resume`` continues with the settings it was started with), the preset
(whose shape must then match the checkpoint's).
Budgets come from ``--device-memory``/``--host-memory``, else the ``--config``
file, else *demo budgets* derived from the model so that its states exceed
both the device and the host budget and every tier is used.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from infinity.cli.main import CommandError
from infinity.cli.train.optimizers import CHOICES, DEFAULT_OPTIMIZER
from infinity.cli.train.pretrained import (
    PretrainedModel,
    describe,
    inspect_model,
    reject_gpt_flags,
)
from infinity.config import AUTO, Config, ConfigError
from infinity.devices.choice import choose_dtype, resolve_device
from infinity.models.gpt import GPTConfig
from infinity.optim.chunk_optimizer import StateFormat
from infinity.runtime.budgets import DTYPE_OF
from infinity.utils.sizes import align_up, parse_size

DEFAULT_NVME_PATH = "./.infinity/nvme"
DEFAULT_PLOT = "./.infinity/timeline.png"
# Demo budgets. The device caches about half of the parameter chunks, so
# chunks are evicted in forward and fetched again in backward; the host holds
# half of all model states (parameters, gradients, staging and some optimizer
# units), so most optimizer states live on NVMe.
DEMO_DEVICE_FRACTION = 0.5  # of the parameter bytes
DEMO_HOST_FRACTION = 0.5  # of the model-state bytes
BUDGET_ALIGNMENT = 64 << 10
MAX_SEQ_LEN = 8192
# Config fields that have a flag here, to say engine messages in flags.
FLAG_OF = {
    "device_memory": "--device-memory",
    "host_memory": "--host-memory",
    "chunk_size": "--chunk-size",
    "nvme_path": "--nvme-path",
    "optimizer_state_dtype": "--optimizer-state-dtype",
}


@dataclass(frozen=True)
class Preset:
    """A model shape and the training length that suits it."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    about: str


PRESETS: dict[str, Preset] = {
    "tiny": Preset(2, 128, 4, 64, 8, 40, 3e-3, "seconds; for tests and smoke checks"),
    "small": Preset(4, 256, 4, 128, 16, 300, 1.2e-3, "the demo: a few minutes on 2 CPU cores"),
    "medium": Preset(8, 512, 8, 256, 16, 1000, 6e-4, "25M parameters, ~400 MB of states"),
    "large": Preset(12, 768, 12, 512, 8, 2000, 3e-4, "GPT-2 small shape, ~1.4 GB of states"),
    "xl": Preset(24, 1024, 16, 512, 8, 2000, 2e-4, "GPT-2 medium shape, ~5 GB of states"),
}
DEFAULT_PRESET = "small"
# Run length and batch of a fine-tuning run (--model); the shape is the model's.
FINE_TUNE = Preset(0, 0, 0, 0, 8, 100, 5e-5, "fine-tuning defaults")


@dataclass(frozen=True)
class RunSettings:
    """Everything that defines a training run (saved with each checkpoint)."""

    model: GPTConfig | PretrainedModel
    dtype: str
    batch_size: int
    grad_accum: int
    steps: int
    lr: float
    warmup: int
    min_lr_ratio: float
    weight_decay: float
    clip_grad: float
    seed: int
    optimizer_state_dtype: str = "fp32"  # how the moments are stored (absent before: fp32)
    optimizer: str = DEFAULT_OPTIMIZER  # --optimizer (absent before: adamw)
    # The built-in GPT's --data (an absolute path; a --model run's is the model's);
    # None: the standard library's Python sources (absent before: those).
    data: str | None = None

    @property
    def tokens_per_step(self) -> int:
        """Tokens (bytes) that one optimizer step trains on."""
        return self.batch_size * self.grad_accum * self.model.seq_len

    def state_bytes(self) -> int:
        """Bytes of model states: parameters, gradients, fp32 master (16-bit only), and
        the optimizer's states as stored (Adam's two moments, Lion's and SGD's one
        momentum; int8: with one fp32 scale per QBLOCK elements).

        Adafactor has no state in the chunks (none here, so its demo budgets
        are those of the parameters, gradients and master alone): its factors,
        about (rows + columns) x 4 bytes per matrix, live in host memory outside
        the budgets; the header shows them on a line of their own."""
        element = DTYPE_OF[self.dtype].itemsize
        master = 4 if element < 4 else 0
        n = self.model.num_params
        stored = StateFormat(self.optimizer_state_dtype)
        slots = CHOICES[self.optimizer].state_slots
        return n * (2 * element + master) + slots * (stored.data_bytes(n) + stored.scale_bytes(n))

    def param_bytes(self) -> int:
        """Bytes of the parameters in the compute dtype."""
        return self.model.num_params * DTYPE_OF[self.dtype].itemsize

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``from_dict`` rebuilds an equal object)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSettings:
        """Inverse of :meth:`to_dict`."""
        kind = PretrainedModel if "path" in data["model"] else GPTConfig
        return cls(**{**data, "model": kind(**data["model"])})


def run_device(args: argparse.Namespace) -> str:
    """The ``Config.device`` of the run: ``--device``, else the ``--config`` file's, else auto."""
    if getattr(args, "device", None) is not None:
        try:
            device = Config(device=args.device).device
        except ConfigError as exc:
            raise CommandError(str(exc).replace("device=", "--device ", 1)) from None
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise CommandError(
                f"--device {device}: there is no CUDA GPU here (torch.cuda.is_available() is "
                "False); use --device cpu or auto"
            )
        return device
    if args.config is not None:
        try:
            return Config.from_file(args.config).device
        except ConfigError as exc:
            raise CommandError(f"--config: {exc}") from None
    return AUTO


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise CommandError(f"{flag} must be a positive integer, got {value}")


def resolve_settings(args: argparse.Namespace, resumed: RunSettings | None) -> RunSettings:
    """The run's settings from flags, the resumed run and the preset (in that order)."""
    pretrained = _pretrained(args, resumed)
    preset = PRESETS[args.preset or DEFAULT_PRESET] if pretrained is None else FINE_TUNE
    for flag in ("layers", "hidden", "heads", "seq_len", "batch_size", "grad_accum", "steps"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.seq_len is not None and args.seq_len > MAX_SEQ_LEN:
        raise CommandError(
            f"--seq-len {args.seq_len} is above {MAX_SEQ_LEN}: activations (which stay in RAM) "
            "grow with its square; use a shorter context"
        )
    if args.warmup is not None and args.warmup < 0:
        raise CommandError(f"--warmup must be >= 0 steps, got {args.warmup}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise CommandError(f"--lr must be a positive number, got {args.lr}")
    if args.clip_grad is not None and not (math.isfinite(args.clip_grad) and args.clip_grad >= 0):
        raise CommandError(f"--clip-grad must be >= 0 (0 disables clipping), got {args.clip_grad}")

    def pick(name: str, preset_value: Any) -> Any:
        given = getattr(args, name)
        if given is not None:
            return given
        if resumed is not None:
            return (
                getattr(resumed, name) if hasattr(resumed, name) else getattr(resumed.model, name)
            )
        return preset_value

    if pretrained is not None:
        model: GPTConfig | PretrainedModel = pretrained
    else:
        shape = {
            key: pick(key, getattr(preset, key)) for key in ("layers", "hidden", "heads", "seq_len")
        }
        if shape["hidden"] % shape["heads"]:
            raise CommandError(
                f"--hidden {shape['hidden']} is not divisible by --heads {shape['heads']}; "
                f"pick a divisor, e.g. --heads {_divisor_below(shape['hidden'], shape['heads'])}"
            )
        model = GPTConfig(vocab_size=256, tie_embeddings=True, **shape)
    optimizer = _optimizer(args, resumed)
    choice = CHOICES[optimizer]
    steps = pick("steps", preset.steps)
    default_warmup = resumed.warmup if resumed is not None else max(1, min(100, steps // 10))
    dtype = pick("dtype", AUTO)  # See NOTE [dtype auto]: decided here, saved with the run
    if dtype == AUTO and resumed is not None:
        dtype = resumed.dtype
    elif dtype == AUTO:
        dtype = choose_dtype(resolve_device(run_device(args))).dtype
    settings = RunSettings(
        model=model,
        dtype=dtype,
        batch_size=pick("batch_size", preset.batch_size),
        grad_accum=pick("grad_accum", 1),
        steps=steps,
        lr=pick("lr", choice.default_lr(preset.lr)),
        warmup=args.warmup if args.warmup is not None else default_warmup,
        min_lr_ratio=resumed.min_lr_ratio if resumed is not None else 0.1,
        weight_decay=resumed.weight_decay if resumed is not None else choice.weight_decay,
        clip_grad=pick("clip_grad", 1.0),
        seed=pick("seed", 0),
        optimizer_state_dtype=pick("optimizer_state_dtype", "fp32"),
        optimizer=optimizer,
        data=None if pretrained is not None else _gpt_data(args, resumed),
    )
    check_state_dtype(optimizer, settings.optimizer_state_dtype)
    preset_shape = (preset.layers, preset.hidden, preset.heads, preset.seq_len)
    if resumed is not None and args.preset is not None:
        m = resumed.model
        if not isinstance(m, GPTConfig) or preset_shape != (m.layers, m.hidden, m.heads, m.seq_len):
            raise CommandError(
                f"--preset {args.preset} is not the shape of the checkpoint's model "
                f"({_shape(resumed)}); drop --preset when resuming"
            )
    if resumed is not None and (settings.model, settings.dtype) != (resumed.model, resumed.dtype):
        raise CommandError(
            f"the checkpoint holds a {_shape(resumed)} model but the flags ask for "
            f"{_shape(settings)}; resume with the checkpoint's shape, or use another "
            "--checkpoint-dir to start a new run"
        )
    return settings


def check_state_dtype(optimizer: str, dtype: str, source: str | None = None) -> None:
    """Refuse optimizer states stored as ``dtype`` where ``optimizer`` cannot store them
    so; ``source``: the ``--config`` file that asks for it (None: the flag)."""
    allowed = " or ".join(CHOICES[optimizer].state_dtypes)
    if dtype in CHOICES[optimizer].state_dtypes:
        return
    if source is None:
        asked, fix = f"--optimizer-state-dtype {dtype}", "or drop the flag"
    else:
        asked, fix = f"optimizer_state_dtype {dtype} in {source}", "which overrides it"
    raise CommandError(
        f"--optimizer {optimizer} keeps {CHOICES[optimizer].states} in {allowed} only, not "
        f"{asked}; "
        f"pass --optimizer-state-dtype {allowed.split(' or ')[0]} ({fix})"
    )


def _optimizer(args: argparse.Namespace, resumed: RunSettings | None) -> str:
    """``--optimizer``, or the resumed run's; a resumed run cannot change it (its
    checkpoint holds that optimizer's states, which no other one can continue)."""
    given = getattr(args, "optimizer", None)
    if resumed is None:
        return given or DEFAULT_OPTIMIZER
    if given is not None and given != resumed.optimizer:
        raise CommandError(
            f"--optimizer {given}: the checkpoint was trained with --optimizer "
            f"{resumed.optimizer}, whose states {given} cannot continue; resume with "
            f"--optimizer {resumed.optimizer} (or without the flag), or use another "
            "--checkpoint-dir to start a new run"
        )
    return resumed.optimizer


def _pretrained(args: argparse.Namespace, resumed: RunSettings | None) -> PretrainedModel | None:
    """The fine-tuned model of a ``--model`` run (or of the run being resumed)."""
    if resumed is not None and isinstance(resumed.model, PretrainedModel):
        reject_gpt_flags(args, resumed.model.path)
        given = getattr(args, "model", None)
        if given is not None and str(Path(given).absolute()) != resumed.model.path:
            raise CommandError(
                f"--model {given}: the checkpoint fine-tunes {resumed.model.path}; drop --model "
                "when resuming, or use another --checkpoint-dir to start a new run"
            )
        return resumed.model
    if getattr(args, "model", None) is None:
        return None
    return inspect_model(args, args.seq_len)


def _gpt_data(args: argparse.Namespace, resumed: RunSettings | None) -> str | None:
    """The built-in GPT's ``--data`` (or the resumed run's); a resumed run keeps its text
    (a resume is exact only on the same batches)."""
    if getattr(args, "output", None) is not None:
        raise CommandError(
            "--output is where a fine-tuned --model is written; the built-in GPT's weights "
            "are in its checkpoints (--checkpoint-dir), so drop --output"
        )
    given = getattr(args, "data", None)
    given = None if given is None else str(Path(given).absolute())
    if resumed is None or given is None:
        return given if resumed is None else resumed.data
    if given != resumed.data:
        trained = resumed.data or "the standard library's Python sources (no --data)"
        raise CommandError(
            f"--data {args.data}: the checkpoint trained on {trained}; resume with the same "
            "--data (or without the flag), or use another --checkpoint-dir to start a new run"
        )
    return given


def _divisor_below(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _shape(s: RunSettings) -> str:
    m = s.model
    if isinstance(m, PretrainedModel):
        return f"{describe(m)}, {s.dtype}"
    return f"{m.layers}x{m.hidden} ({m.heads} heads, seq {m.seq_len}, {s.dtype})"


def _size_flag(flag: str, text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    try:
        return parse_size(text, name=flag)
    except ValueError:
        raise CommandError(f"{flag} {text!r} is not a size; use e.g. 64MiB, 2GiB or auto") from None


def build_config(args: argparse.Namespace, settings: RunSettings) -> tuple[Config, tuple[str, ...]]:
    """The ``infinity.Config`` for the run, and which budgets were derived (demo budgets)."""
    given: dict[str, Any] = {}
    if args.config is not None:
        try:
            given = Config.from_file(args.config).to_dict()
            keys = set(json.loads(Path(args.config).read_text()))
        except ConfigError as exc:
            raise CommandError(f"--config: {exc}") from None
        given = {k: v for k, v in given.items() if k in keys}
    for key, flag in (
        ("device_memory", "--device-memory"),
        ("host_memory", "--host-memory"),
        ("chunk_size", "--chunk-size"),
    ):
        value = _size_flag(flag, getattr(args, key))
        if value is not None:
            given[key] = value
    if args.nvme_path is not None:
        given["nvme_path"] = None if args.nvme_path.lower() == "none" else args.nvme_path
    given["dtype"] = settings.dtype
    given["device"] = run_device(args)
    if args.optimizer_state_dtype is not None or "optimizer_state_dtype" not in given:
        given["optimizer_state_dtype"] = settings.optimizer_state_dtype
    if given["optimizer_state_dtype"] != settings.optimizer_state_dtype:  # from --config
        check_state_dtype(settings.optimizer, given["optimizer_state_dtype"], args.config)
    if getattr(args, "activations", None) is not None:
        given["activations"] = args.activations
    given.setdefault("nvme_path", DEFAULT_NVME_PATH)
    derived = []
    if "device_memory" not in given:
        need = math.ceil(settings.param_bytes() * DEMO_DEVICE_FRACTION)
        given["device_memory"] = align_up(need, BUDGET_ALIGNMENT)
        derived.append("device_memory")
    if "host_memory" not in given:
        need = math.ceil(settings.state_bytes() * DEMO_HOST_FRACTION)
        given["host_memory"] = align_up(need, BUDGET_ALIGNMENT)
        derived.append("host_memory")
    try:
        return Config.from_dict(given), tuple(derived)
    except ConfigError as exc:
        raise CommandError(as_flags(str(exc))) from None


def as_flags(message: str) -> str:
    """An engine message in this command's words: ``device_memory=X`` → ``--device-memory X``."""
    for field in FLAG_OF:
        message = message.replace(f"{field}=", f"{FLAG_OF[field]} ").replace(field, FLAG_OF[field])
    return message


def grow_derived(config: Config, derived: tuple[str, ...], error: str) -> Config:
    """Grow the derived budget the planner found too small by half (both if unclear).

    For small models the planner's minimum (one module's chunks, staging slots)
    can outweigh the fractions above."""
    named = [key for key in derived if error.startswith(f"{key}=")]
    grown = {
        key: align_up(getattr(config, key) * 3 // 2, BUDGET_ALIGNMENT) for key in named or derived
    }
    return config.replace(**grown)
