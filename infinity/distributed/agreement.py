"""What the ranks of a sharded model must agree on: the same model and Config at
``offload``, and the outcome of a save or a load.

Every rank must offload the same model with the same Config. A rank with another
chunk layout would send shards of another size or meaning into every collective:
gloo errors at best, silently mixed parameters at worst. So before the engine is
built the ranks compare a fingerprint of the Config and of the model's
parameters, and every rank raises naming the first difference.

What may differ per rank: ``nvme_path`` (each machine has its own disks; only
whether the NVMe tier is on must agree) and the device index (``cuda:0`` on one
rank, ``cuda:1`` on the next: only the device type must agree). Budgets must be
equal as written (``"auto"`` agrees with ``"auto"``): they are per process, and
the chunk size searched from them must come out the same on every rank.

A save is written by rank 0 alone while every rank takes part in gathering each
chunk; a load is read by each rank for its own shard. A failure is first seen by
one rank: at the agreed points every rank learns which failed and why, and all
raise together, instead of one training on while another waits in a
collective that never comes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, TypeVar, cast

from torch import nn

from infinity.config import AUTO, Config
from infinity.distributed.collectives import Collectives, DistributedError

_SAME_EVERYWHERE = "Every rank must offload the same model with the same Config"


def config_fingerprint(config: Config) -> dict[str, str]:
    """The Config fields that must agree across ranks, as comparable strings."""
    data: dict[str, Any] = config.to_dict()
    data["nvme_path"] = "a path (NVMe on)" if config.nvme_path is not None else None
    if config.device != AUTO:
        data["device"] = str(config.device).split(":")[0]
    return {name: json.dumps(value, sort_keys=True) for name, value in data.items()}


def model_fingerprint(model: nn.Module) -> dict[str, str]:
    """Each parameter name -> its shape, dtype, requires_grad (and what it is tied to)."""
    seen: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = seen.setdefault(id(param), name)
        tied = f", tied to {first}" if first != name else ""
        out[name] = (
            f"shape {tuple(param.shape)}, {param.dtype}, requires_grad={param.requires_grad}{tied}"
        )
    return out


def check_agreement(collectives: Collectives, config: Config, model: nn.Module) -> None:
    """Raise :class:`DistributedError` on every rank unless all ranks offload the same
    model with the same Config (see the module docstring for what may differ).

    One small all-gather of digests; the full fingerprints only travel when they differ.
    """
    parts = {"Config field": config_fingerprint(config), "parameter": model_fingerprint(model)}
    blob = json.dumps(parts, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()
    digests = collectives.gather_object(digest, "comparing the Config and model across ranks")
    if all(d == digests[0] for d in digests):
        return
    gathered = collectives.gather_object(parts, "gathering the differing Config/model fingerprints")
    everyone = cast(list[dict[str, dict[str, str]]], gathered)
    rank = next(r for r, d in enumerate(digests) if d != digests[0])
    raise DistributedError(_first_difference(everyone[0], everyone[rank], rank))


def _first_difference(
    mine: dict[str, dict[str, str]], theirs: dict[str, dict[str, str]], rank: int
) -> str:
    for kind in mine:
        ours, other = mine[kind], theirs[kind]
        for name in [*ours, *(n for n in other if n not in ours)]:
            a, b = ours.get(name, "missing"), other.get(name, "missing")
            if a != b:
                return (
                    f"the model or Config differs across ranks: {kind} {name!r} is {a} on "
                    f"rank 0 and {b} on rank {rank}. {_SAME_EVERYWHERE} (only the nvme_path "
                    "folder and the device index may differ)"
                )
    return f"the model or Config differs across ranks 0 and {rank}. {_SAME_EVERYWHERE}"


def check_same_units(collectives: Collectives, units: str, why: str) -> None:
    """Raise on every rank unless all lay their chunks out for the same ``units`` (a
    chunk optimizer and its state format; ``why``: what asked, for the message).

    NOTE [the layout is decided once, late]: the layout is collective (each chunk is
    sharded; a meta model's initial values are rank 0's, broadcast). A rank that
    reads the model alone before the others construct their optimizer waits here
    for them, then every rank raises.
    """
    everyone = cast(
        "list[tuple[str, str]]",
        collectives.gather_object((units, why), "agreeing on the units to lay out for"),
    )
    differ = [r for r, theirs in enumerate(everyone) if theirs[0] != everyone[0][0]]
    if differ:
        (a, a_why), (b, b_why) = everyone[0], everyone[differ[0]]
        raise DistributedError(
            f"the ranks lay their chunks out for different optimizers: rank 0 for {a} "
            f"(at {a_why}), rank {differ[0]} for {b} (at {b_why}). Under data parallel "
            "construct the same optimizer on every rank right after infinity.offload(), "
            "before any forward or read of the model"
        )


T = TypeVar("T")


def agree(
    collectives: Collectives,
    error: BaseException | None,
    what: str,
    after: str,
    error_type: Callable[[str], BaseException] = RuntimeError,
) -> None:
    """Collective: re-raise this rank's ``error``, or raise ``error_type`` naming the
    first rank that failed to ``what`` and its error; ``after`` says what that
    leaves behind and what to do."""
    reason = None if error is None else f"{type(error).__name__}: {error}"
    reasons = collectives.gather_object(reason, what)
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(reasons) if text is not None]
    if failed:
        rank, text = failed[0]
        raise error_type(f"rank {rank} could not {what} ({text}); {after}")


def rank_zero_writes(
    collectives: Collectives,
    what: str,
    prepare: Callable[[], T],
    write: Callable[[T | None], None],
    *,
    before: str,
    after: str,
    error_type: Callable[[str], BaseException] = RuntimeError,
) -> T | None:
    """Collective save: ``prepare()`` on rank 0 (its place to write, e.g. a temporary
    directory), agreed; then ``write(prepared)`` on every rank, ``None`` on the
    others (they only join the gathers), agreed again. Returns what ``prepare``
    made on rank 0, ``None`` elsewhere.

    ``write`` must take part in every gather even after a failed write (rank 0
    keeps reading chunks), and undo what it wrote before raising. ``before`` and
    ``after`` say what a failure in each phase leaves behind.
    """
    error: BaseException | None = None
    prepared: T | None = None
    if collectives.world.rank == 0:
        try:
            prepared = prepare()
        except BaseException as exc:  # reported to every rank, then re-raised
            error = exc
    agree(collectives, error, what, before, error_type)
    try:
        write(prepared)
    except BaseException as exc:  # reported to every rank, then re-raised
        error = exc
    agree(collectives, error, what, after, error_type)
    return prepared
