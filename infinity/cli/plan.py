"""``infinity plan``: where each kind of state would live, the bytes moved per step,
and the activations a step saves.

Nothing is allocated: the model is built on the ``meta`` device, laid out in
chunks and planned against the budgets, exactly as ``infinity.offload`` would.
The activation lines say what each ``Config.activations`` policy keeps per step
at ``--batch-size`` x ``--seq-len``, and the tokens per step that fit beside the
states.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from infinity.activations.blocks import recomputed_blocks
from infinity.activations.estimate import estimate, step_memory
from infinity.activations.policy import choose_blocks
from infinity.chunks.movers import Purpose, route_table
from infinity.cli.main import CommandError
from infinity.config import Config, ConfigError
from infinity.core.names import DEVICE, HOST, NVME
from infinity.core.plan import Plan
from infinity.devices.choice import resolved
from infinity.distributed import World
from infinity.models.gpt import GPT, describe
from infinity.models.presets import PRESETS, preset
from infinity.optim.adafactor import ADAFACTOR
from infinity.optim.chunk_optimizer import STATE_DTYPES, ChunkOptimizer
from infinity.optim.cpu_adam import ADAM
from infinity.optim.lion import LION
from infinity.optim.sgd import SGD
from infinity.runtime.budgets import DTYPE_OF, plan_for
from infinity.runtime.params import ParamRegistry
from infinity.schedule.planner import PlanError
from infinity.utils.process_memory import resident_bytes
from infinity.utils.sizes import format_size

# The optimizer the plan is made for (NOTE [the layout is decided once, late]): the
# names of `infinity train --optimizer`, each with the chunk optimizer its front-end
# (CPUAdam, CPULion, CPUSGD, CPUAdafactor) binds.
OPTIMIZERS: dict[str, ChunkOptimizer] = {
    "adamw": ADAM,
    "lion": LION,
    "sgd": SGD,
    "adafactor": ADAFACTOR,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``infinity plan``."""
    parser.add_argument(
        "--model",
        default="small",
        help=f"a GPT preset ({', '.join(PRESETS)}) or a transformers config.json path",
    )
    for flag in ("layers", "hidden", "heads", "vocab-size"):
        parser.add_argument(f"--{flag}", type=_positive_int, help=f"override the preset's {flag}")
    parser.add_argument(
        "--seq-len",
        type=_positive_int,
        help="tokens per sequence: the preset's context, and the activation estimate's "
        "(default for a config.json: 2048)",
    )
    parser.add_argument("--device-memory", default="auto", help="device budget, e.g. 2GiB")
    parser.add_argument("--host-memory", default="auto", help="host budget, e.g. 8GiB")
    parser.add_argument("--nvme-path", default=None, help="directory of the NVMe tier")
    parser.add_argument("--nvme-memory", default="auto", help="cap on swap bytes")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="compute dtype (default auto: bf16 where the device computes it natively, else fp32)",
    )
    parser.add_argument("--chunk-size", default="auto", help="bytes per chunk or 'auto'")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or fence")
    parser.add_argument(
        "--overlap-optimizer",
        action="store_true",
        help="plan for Config(overlap_optimizer=True): gradients on NVMe never reach the disk",
    )
    parser.add_argument(
        "--optimizer-state-dtype",
        default="fp32",
        choices=STATE_DTYPES,
        help="how Adam's moments are stored (Config.optimizer_state_dtype)",
    )
    parser.add_argument(
        "--nproc",
        type=_processes,
        default=1,
        help="plan for one rank of N data-parallel processes (per-rank bytes and communication)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=1,
        help="sequences per step, for the activation estimate (with --seq-len)",
    )
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=sorted(OPTIMIZERS),
        help="plan for this optimizer's state (the homes the optimizer constructed over the "
        "model gets); default adamw",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _positive_int(text: str, of: str = "") -> int:
    """A count flag (``--layers``, ``--seq-len``, ...): a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number{of}, got {text!r}")
    return value


def _processes(text: str) -> int:
    """``--nproc``: a whole number of processes, at least 1."""
    return _positive_int(text, " of processes")


def _build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    if Path(args.model).is_dir() and (Path(args.model) / "config.json").is_file():
        args.model = str(Path(args.model) / "config.json")  # a saved model's folder
    if args.model.endswith(".json"):
        if not Path(args.model).is_file():
            raise CommandError(
                f"--model {args.model!r}: no such file; give a transformers config.json (or the "
                f"folder holding one) or a GPT preset ({', '.join(PRESETS)})"
            )
        try:
            import transformers
        except ImportError:
            raise CommandError(
                "reading a config.json needs transformers: pip install 'infinity-offload[hf]'"
            ) from None
        try:
            cfg = transformers.AutoConfig.from_pretrained(args.model)
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read model config {args.model!r}: {exc}") from None
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in model.parameters())
        return model, f"{cfg.model_type} from {args.model} ({n / 1e6:.1f}M parameters)"
    try:
        cfg = preset(
            args.model,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            vocab_size=args.vocab_size,
            seq_len=args.seq_len,
        )
    except (KeyError, ValueError) as exc:
        raise CommandError(str(exc).strip("'\"")) from None
    with torch.device("meta"):
        model = GPT(cfg)
    return model, describe(cfg)


def run(args: argparse.Namespace) -> int:
    """Print the plan for the model and budgets."""
    try:
        config = Config(
            device_memory=args.device_memory,
            host_memory=args.host_memory,
            nvme_path=args.nvme_path,
            nvme_memory=args.nvme_memory,
            dtype=args.dtype,
            chunk_size=args.chunk_size,
            device=args.device,
            overlap_optimizer=args.overlap_optimizer,
            optimizer_state_dtype=args.optimizer_state_dtype,
        )
        config = resolved(config)
    except ConfigError as exc:
        raise CommandError(str(exc)) from None
    model, title = _build_model(args)
    device = torch.device(config.device)
    try:
        # Planning needs no process group: every rank's shard has the same size.
        world = World(rank=0, size=args.nproc)
        registry = ParamRegistry.from_model(model, recomputed_blocks(model, config))
        plan = plan_for(registry, config, device, OPTIMIZERS[args.optimizer], world=world)
    except PlanError as exc:
        raise CommandError(str(exc)) from None
    except ValueError as exc:  # a state dtype the optimizer cannot store
        raise CommandError(f"--optimizer {args.optimizer}: {exc}") from None
    seq_len = args.seq_len or _seq_len_of(model)
    act = activations_at(model, plan, config, args.batch_size, seq_len)
    if args.json:
        n = plan.layout.num_chunks
        per_rank = {"nproc": plan.shard_count} if plan.sharded else {}
        print(
            json.dumps(
                {
                    **per_rank,
                    "model": title,
                    "chunk_size": plan.layout.chunk_bytes,
                    "num_chunks": n,
                    "device_bytes": plan.device_bytes,
                    # NOTE [chunks homed on the device]: beside the slots, in the device budget
                    "device_home_bytes": plan.home_bytes(DEVICE),
                    "host_bytes": plan.host_bytes,
                    "nvme_bytes": plan.nvme_bytes,
                    "staging_bytes": plan.staging_bytes,
                    "span_bytes": plan.span_elems * plan.element_size,
                    "min_device_bytes": plan.min_device_bytes,
                    "min_host_bytes": plan.min_host_bytes,
                    "homes": {
                        "param": list(plan.param_home),
                        "grad": list(plan.grad_home),
                        "optim": list(plan.optim_home),
                    },
                    "traffic_per_step": plan.traffic,
                    "routes": dict(_routes(plan)),
                    "optimizer": args.optimizer,
                    "optimizer_state_dtype": plan.state_dtype,
                    "optim_bytes": sum(plan.optim_bytes(i) for i in range(n) if plan.optim_home[i]),
                    # the optimizer's per-tensor states (Adafactor's factors), in host_bytes
                    "tensor_state_bytes": plan.tensor_state_bytes,
                    "activations": act,
                }
            )
        )
        return 0
    print(title)
    states = format_size(sum(plan.home_bytes(tier) for tier in (DEVICE, HOST, NVME)))
    print(f"model states: {states}" + (" per rank" if plan.sharded else ""))
    print(plan.describe())
    print("routes (how the bytes of each home travel):")
    for name, route in _routes(plan):
        print(f"  {name:<24}{route}")
    for line in activation_lines(act):
        print(line)
    return 0


def _routes(plan: Plan) -> list[tuple[str, str]]:
    """The route of each (purpose, home tier) the plan uses: how its bytes travel."""
    table = route_table()  # neither backend reads NVMe into the device yet
    used = [
        *((Purpose.COMPUTE, t) for t in plan.param_home),
        *((Purpose.FLUSH, t) for t in plan.grad_home if t is not None),
        *((Purpose.STEP, t) for t in (*plan.param_home, *plan.optim_home) if t is not None),
    ]
    return [
        (f"{purpose} from {tier}", str(table(purpose, tier)))
        for purpose, tier in dict.fromkeys(used)
    ]


def _seq_len_of(model: torch.nn.Module) -> int:
    """The GPT's context, or a transformers model's capped at a typical fine-tuning length."""
    gpt = getattr(model, "cfg", None)
    if gpt is not None and hasattr(gpt, "seq_len"):
        return int(gpt.seq_len)
    cfg = getattr(model, "config", None)
    return min(2048, int(getattr(cfg, "max_position_embeddings", 2048) or 2048))


def activations_at(
    model: torch.nn.Module, plan: Plan, config: Config, batch: int, seq_len: int
) -> dict[str, Any]:
    """Saved bytes per step under each policy, and what fits (a JSON-ready dict).

    Activations count against the device budget: what the chunk slots
    leave of it holds "keep"'s and "checkpoint"'s activations; "offload" moves
    them to what the states leave of the host budget, then to NVMe.
    """
    target = "cuda" if config.device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    try:
        est = estimate(model, batch, seq_len, DTYPE_OF[config.dtype], target)
    except (ConfigError, TypeError, RuntimeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    tokens = batch * seq_len
    slots = plan.min_device_bytes or plan.device_bytes
    host_room = max(0, plan.budgets.host - plan.host_bytes)
    nvme_room = None if plan.budgets.nvme is None else max(0, plan.budgets.nvme - plan.nvme_bytes)
    one_block = max(est.per_block, default=est.total)
    on_device = {"keep": est.total, "checkpoint": est.checkpoint, "offload": one_block}
    room = max(0, plan.budgets.device - slots)
    # "auto" keeps blocks in the room the plan's own slots leave (as the engine does)
    auto_room = max(0, plan.budgets.device - plan.device_reserved_bytes)

    def fit(policy: str) -> int:
        per_token = on_device[policy] / tokens
        fits = int(room / per_token) if per_token else 0
        if policy == "offload" and est.total:
            fits = min(fits, int((host_room + (nvme_room or 0)) / (est.total / tokens)))
        return fits

    auto = choose_blocks(est.per_block, auto_room, host_room, has_nvme=nvme_room is not None)
    work = _working_set(model, config, batch, seq_len, target)
    return {
        "working_set_bytes": work,
        # the step's peak per tier (runtime/memory.py): the device's lines and working set;
        # the host's lines and this process's resident set now (the libraries and model)
        "forecast_device_peak": plan.device_reserved_bytes + work,
        "device_in_host": target == "cpu",
        "forecast_resident_peak": resident_bytes()
        + plan.host_bytes
        + (plan.device_reserved_bytes + work if target == "cpu" else 0),
        "auto": {c: auto.count(c) for c in ("keep", "offload", "checkpoint")},
        "batch_size": batch,
        "seq_len": seq_len,
        "saved_bytes": est.total,
        "blocks": len(est.per_block),
        "device_bytes": on_device,
        "min_chunk_slot_bytes": slots,
        "device_memory_needed": {k: slots + v for k, v in on_device.items()},
        "host_room_bytes": host_room,
        "nvme_room_bytes": nvme_room,
        "tokens_that_fit": {policy: fit(policy) for policy in on_device},
    }


def _working_set(
    model: torch.nn.Module, config: Config, batch: int, seq_len: int, target: str
) -> int:
    """The step's working set on the device (``step_memory``): the model's own loss over
    ``batch x seq_len`` token ids, under ``config.activations`` ("auto" at its most)."""
    ids = torch.zeros((batch, seq_len), dtype=torch.long, device=target)

    def step(m: torch.nn.Module) -> torch.Tensor:
        try:
            return m(input_ids=ids, labels=ids).loss
        except TypeError:  # not a transformers model: the GPT takes (ids, targets)
            return m(ids, ids)

    policy = "keep" if config.activations == "auto" else config.activations
    return step_memory(model, step, DTYPE_OF[config.dtype], target, policy=policy).peak


def activation_lines(act: dict[str, Any]) -> list[str]:
    """The plan's text lines for :func:`activations_at`'s result."""
    if "error" in act:
        return [f"activations: not estimated ({act['error']})"]
    tokens = act["batch_size"] * act["seq_len"]
    dev = act["device_bytes"]
    need = act["device_memory_needed"]
    fits = act["tokens_that_fit"]
    nvme = act["nvme_room_bytes"]
    return [
        f"activations of {act['batch_size']} x {act['seq_len']} tokens (Config.activations), "
        f"{format_size(act['saved_bytes'])} saved ({format_size(act['saved_bytes'] / tokens)} "
        "per token):",
        f"  keep        {format_size(dev['keep']):>12} on the device",
        f"  checkpoint  {format_size(dev['checkpoint']):>12} on the device (block inputs, and "
        f"one of {act['blocks']} blocks recomputed at a time)",
        f"  offload     {format_size(dev['offload']):>12} on the device (at most about one "
        f"block's); the rest to host memory ({format_size(act['host_room_bytes'])} free "
        "beside the states)"
        + (f", then NVMe ({format_size(nvme)} free)" if nvme is not None else ", no NVMe tier"),
        "  auto        per block, last first: "
        + ", ".join(f"{n} {c}" for c, n in act["auto"].items() if n)
        + " (keep where the plan's chunk slots leave device room, then offload, then "
        "checkpoint)",
        f"  device_memory they need beside the smallest chunk slots "
        f"({format_size(act['min_chunk_slot_bytes'])}): keep {format_size(need['keep'])}, "
        f"checkpoint {format_size(need['checkpoint'])}, offload {format_size(need['offload'])}",
        f"  tokens per step that fit these budgets: keep {fits['keep']}, "
        f"checkpoint {fits['checkpoint']}, offload {fits['offload']}",
        f"forecast peak of a step (Config.activations): working set "
        f"{format_size(act['working_set_bytes'])} on the device beside its chunk slots = "
        f"device {format_size(act['forecast_device_peak'])}; resident set "
        f"{format_size(act['forecast_resident_peak'])} (this process now, the host's lines"
        + (", the device's" if act["device_in_host"] else "")
        + ")",
    ]
