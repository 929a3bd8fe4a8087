"""Byte-level text from the Python standard library's sources: real text on every machine.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (installed
third-party packages excluded) is read in sorted order of its relative path and
concatenated; a file goes to the held-out split when the CRC-32 of its path
says so, so the split is the same on every machine with the same Python.

Batches are a pure function of ``(seed, step, micro-batch)``: the data position
of a run is its step counter, so a resumed run draws exactly the batches an
uninterrupted one would have drawn, without saving any sampler state.
"""

from __future__ import annotations

import hashlib
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256  # bytes
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# One file in EVAL_EVERY goes to the held-out split: a few percent of the
# corpus is plenty for a loss estimate and costs training almost nothing.
EVAL_EVERY = 32


class CorpusError(RuntimeError):
    """The standard library's sources cannot be found or are too small to train on."""


@dataclass(frozen=True)
class Corpus:
    """Training and held-out tokens (bytes, as ``uint8`` tensors, for the built-in text)."""

    train: torch.Tensor
    eval: torch.Tensor
    files: int
    root: Path
    about: str = "Python standard-library source"  # what the text is, for the header
    unit: str = "bytes"  # what one token is
    # Which tokens are training targets (JSON-lines chat data); None: all of them.
    train_mask: torch.Tensor | None = None
    eval_mask: torch.Tensor | None = None


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """``*.py`` files under ``root`` in a deterministic order (sorted relative paths)."""
    found = [
        path
        for path in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(path.relative_to(root).parts) and path.is_file()
    ]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(relative: str) -> bool:
    """Whether the file at ``relative`` (a POSIX path) belongs to the held-out split."""
    return zlib.crc32(relative.encode()) % EVAL_EVERY == 0


def load_corpus(root: Path | None = None, *, min_bytes: int = 1 << 16) -> Corpus:
    """Read the corpus under ``root`` (default: the standard library)."""
    root = stdlib_root() if root is None else Path(root)
    files = source_files(root) if root.is_dir() else []
    train, held = bytearray(), bytearray()
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files (permissions, races) are skipped, not fatal
        (held if is_held_out(path.relative_to(root).as_posix()) else train).extend(data)
    if len(train) < min_bytes or len(held) < min_bytes // EVAL_EVERY:
        raise CorpusError(
            f"found only {len(train) + len(held)} bytes of Python sources under '{root}'; "
            "the training text is the standard library's source, which this Python lacks"
        )
    return Corpus(
        train=torch.frombuffer(train, dtype=torch.uint8),
        eval=torch.frombuffer(held, dtype=torch.uint8),
        files=len(files),
        root=root,
    )


# The target value of tokens not trained on (torch's cross-entropy ignore_index).
IGNORE = -100


class Batches:
    """Random windows of a byte tensor, reproducible from ``(seed, step, micro)``."""

    def __init__(
        self,
        data: torch.Tensor,
        seq_len: int,
        batch_size: int,
        seed: int,
        mask: torch.Tensor | None = None,
    ) -> None:
        if data.numel() <= seq_len + 1:
            raise ValueError(f"{data.numel()} bytes are too few for windows of {seq_len + 1}")
        self.data = data
        self.mask = mask  # targets where False are IGNORE (not trained on)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed

    def get(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets ``(batch, seq_len)`` for one micro-batch of ``step``."""
        gen = torch.Generator().manual_seed(_mix(self.seed, step, micro))
        starts = torch.randint(
            0, self.data.numel() - self.seq_len - 1, (self.batch_size,), generator=gen
        )
        offsets = starts[:, None] + torch.arange(self.seq_len + 1)
        windows = self.data[offsets].long()
        targets = windows[:, 1:]
        if self.mask is not None:
            targets = targets.masked_fill(~self.mask[offsets][:, 1:], IGNORE)
        return windows[:, :-1], targets


def _mix(seed: int, step: int, micro: int) -> int:
    """A 63-bit generator seed from three integers (distinct inputs, unrelated streams)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{micro}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
