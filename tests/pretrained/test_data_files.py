"""``infinity.data.files``: the user's text as token ids, split by path hash or by tail.

Expected values are built here from the files' bytes and ``zlib.crc32``."""

from __future__ import annotations

import zlib

import pytest
import torch

from infinity.data import CorpusError
from infinity.data.files import byte_encode, load_text

EVAL_EVERY = 32  # one file in 32 is held out (the built-in corpus's rule)


def _load(path, min_tokens=8, eos=None):
    return load_text(path, byte_encode, eos=eos, min_tokens=min_tokens, about="t", unit="bytes")


def test_folder_split_follows_the_path_hash_and_skips_hidden_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ignored")
    texts = {f"sub/f{i:03d}.txt": f"text number {i}\n" * 3 for i in range(100)}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    held = [n for n in sorted(texts) if zlib.crc32(n.encode()) % EVAL_EVERY == 0]
    assert held  # the names above put some files in the held-out split
    corpus = _load(tmp_path, eos=1000)
    want_train = [t for n in sorted(texts) if n not in held for t in [*texts[n].encode(), 1000]]
    want_eval = [t for n in held for t in [*texts[n].encode(), 1000]]
    assert corpus.train.tolist() == want_train
    assert corpus.eval.tolist() == want_eval
    assert corpus.files == 100


def test_single_file_holds_out_its_tail(tmp_path):
    data = bytes(range(256)) * 8
    path = tmp_path / "one.bin"
    path.write_bytes(data)
    corpus = _load(path)
    cut = len(data) - len(data) // EVAL_EVERY
    assert torch.equal(corpus.train, torch.tensor(list(data[:cut]), dtype=torch.int32))
    assert torch.equal(corpus.eval, torch.tensor(list(data[cut:]), dtype=torch.int32))


def test_too_little_text_names_the_fix(tmp_path):
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(CorpusError, match="--seq-len"):
        _load(tmp_path / "short.txt", min_tokens=64)
    with pytest.raises(CorpusError, match="neither a file nor a folder"):
        _load(tmp_path / "absent")
