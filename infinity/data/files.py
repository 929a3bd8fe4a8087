"""Text from the user's own files (``infinity train --data PATH``), as token ids.

``PATH`` is a text file or a folder of them (read recursively in sorted order
of relative path; hidden files and folders skipped). Each file is encoded
separately and files are joined with the end-of-text token when there is one.
Held-out text: in a folder, the files whose path hash says so (as for the
built-in corpus); with one file, or when that leaves nothing, the last
1/``EVAL_EVERY`` of the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from infinity.data.text import EVAL_EVERY, Corpus, CorpusError, is_held_out

Encode = Callable[[bytes], torch.Tensor]  # a file's bytes -> int32 token ids


def text_files(root: Path) -> list[Path]:
    """The files to train on under ``root`` (``root`` itself when it is a file)."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise CorpusError(f"--data: '{root}' is neither a file nor a folder")
    found = [
        path
        for path in root.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(root).parts)
    ]
    if not found:
        raise CorpusError(f"--data: the folder '{root}' holds no files")
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def load_text(
    root: str | Path, encode: Encode, *, eos: int | None, min_tokens: int, about: str, unit: str
) -> Corpus:
    """Encode every file under ``root``; ``min_tokens`` must remain in each split."""
    root = Path(root)
    files = text_files(root)
    parts: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    end = torch.tensor([] if eos is None else [eos], dtype=torch.int32)
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CorpusError(f"--data: cannot read '{path}': {exc.strerror}") from None
        relative = path.relative_to(root).as_posix() if root.is_dir() else path.name
        parts[root.is_dir() and is_held_out(relative)] += [encode(data), end]
    train = torch.cat(parts[False]) if parts[False] else end[:0]
    held = torch.cat(parts[True]) if parts[True] else end[:0]
    if held.numel() < min_tokens:
        cut = train.numel() - max(min_tokens, train.numel() // EVAL_EVERY)
        train, held = train[: max(cut, 0)], torch.cat([train[max(cut, 0) :], held])
    if train.numel() < min_tokens:
        raise CorpusError(
            f"--data: '{root}' gives only {train.numel() + held.numel()} tokens; training needs "
            f"at least {2 * min_tokens} (a window of the context length in each split). "
            "Use more text or a shorter --seq-len"
        )
    return Corpus(
        train=train,
        eval=held,
        files=len(files),
        root=root,
        about=about,
        unit=unit,
    )


def byte_encode(data: bytes) -> torch.Tensor:
    """Byte-level ids: each byte is its own token (0-255)."""
    if not data:
        return torch.empty(0, dtype=torch.int32)  # frombuffer refuses an empty buffer
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)
