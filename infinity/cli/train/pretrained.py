"""``infinity train --model DIR --data PATH``: fine-tune a local ``transformers`` causal LM.

The model directory is read with ``transformers`` (``config.json``, the
safetensors weights, the tokenizer when it has one) without network access;
weights stream into chunks with :func:`infinity.from_pretrained`, and the
result is written with :func:`infinity.save_pretrained` (tokenizer included)
so ``transformers`` loads it back. Without a tokenizer the text is fed as
bytes, which needs a vocabulary of at least 256.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from infinity.cli.main import CommandError
from infinity.data import Corpus, CorpusError
from infinity.data.files import byte_encode, load_text
from infinity.data.jsonl import is_jsonl, load_jsonl, plain_render
from infinity.data.text import IGNORE
from infinity.models.gpt import GPTConfig
from infinity.models.gpt import describe as describe_gpt
from infinity.models.losses import causal_lm_loss as transformers_loss

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DEFAULTS = {"steps": 100, "batch_size": 8, "lr": 5e-5, "seq_len": 256}
GPT_ONLY_FLAGS = ("preset", "layers", "hidden", "heads")


@dataclass(frozen=True)
class PretrainedModel:
    """The model side of a fine-tuning run (saved with each checkpoint)."""

    path: str  # the model directory
    data: str  # the text file or folder
    output: str  # where the fine-tuned model is written
    seq_len: int
    num_params: int
    vocab_size: int
    model_type: str
    tokenizer: bool  # the directory's own tokenizer; else byte-level


def describe(m: PretrainedModel | GPTConfig) -> str:
    """One line about the model being trained (the built-in GPT's too), for the header."""
    if isinstance(m, GPTConfig):
        return describe_gpt(m)
    return f"{m.model_type} from {m.path} ({m.num_params / 1e6:.1f}M parameters)"


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network
    try:
        from infinity.pretrained.hf import require_transformers

        return require_transformers()
    except ImportError as exc:
        raise CommandError(f"--model: {exc}") from None


def reject_gpt_flags(args: argparse.Namespace, model: str) -> None:
    """Flags that shape the built-in GPT make no sense for a pretrained model."""
    for flag in GPT_ONLY_FLAGS:
        if getattr(args, flag, None) is not None:
            raise CommandError(
                f"--{flag} shapes the built-in GPT; the model's shape comes from "
                f"{model}/config.json (drop --{flag})"
            )


def inspect_model(args: argparse.Namespace, seq_len: int | None) -> PretrainedModel:
    """Read ``--model``'s config (nothing is allocated) and check it can be trained here."""
    reject_gpt_flags(args, args.model)
    if args.data is None:
        raise CommandError("--model needs --data PATH: a text file or a folder of text files")
    path = Path(args.model).absolute()
    if not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "is not a directory"
        raise CommandError(
            f"--model '{args.model}' {what}: give a local folder holding a transformers "
            "causal LM (config.json and safetensors weights, as save_pretrained writes "
            "them); nothing is downloaded"
        )
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as exc:
        raise CommandError(
            f"--model: cannot read a transformers model from '{path}': {exc}"
        ) from None
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq_len = int(seq_len or min(DEFAULTS["seq_len"], limit or DEFAULTS["seq_len"]))
    if limit is not None and seq_len > limit:
        raise CommandError(f"--seq-len {seq_len} is above the model's {limit} positions")
    has_tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES)
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else config.get_text_config().vocab_size
    if not has_tokenizer and vocab < 256:
        raise CommandError(
            f"--model: '{path}' has no tokenizer and its vocabulary ({vocab}) is smaller than "
            "the 256 bytes of byte-level text; add its tokenizer files (tokenizer.json, ...)"
        )
    output = Path(args.output or f"./.infinity/{path.name}-finetuned")
    if output.exists() and not (output / "config.json").is_file():
        raise CommandError(
            f"--output '{output}' exists and is not a saved model; the fine-tuned model "
            "replaces it at the end, so pick a new directory"
        )
    return PretrainedModel(
        path=str(path),
        data=str(Path(args.data).absolute()),
        output=str(output.absolute()),
        seq_len=seq_len,
        num_params=sum(p.numel() for p in model.parameters()),
        vocab_size=vocab,
        model_type=config.model_type,
        tokenizer=has_tokenizer,
    )


