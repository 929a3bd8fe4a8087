"""``infinity train --data examples.jsonl``: text and chat examples, loss on the assistant turns.

References: masks computed here from the examples' own strings (which tokens
are assistant content), targets checked position by position against the
data, and the loss against ``torch.nn.functional.cross_entropy`` over only the
positions that should count.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from infinity.cli.main import main
from infinity.data.jsonl import load_jsonl, plain_render
from infinity.data.text import IGNORE, Batches, CorpusError

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two and two"},
    {"role": "assistant", "content": "four"},
]


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def _write(path, rows) -> None:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_plain_rendering_trains_on_assistant_contents_only():
    ids, mask = plain_render(_bytes)({"messages": CHAT})
    rendered = bytes(ids).decode()
    assert rendered == "<|system|>\nbe brief\n<|user|>\nwhat is two and two\n<|assistant|>\nfour\n"
    trained = bytes(i for i, m in zip(ids, mask, strict=True) if m).decode()
    assert trained == "four\n"
    ids, mask = plain_render(_bytes)({"text": "plain text"})
    assert bytes(ids) == b"plain text" and all(mask)


def test_windows_ignore_exactly_the_untrained_targets(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, [{"messages": CHAT}, {"text": "x" * 40}] * 30)
    corpus = load_jsonl(
        path, plain_render(_bytes), eos=None, min_tokens=18, about="t", unit="bytes"
    )
    assert corpus.train_mask is not None and corpus.train.numel() == corpus.train_mask.numel()
    batches = Batches(corpus.train, 16, 8, seed=3, mask=corpus.train_mask)
    inputs, targets = batches.get(0)
    plain_inputs, plain_targets = Batches(corpus.train, 16, 8, seed=3).get(0)
    assert torch.equal(inputs, plain_inputs)  # the same windows, only targets masked
    # Recover each window's start from its tokens, then check every target.
    data, mask = corpus.train.tolist(), corpus.train_mask.tolist()
    for row in range(8):
        want = plain_targets[row].tolist()
        starts = [
            s
            for s in range(len(data) - 16)
            if data[s + 1 : s + 17] == want and data[s : s + 16] == inputs[row].tolist()
        ]
        assert starts
        s = starts[0]
        expected = [data[s + 1 + k] if mask[s + 1 + k] else IGNORE for k in range(16)]
        assert targets[row].tolist() == expected


def test_bad_lines_are_named_with_their_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": 3}\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:3 needs a 'text' string or a 'messages'"):
        load_jsonl(path, plain_render(_bytes), eos=None, min_tokens=1, about="", unit="")
    path.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2 is not JSON"):
        load_jsonl(path, plain_render(_bytes), eos=None, min_tokens=1, about="", unit="")


def test_loss_counts_only_trained_targets_and_is_zero_without_any():
    from infinity.cli.train.pretrained import causal_lm_loss

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(50, 50)

        def forward(self, input_ids):
            return transformers.modeling_outputs.CausalLMOutput(logits=self.emb(input_ids))

    model = Logits()
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 50, (2, 6), generator=g)
    targets = torch.randint(0, 50, (2, 6), generator=g)
    keep = torch.rand(2, 6, generator=g) < 0.5
    masked = targets.masked_fill(~keep, IGNORE)
    logits = model(inputs).logits
    expected = F.cross_entropy(logits[keep], targets[keep])
    assert torch.allclose(causal_lm_loss(model, inputs, masked), expected)
    nothing = torch.full_like(targets, IGNORE)
    assert float(causal_lm_loss(model, inputs, nothing)) == 0.0


def _chat_tokenizer():
    """A word-level tokenizer whose chat template marks assistant turns."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(
        {w for m in CHAT for w in m["content"].split()} | {"system", "user", "assistant"}
    )
    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", "<|", "|>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<| {{ m['role'] }} |> "
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} "
        "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
    )
    return fast


def test_fine_tuning_on_chat_examples_trains_on_the_assistant_tokens(capsys, tmp_path, make_model):
    source = tmp_path / "tiny-llama"
    make_model("llama-untied").save_pretrained(source)
    tokenizer = _chat_tokenizer()
    tokenizer.save_pretrained(source)
    data = tmp_path / "chat.jsonl"
    _write(data, [{"messages": CHAT}] * 120)

    from infinity.cli.train.pretrained import PretrainedModel, load_corpus

    model = PretrainedModel(
        path=str(source), data=str(data), output="", seq_len=8, num_params=0,
        vocab_size=300, model_type="llama", tokenizer=True,
    )  # fmt: skip
    corpus = load_corpus(model)
    assert "chat template" in corpus.about
    ids, mask = corpus.train.tolist(), corpus.train_mask.tolist()
    four = tokenizer.convert_tokens_to_ids("four")
    eos = tokenizer.eos_token_id
    trained = {i for i, m in zip(ids, mask, strict=True) if m}
    assert trained == {four, eos}  # the assistant's word, and the end of each example
    assert all(m for i, m in zip(ids, mask, strict=True) if i == four)
    code = main([
        "train", "--json", "--model", str(source), "--data", str(data), "--steps", "2",
        "--seq-len", "8", "--batch-size", "2", "--eval-batches", "1", "--plot", "none",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
    ])  # fmt: skip
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    losses = [e["loss"] for e in events if e.get("event") == "step"]
    assert losses and all(loss == loss for loss in losses)  # finite, not NaN
