"""How the ranks of a sharded model agree on the outcome of a save or a load.

A save is written by rank 0 alone while every rank takes part in gathering each
chunk; a load is read by each rank for its own shard. A failure is first seen by
one rank: at the agreed points every rank learns which failed and why, and all
raise together, instead of one training on while another waits in a
collective that never comes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from infinity.distributed.collectives import Collectives

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
