"""``infinity train --model DIR --data PATH`` on a tiny locally saved Llama.

The fine-tuned output is loaded by ``transformers`` itself and compared with
the run's last checkpoint loaded by the library into a fresh model (a
different file format, written by a different code path); it must also differ
from the starting weights (training happened).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import infinity
from infinity.cli.main import main

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n"


def _run(capsys, *flags: str) -> tuple[int, list[dict]]:
    code = main(["train", "--json", *flags])
    out = capsys.readouterr().out
    return code, [json.loads(line) for line in out.splitlines()]


@pytest.fixture
def workspace(tmp_path, make_model):
    source = tmp_path / "tiny-llama"
    make_model("llama-untied").save_pretrained(source)
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(40):  # a folder: some files land in the held-out split
        (folder / f"part{i:02d}.txt").write_text(TEXT * 8)
    flags = [
        "--nvme-path", str(tmp_path / "nvme"), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--plot", "none", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1",
    ]  # fmt: skip
    return tmp_path, source, folder, flags


def test_fine_tune_writes_a_model_transformers_loads(capsys, workspace):
    tmp, source, folder, flags = workspace
    out = tmp / "tuned"
    code, events = _run(
        capsys, "--model", str(source), "--data", str(folder), "--steps", "2",
        "--output", str(out), "--dtype", "fp32", *flags,
    )  # fmt: skip
    assert code == 0
    (summary,) = [e for e in events if e["event"] == "summary"]
    assert summary["model_dir"] == str(out)
    assert sorted(summary["losses"]) == ["1", "2"]
    assert "byte-level" in " ".join(next(e for e in events if e["event"] == "start")["lines"])

    tuned = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    start = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with infinity.init_empty():
        fresh = transformers.AutoModelForCausalLM.from_config(tuned.config)
    config = infinity.Config(device="cpu", dtype="fp32", device_memory="1MiB",
                             host_memory="64MiB", nvme_path=None)  # fmt: skip
    fresh = infinity.offload(fresh, config, init=lambda m: None)
    infinity.load_checkpoint(summary["checkpoint"], fresh)
    expected = fresh.state_dict()
    got = tuned.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    changed = [n for n, v in start.state_dict().items() if not torch.equal(v, got[n])]
    assert "model.embed_tokens.weight" in changed


def test_small_vocabulary_without_tokenizer_is_a_clear_error(capsys, tmp_path, llama_config):
    config = llama_config(tied=True)
    config.vocab_size = 100
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "small")
    (tmp_path / "t.txt").write_text(TEXT)
    code = main(["train", "--model", str(tmp_path / "small"), "--data", str(tmp_path / "t.txt")])
    assert code != 0
    err = capsys.readouterr().err
    assert "no tokenizer" in err and "(100)" in err


def test_model_without_data_says_so(capsys, workspace):
    _tmp, source, _folder, flags = workspace
    code = main(["train", "--model", str(source), *flags])
    assert code != 0
    assert "--data" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["missing", "empty folder"])
def test_a_model_path_that_holds_no_model_is_named(capsys, tmp_path, what):
    """A missing path reached transformers' hub check ("Repo id must use alphanumeric
    chars ..."), which says nothing about a local folder."""
    path = tmp_path / "model"
    if what == "empty folder":
        path.mkdir()
    (tmp_path / "t.txt").write_text(TEXT)
    code = main(["train", "--model", str(path), "--data", str(tmp_path / "t.txt")])
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err
    assert ("has no config.json" if path.exists() else "is not a directory") in err


def test_the_directory_tokenizer_is_used_and_saved_with_the_model(capsys, workspace):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tmp, source, folder, flags = workspace
    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", eos_token="</s>"
    )
    tokenizer.save_pretrained(source)
    out = tmp / "tuned"
    code, events = _run(
        capsys, "--model", str(source), "--data", str(folder), "--steps", "1",
        "--output", str(out), "--seq-len", "8", *flags[:-6], "--batch-size", "2",
        "--eval-batches", "1",
    )  # fmt: skip
    assert code == 0
    header = " ".join(next(e for e in events if e["event"] == "start")["lines"])
    assert "the model's tokenizer" in header and "context 8 tokens" in header
    saved = transformers.AutoTokenizer.from_pretrained(out)
    assert saved(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert transformers.AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 300


def test_stop_and_resume_gives_the_uninterrupted_run(capsys, workspace):
    tmp, source, folder, flags = workspace

    def run(name: str, *extra: str) -> list[dict]:
        run_flags = [f if f != str(tmp / "ckpt") else str(tmp / f"ckpt-{name}") for f in flags]
        code, events = _run(capsys, *extra, *run_flags)
        assert code == 0, events
        return events

    common = ["--data", str(folder), "--steps", "2", "--dtype", "fp32"]
    run("straight", "--model", str(source), *common, "--output", str(tmp / "straight"))
    run("resumed", "--model", str(source), *common, "--output", str(tmp / "resumed"),
        "--stop-after", "1")  # fmt: skip
    assert not (tmp / "resumed").exists()  # a stopped run writes no model
    events = run("resumed", "--resume")  # the model, data and output come from the checkpoint
    (summary,) = [e for e in events if e["event"] == "summary"]
    assert summary["model_dir"] == str(tmp / "resumed")
    straight = transformers.AutoModelForCausalLM.from_pretrained(tmp / "straight").state_dict()
    resumed = transformers.AutoModelForCausalLM.from_pretrained(tmp / "resumed").state_dict()
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
