"""Fine-tuning data as it usually comes: a JSON-lines file of examples (``--data x.jsonl``).

Each line is an object with ``text`` (a string: every token is trained on) or
``messages`` (a list of ``{"role", "content"}``: rendered by the caller's
``render``, which also says which tokens are trained on, e.g. the assistant
turns). Examples are joined with the end-of-text token into one stream, as
text files are, and a parallel mask marks the tokens that are targets; the
windows drawn for training may span examples (packing). Held-out examples are
chosen by a hash of their line number, as files are by their path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from infinity.data.text import EVAL_EVERY, Corpus, CorpusError, is_held_out

# One example -> (token ids, trained-on mask), both of the same length.
Render = Callable[[dict[str, Any]], tuple[list[int], list[bool]]]


def is_jsonl(path: str | Path) -> bool:
    """``path`` names a JSON-lines file (by its suffix)."""
    return Path(path).suffix.lower() == ".jsonl" and Path(path).is_file()


def read_examples(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of every non-blank line; errors name the line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"--data: cannot read '{path}': {exc}") from None
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"--data: {path}:{number} is not JSON ({exc.msg})") from None
        if not isinstance(value, dict) or not (
            isinstance(value.get("text"), str) or _valid_messages(value.get("messages"))
        ):
            raise CorpusError(
                f"--data: {path}:{number} needs a 'text' string or a 'messages' list of "
                '{"role": ..., "content": "..."} objects'
            )
        out.append((number, value))
    if not out:
        raise CorpusError(f"--data: '{path}' holds no examples")
    return out


def _valid_messages(messages: object) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def load_jsonl(
    path: str | Path, render: Render, *, eos: int | None, min_tokens: int, about: str, unit: str
) -> Corpus:
    """The examples of ``path`` as a token stream with its target mask (see the module)."""
    path = Path(path)
    examples = read_examples(path)
    parts: dict[bool, list[tuple[list[int], list[bool]]]] = {False: [], True: []}
    for number, example in examples:
        ids, mask = render(example)
        if len(ids) != len(mask):
            raise AssertionError(f"render gave {len(ids)} ids and {len(mask)} mask values")
        if eos is not None:
            ids, mask = [*ids, eos], [*mask, True]  # learn to end the example
        parts[is_held_out(f"line-{number}")].append((ids, mask))
    if sum(len(i) for i, _ in parts[True]) < min_tokens:
        keep = max(1, len(examples) // EVAL_EVERY)
        moved = parts[False][-keep:] if len(parts[False]) > keep else []
        parts[False] = parts[False][: len(parts[False]) - len(moved)]
        parts[True] = moved + parts[True]
    train, train_mask = _join(parts[False])
    held, held_mask = _join(parts[True])
    if train.numel() < min_tokens or held.numel() < min_tokens:
        raise CorpusError(
            f"--data: '{path}' gives {train.numel()} training and {held.numel()} held-out "
            f"tokens; each needs at least {min_tokens} (a window of the context length). "
            "Use more examples or a shorter --seq-len"
        )
    if not bool(train_mask.any()):
        raise CorpusError(f"--data: '{path}': no token of any example is a training target")
    return Corpus(
        train=train,
        eval=held,
        files=1,
        root=path,
        about=about,
        unit=unit,
        train_mask=train_mask,
        eval_mask=held_mask,
    )


def _join(examples: list[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [t for example, _ in examples for t in example]
    mask = [m for _, example_mask in examples for m in example_mask]
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool)


def plain_render(encode: Callable[[str], list[int]]) -> Render:
    """Render examples without a chat template: ``text`` whole; ``messages`` as
    ``<|role|>`` headers and contents, the assistant contents alone trained on."""

    def render(example: dict[str, Any]) -> tuple[list[int], list[bool]]:
        if "messages" not in example:
            whole = encode(example["text"])
            return whole, [True] * len(whole)
        ids: list[int] = []
        mask: list[bool] = []
        for message in example["messages"]:
            header = encode(f"<|{message['role']}|>\n")
            body = encode(message["content"] + "\n")
            ids += header + body
            mask += [False] * len(header) + [message["role"] == "assistant"] * len(body)
        return ids, mask

    return render