@functools.cache
def _tokenizer(path: str) -> Any:
    try:
        return _transformers().AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CommandError(f"--model: cannot load the tokenizer in '{path}': {exc}") from None


def load_corpus(m: PretrainedModel) -> Corpus:
    """``--data`` encoded with the model's tokenizer (or as bytes); a ``.jsonl`` file
    is read as examples (see :mod:`infinity.data.jsonl`)."""
    return _load(m.data, m.seq_len, m.path if m.tokenizer else None)


def load_byte_corpus(data: str, seq_len: int) -> Corpus:
    """The built-in GPT's ``--data``: text (a file or a folder) or ``.jsonl`` examples,
    as bytes (its vocabulary is the 256 byte values)."""
    return _load(data, seq_len, None)


def _load(data: str, seq_len: int, tokenizer: str | None) -> Corpus:
    if is_jsonl(data):
        return _load_examples(data, seq_len, tokenizer)
    if tokenizer is not None:
        tok = _tokenizer(tokenizer)

        def encode(data: bytes) -> torch.Tensor:
            ids = tok(data.decode("utf-8", errors="replace"), add_special_tokens=False)
            return torch.tensor(ids["input_ids"], dtype=torch.int32)

        eos, unit = tok.eos_token_id, "tokens"
        about = f"text (the model's tokenizer, {len(tok)} entries)"
    else:
        encode, eos, about, unit = byte_encode, None, "text (byte-level)", "bytes"
    try:
        return load_text(data, encode, eos=eos, min_tokens=seq_len + 2, about=about, unit=unit)
    except CorpusError as exc:
        raise CommandError(str(exc)) from None


def build_model(m: PretrainedModel, config: infinity.Config) -> nn.Module:
    """The pretrained weights, offloaded, in training mode."""
    _transformers()
    try:
        return infinity.from_pretrained(m.path, config).train()
    except infinity.PretrainedError as exc:
        raise CommandError(f"--model: {exc}") from None


def _load_examples(data: str, seq_len: int, tokenizer: str | None) -> Corpus:
    """A JSON-lines ``--data``: ``text`` examples whole; ``messages`` through the
    tokenizer's chat template, trained on the assistant turns where the template
    marks them ({% generation %}), else on every token; without a template (or a
    tokenizer) as ``<|role|>`` blocks, trained on the assistant contents."""
    min_tokens = seq_len + 2
    if tokenizer is None:
        render = plain_render(lambda text: byte_encode(text.encode()).tolist())
        about, eos, unit = "chat/text examples (byte-level)", None, "bytes"
    else:
        tok = _tokenizer(tokenizer)
        plain = plain_render(lambda text: tok(text, add_special_tokens=False)["input_ids"])
        template = getattr(tok, "chat_template", None)
        about = "chat/text examples (the model's tokenizer"
        about += ", its chat template)" if template else ", no chat template)"
        eos, unit = tok.eos_token_id, "tokens"

        def render(example: dict[str, Any]) -> tuple[list[int], list[bool]]:
            if "messages" not in example or not template:
                return plain(example)
            out = tok.apply_chat_template(
                example["messages"],
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            ids = list(out["input_ids"])
            marked = out.get("assistant_masks")
            if marked is None or not any(marked):
                return ids, [True] * len(ids)  # the template marks no turn: train on all
            return ids, [bool(x) for x in marked]

    try:
        return load_jsonl(data, render, eos=eos, min_tokens=min_tokens, about=about, unit=unit)
    except CorpusError as exc:
        raise CommandError(str(exc)) from None


def causal_lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of a ``transformers`` causal LM over the
    targets trained on (``IGNORE`` ones are skipped; none at all gives 0, not NaN), a
    block of tokens at a time where the logits are large (``models/losses.py``)."""
    return transformers_loss(model, inputs, targets, ignore_index=IGNORE)


def save_model(model: nn.Module, m: PretrainedModel) -> Path:
    """Write the fine-tuned model (and the tokenizer) where ``--output`` says."""
    tokenizer = _tokenizer(m.path) if m.tokenizer else None
    try:
        return infinity.save_pretrained(model, m.output, tokenizer=tokenizer)
    except (infinity.PretrainedError, OSError) as exc:
        raise CommandError(f"--output: cannot write the fine-tuned model: {exc}") from None
