"""The engine registry: parameters and models carry no engine attributes, lookups
give the right tensor, and the registry keeps nothing alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from engine_helpers import config, tiny_gpt

import infinity
from infinity.offload import engine_of
from infinity.optim import offloaded as registry


def test_lookups_name_each_parameter_and_nothing_is_set_on_it():
    model = tiny_gpt()
    before = {name: set(vars(p)) for name, p in model.named_parameters()}
    infinity.offload(model, config())
    engine = engine_of(model)
    assert not any(k.startswith("_infinity") for k in vars(model))
    for name, p in model.named_parameters():
        assert set(vars(p)) == before[name]  # no attribute added to the Parameter
        slot = registry.param_slot(p)
        assert slot is not None and slot.engine is engine
        assert engine.registry.entries[slot.tensor_index].name == name
    assert registry.param_slot(torch.zeros(3)) is None
    with pytest.raises(ValueError, match="not offloaded"):
        engine_of(tiny_gpt())


def test_the_registry_keeps_no_engine_model_or_parameter_alive():
    model = infinity.offload(tiny_gpt(), config())
    refs = [weakref.ref(model), weakref.ref(engine_of(model))]
    refs += [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    assert all(ref() is None for ref in refs)
