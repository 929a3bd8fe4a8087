"""What a failed collective means, in words a user can act on.

Measured with gloo on one machine (``tests/distributed/test_faults.py``): a peer
that exits or crashes, before or during a collective, closes its connections and
the waiting rank's call fails within milliseconds ("Connection reset by peer" /
"Connection closed by peer"); a peer that is alive but never joins the call is
only noticed at the process group's timeout ("Timed out waiting ...").
"""

from __future__ import annotations

import re

from infinity.distributed.world import World

_CLOSED = ("connection reset", "connection closed", "broken pipe", "connection refused")
_TIMED_OUT = ("timed out", "timeout")
# gloo prefixes its source location and appends the same advice to every error.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
_BOILERPLATE = " This is typically caused by"


def failure_message(world: World, what: str, exc: BaseException) -> str:
    """``rank r of n: <what> failed: <why, and what to look at>. (<backend's words>)``."""
    text = str(exc)
    lowered = text.lower()
    peer = f"rank {1 - world.rank}" if world.size == 2 else "a peer rank"
    if any(word in lowered for word in _CLOSED):
        cause = (
            f"the connection to {peer} closed: that process exited or crashed (its own "
            "error, if it had one, is in its output)"
        )
    elif any(word in lowered for word in _TIMED_OUT):
        cause = (
            f"{peer} did not join within the process group's timeout: it is hung, much "
            "slower, or stopped before this point (raise the timeout with "
            "init_process_group(timeout=...) or `infinity train --dist-timeout`)"
        )
    else:
        cause = "another rank has probably stopped or raised: its error comes first in its output"
    detail = _SOURCE_PREFIX.sub("", text.split(_BOILERPLATE)[0].strip()).splitlines()
    said = f" (torch.distributed: {detail[0]})" if detail else ""
    return f"rank {world.rank} of {world.size}: {what} failed: {cause}{said}"
