"""The current moment of the iteration, shared by the chunk manager's components."""

from __future__ import annotations


class Clock:
    """The position of the current access in the step's access sequence.

    NOTE: one object the manager and its components (host staging, the
    gradient flow) all read, so eviction policies see one notion of "now";
    the runtime sets it at every access (through ``ChunkManager.moment``).
    """

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0
