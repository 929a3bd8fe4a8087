"""``ChunkIO``: the stored bytes of one offloaded model, for code outside the engine.

Checkpoints and pretrained weights read and write a model's tensors through
this narrow surface (``engine.chunk_io``), never through the engine's chunk
manager, layout or plan: where each tensor sits (:meth:`ChunkIO.slot`), the few
facts of the stored format they record or check, and each chunk's bytes as
:mod:`~infinity.chunks.pieces` windows (whole chunk or spans alike). So the
engine's insides can change without touching them, and the import contract in
``pyproject.toml`` keeps ``infinity.checkpoint`` and ``infinity.pretrained``
from importing ``infinity.chunks``.

The caller settles queued updates first (``engine.synchronize`` /
``settle_step``): the windows read and write the homes.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from infinity.chunks.pieces import Window, home_bytes, windows
from infinity.core.layout import ChunkSpec, TensorSlot
from infinity.core.names import Kind
from infinity.runtime.model_chunks import ModelChunks


class ChunkIO:
    """Read and write the bytes behind one model's tensors, chunk piece by chunk piece."""

    def __init__(self, chunks: ModelChunks) -> None:
        self._chunks = chunks

    # --- facts of the stored format -------------------------------------------------------
    @property
    def chunk_specs(self) -> tuple[ChunkSpec, ...]:
        """Every chunk in order: its capacity in elements, its tensors, trainable or not."""
        return self._chunks.layout.chunks

    def slot(self, index: int) -> TensorSlot:
        """Where tensor ``index`` lives: its chunk and elements."""
        return self._chunks.layout.slots[index]

    @property
    def element_size(self) -> int:
        """Bytes of one parameter (or gradient) element: the compute dtype's."""
        return self._chunks.plan.element_size

    @property
    def has_master(self) -> bool:
        """The optimizer units begin with an fp32 master copy (16-bit compute)."""
        return self._chunks.plan.has_master

    def in_shard(self, index: int) -> bool:
        """Some of tensor ``index``'s elements are kept by this process (always, unsharded)."""
        slot = self.slot(index)
        start, end = self._chunks.plan.home_window(slot.chunk)
        return slot.offset < end and slot.offset + slot.numel > start

    # --- bytes ------------------------------------------------------------------------------
    def windows(
        self, kind: Kind, chunk: int, *, load: bool = True, write: bool = False
    ) -> Generator[Window, None, None]:
        """The windows of ``(kind, chunk)`` (see :func:`infinity.chunks.pieces.windows`).

        Sharded, a window covers the whole chunk: reading gathers it (collective: every
        rank walks the same chunks in the same order), writing stores this rank's
        shard of it (every rank writes the same values)."""
        return windows(self._chunks.manager, kind, chunk, load=load, write=write)

    def home_bytes(self, kind: Kind, chunk: int) -> Generator[torch.Tensor, None, None]:
        """The stored bytes of ``(kind, chunk)`` in home order (uint8; each valid until the
        next is drawn): see :func:`infinity.chunks.pieces.home_bytes`."""
        return home_bytes(self._chunks.manager, kind, chunk)

    def params_written(self, chunk: int) -> None:
        """Chunk ``chunk``'s parameter bytes were written at home: drop its device copy."""
        self._chunks.manager.drop_param(chunk)
