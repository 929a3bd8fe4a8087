"""Tiny ``transformers`` models of other families train as plain PyTorch does.

BERT's and RoBERTa's masked-LM heads register their output bias twice, in the
head and again in the decoder inside it (``self.decoder.bias = self.bias``); the
nested binding was an illegal COMPUTE -> COMPUTE in the first forward
(``ParamRegistry._own_once_per_branch``). DeBERTa's encoder reads its
relative-position embedding's weight without calling the embedding: it trained on
the NaN placeholder, and evaluated to NaN (``ParamRegistry.reads``, from the fake
forward at offload). The others (an encoder-decoder, a parallel-attention decoder)
are here so that a family's own way of reading its weights has a test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import config, global_rel_error

import infinity
from infinity.optim import CPUAdam

transformers = pytest.importorskip("transformers")

VOCAB = 96
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}

MODELS = {
    "bert-mlm": lambda: transformers.BertForMaskedLM(
        transformers.BertConfig(vocab_size=VOCAB, intermediate_size=64, **SMALL)
    ),
    "roberta-mlm": lambda: transformers.RobertaForMaskedLM(
        transformers.RobertaConfig(vocab_size=VOCAB, intermediate_size=64, pad_token_id=1, **SMALL)
    ),
    "deberta-v2": lambda: transformers.DebertaV2ForSequenceClassification(
        transformers.DebertaV2Config(
            vocab_size=VOCAB,
            intermediate_size=64,
            num_labels=3,
            relative_attention=True,
            position_buckets=16,
            max_relative_positions=32,
            norm_rel_ebd="layer_norm",
            pos_att_type=["p2c", "c2p"],
            **SMALL,
        )
    ),
    "t5": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        )
    ),
    "gpt-neox": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(vocab_size=VOCAB, intermediate_size=64, **SMALL)
    ),
}


@pytest.mark.parametrize("family", MODELS)
def test_a_family_trains_as_torch(family):
    torch.manual_seed(0)
    base = MODELS[family]()
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    model = infinity.offload(base, config(device_memory="256KiB", chunk_size="16KiB"))
    opt = CPUAdam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(2, VOCAB, (2, 12), generator=g)
        inputs = {"input_ids": ids, "labels": ids}
        if family == "deberta-v2":
            inputs["labels"] = ids[:, 0] % 3
        if family == "t5":
            inputs["decoder_input_ids"] = ids
        for m, o in ((model, opt), (ref, ref_opt)):
            torch.manual_seed(9)  # dropout's masks alike
            m(**inputs).loss.backward()
            o.step()
            o.zero_grad()
    assert global_rel_error(model, ref) < 1e-6
