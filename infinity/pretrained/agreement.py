"""How the ranks of a sharded model agree on the outcome of a pretrained load or save
(:mod:`infinity.distributed.agreement`, raising :class:`PretrainedError`)."""

from __future__ import annotations

from infinity.distributed import Collectives
from infinity.distributed.agreement import agree as agree_on
from infinity.pretrained.safetensors_io import PretrainedError


def agree(collectives: Collectives, error: BaseException | None, what: str, after: str) -> None:
    """Collective: re-raise this rank's ``error``, or raise :class:`PretrainedError`
    naming the first rank that failed to ``what`` and its error; ``after`` says
    what that leaves behind and what to do."""
    agree_on(collectives, error, what, after, PretrainedError)
