"""How the ranks of a sharded model agree on the outcome of a pretrained load or save.

Loading is per rank (each reads the files and keeps its shard) and saving is
written by rank 0 alone, so a failure is first seen by one rank: at the agreed
points every rank learns which failed and why, and all raise together instead
of one training on while another waits in a collective that never comes.
"""

from __future__ import annotations

from infinity.distributed import Collectives
from infinity.pretrained.safetensors_io import PretrainedError


def agree(collectives: Collectives, error: BaseException | None, what: str, after: str) -> None:
    """Collective: re-raise this rank's ``error``, or raise :class:`PretrainedError`
    naming the first rank that failed to ``what`` and its error; ``after`` says
    what that leaves behind and what to do."""
    reason = None if error is None else f"{type(error).__name__}: {error}"
    reasons = collectives.gather_object(reason, what)
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(reasons) if text is not None]
    if failed:
        rank, text = failed[0]
        raise PretrainedError(f"rank {rank} could not {what} ({text}); {after}")
