"""The flags of ``infinity train`` (the command itself is :mod:`infinity.cli.train.command`)."""

from __future__ import annotations

import argparse

from infinity.cli.train import ranks
from infinity.cli.train.optimizers import CHOICES, HELP
from infinity.cli.train.settings import DEFAULT_PLOT, PRESETS
from infinity.config import ACTIVATION_POLICIES
from infinity.optim.chunk_optimizer import STATE_DTYPES

DEFAULT_CHECKPOINT_DIR = "./.infinity/checkpoints"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``infinity train``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n".join(
        [
            "presets:",
            *(
                f"  {name:<7} {p.layers:>2} x {p.hidden:<5} seq {p.seq_len:<4} {p.steps:>5} steps  "
                f"{p.about}"
                for name, p in PRESETS.items()
            ),
            "examples:",
            "  infinity train                                   # the demo (preset small)",
            "  infinity train --device-memory 2MiB --host-memory 16MiB --plot tight.png",
            "  infinity train --preset medium --checkpoint-every 100   # Ctrl-C, then --resume",
            "  infinity train --model ./my-llama --data notes.txt --steps 200   # fine-tune",
            "  infinity train --nproc 2          # 2 processes (torchrun -m infinity train: same)",
        ]
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        metavar="DIR",
        help="fine-tune this local transformers causal LM (config.json + safetensors) "
        "instead of the built-in GPT; needs --data",
    )
    model.add_argument(
        "--data",
        metavar="PATH",
        help="the text to train on: a text file, a folder of text files or a .jsonl file of "
        "examples; with --model encoded by its tokenizer, for the built-in GPT as bytes "
        "(default for the GPT: the standard library's Python sources)",
    )
    model.add_argument(
        "--output",
        metavar="DIR",
        help="with --model: where the fine-tuned model goes (default: ./.infinity/NAME-finetuned)",
    )
    model.add_argument(
        "--preset", choices=list(PRESETS), help="model size and run length (default: small)"
    )
    model.add_argument("--layers", metavar="N", type=int, help="transformer blocks")
    model.add_argument("--hidden", metavar="N", type=int, help="width of the residual stream")
    model.add_argument(
        "--heads", metavar="N", type=int, help="attention heads (must divide --hidden)"
    )
    model.add_argument("--seq-len", metavar="N", type=int, help="context length in bytes")
    model.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp16", "fp32"),
        help="compute dtype (default: auto, bf16 where the device computes it natively, else "
        "fp32; fp16 with loss scaling on GPUs without bf16)",
    )
    model.add_argument(
        "--device",
        metavar="DEVICE",
        help="where to compute: auto (the default: cuda if there is a GPU, else cpu), cpu, "
        "cuda, cuda:N, or fence (a test device that stands for a GPU on the CPU)",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--steps", metavar="N", type=int, help="optimizer steps of the whole run")
    train.add_argument("--batch-size", metavar="N", type=int, help="sequences per micro-batch")
    train.add_argument(
        "--grad-accum", metavar="N", type=int, help="micro-batches per optimizer step (default: 1)"
    )
    train.add_argument("--optimizer", choices=tuple(CHOICES), help=HELP.replace("%", "%%"))
    train.add_argument(
        "--lr",
        metavar="LR",
        type=float,
        help="peak learning rate (warmup, then cosine to 10%%); default: the preset's, "
        "scaled for --optimizer (lion: / 3, sgd: x 30, adafactor: x 30)",
    )
    train.add_argument(
        "--warmup",
        metavar="N",
        type=int,
        help="warmup steps (default: 10%% of --steps, at most 100)",
    )
    train.add_argument(
        "--clip-grad", metavar="NORM", type=float, help="max gradient norm, 0 = off (default: 1.0)"
    )
    train.add_argument(
        "--seed",
        metavar="N",
        type=int,
        help="seed of the initial weights and the batches (default: 0)",
    )
    train.add_argument(
        "--eval-batches",
        metavar="N",
        type=int,
        default=4,
        help="held-out batches for the eval loss (0 = skip)",
    )
    memory = parser.add_argument_group("memory tiers")
    memory.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="device budget, e.g. 64MiB (default: derived from the model)",
    )
    memory.add_argument(
        "--host-memory",
        metavar="SIZE",
        help="host budget, e.g. 1GiB (default: derived from the model)",
    )
    memory.add_argument(
        "--nvme-path",
        metavar="DIR",
        help="directory for swap files, or 'none' (default: ./.infinity/nvme)",
    )
    memory.add_argument(
        "--chunk-size", metavar="SIZE", help="bytes per chunk, a multiple of 4KiB (default: auto)"
    )
    memory.add_argument(
        "--optimizer-state-dtype",
        choices=STATE_DTYPES,
        help="how the optimizer's states (Adam's moments, Lion's and SGD's momentum) are "
        "stored: fp32 (exact), bf16, or int8 (block-quantised, about a quarter of the bytes; "
        "not for sgd); adafactor: fp32 only; default fp32, or the resumed run's",
    )
    memory.add_argument(
        "--activations",
        choices=ACTIVATION_POLICIES,
        help="the tensors autograd saves for backward: keep (in RAM, the default), "
        "checkpoint (recompute each block in backward), offload (to host memory, then "
        "NVMe, read back ahead of backward) or auto (measured in the first step, then per "
        "block: keep where device_memory has room, else offload, else checkpoint)",
    )
    memory.add_argument(
        "--config", metavar="FILE", help="an infinity.Config JSON file; flags override it"
    )
    state = parser.add_argument_group("checkpoints")
    state.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help=f"where checkpoints go, or 'none' (default: {DEFAULT_CHECKPOINT_DIR})",
    )
    state.add_argument(
        "--checkpoint-every",
        metavar="N",
        type=int,
        default=0,
        help="also save every N steps (default: at the end and on Ctrl-C)",
    )
    state.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="CHECKPOINT",
        help="continue the newest run in --checkpoint-dir (or the checkpoint given)",
    )
    state.add_argument(
        "--stop-after",
        type=int,
        metavar="STEP",
        help="stop after this step with a checkpoint, to --resume later",
    )
    ranks.add_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument(
        "--plot",
        metavar="PNG",
        default=DEFAULT_PLOT,
        help=f"memory-timeline PNG, or 'none' (default: {DEFAULT_PLOT})",
    )
    out.add_argument("--quiet", action="store_true", help="no header and no progress bar")
    out.add_argument("--json", action="store_true", help="JSON lines on stdout instead of text")
