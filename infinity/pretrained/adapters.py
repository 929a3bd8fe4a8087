"""A ``peft`` LoRA model saved as its base model, the adapters merged in.

``save_pretrained`` of an offloaded ``peft.PeftModel`` writes what
``model.merge_and_unload().save_pretrained(path)`` writes on a model in RAM: the
base model's names, each LoRA-adapted weight plus its adapters' product, a
``modules_to_save`` copy under its original's name. peft's merge cannot run on an
offloaded model (it adds into the weight in place, and the weight is a
placeholder); here each merged weight is formed as its chunk streams to the file.

The sum is peft's with its default fp32 adapters, bit for bit: the delta
``B @ A * scaling`` (transposed for ``fan_in_fan_out``) in fp32, from the adapters'
fp32 masters where a 16-bit model keeps them, added to the weight in fp32 and
rounded once to the weight's dtype.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from infinity.pretrained.names import StateNames, state_names
from infinity.pretrained.safetensors_io import PretrainedError
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.state_access import read_params


@dataclass
class LoraDelta:
    """What one adapted weight gains: the sum over its active adapters of
    ``B @ A * scaling`` (transposed for ``fan_in_fan_out``), in fp32.

    NOTE: kept as its factors (``r`` rows and columns each) and formed when its weight
    is written: the deltas of every adapted weight at once would be a full fp32 copy of
    those weights (for LoRA on every projection of a 7B model, ~26 GB), against the
    save's promise of one chunk in memory."""

    parts: list[tuple[torch.Tensor, torch.Tensor, float, bool]] = field(default_factory=list)

    def value(self) -> torch.Tensor:
        """The delta, formed now."""
        total: torch.Tensor | None = None
        for a, b, scaling, transpose in self.parts:
            product = (b @ a) * scaling
            product = product.T if transpose else product
            total = product if total is None else total + product
        assert total is not None
        return total


@dataclass
class MergedNames:
    """What the merged save writes: the base model's state names (adapters and the
    originals of ``modules_to_save`` left out) and, by tensor index, each adapted
    weight's :class:`LoraDelta`."""

    base: nn.Module
    names: StateNames
    deltas: dict[int, LoraDelta] = field(default_factory=dict)


def peft_base(model: nn.Module) -> nn.Module | None:
    """The ``transformers`` model inside ``model`` if it is a ``peft.PeftModel``.

    NOTE: looked up in ``sys.modules``, never imported: the core package does not
    depend on peft, and a model can only be a PeftModel if peft is loaded.
    """
    peft = sys.modules.get("peft")
    cls = getattr(peft, "PeftModel", None) if peft is not None else None
    if cls is None or not isinstance(model, cls):
        return None
    return model.get_base_model()


def merged_names(model: nn.Module, base: nn.Module, engine: OffloadEngine) -> MergedNames:
    """The names and deltas of ``model`` (a ``PeftModel`` over ``base``) saved merged;
    reads the adapters' weights (small) out of the chunks, on every rank."""
    peft = sys.modules["peft"]
    types = [getattr(c, "peft_type", "?") for c in getattr(model, "peft_config", {}).values()]
    kinds = {str(getattr(t, "value", t)) for t in types}
    if kinds - {"LORA"}:
        raise PretrainedError(
            f"a peft model with {', '.join(sorted(kinds))} adapters cannot be saved merged: "
            "infinity merges LoRA only. Save the adapter with model.save_pretrained(path) "
            "(peft's own)"
        )
    lora_layer = peft.tuners.lora.LoraLayer
    wrapper = getattr(peft.utils, "ModulesToSaveWrapper", None)
    rename: dict[str, str] = {}  # prefix inside base -> prefix saved ("" drops it)
    layers: dict[str, Any] = {}
    for prefix, module in base.named_modules():
        if isinstance(module, lora_layer):
            _check_plain(prefix, module)
            rename[f"{prefix}.base_layer."] = f"{prefix}."
            for attr in module.adapter_layer_names + module.other_param_names:
                rename[f"{prefix}.{attr}."] = ""
            layers[prefix] = module
        elif wrapper is not None and isinstance(module, wrapper):
            active = module.active_adapter
            active = active[0] if isinstance(active, list | tuple) else active
            rename[f"{prefix}.original_module."] = ""
            rename[f"{prefix}.modules_to_save.{active}."] = f"{prefix}."
            rename[f"{prefix}.modules_to_save."] = ""  # other adapters' copies
    names = StateNames()
    full = state_names(base)
    for name, param in full.params.items():
        saved = _renamed(name, rename)
        if saved is not None:
            names.params[saved] = param
    for name, where in full.buffers.items():
        saved = _renamed(name, rename)
        if saved is not None:
            names.buffers[saved] = where
    merged = MergedNames(base, names)
    adapters = {
        id(p): p
        for layer in layers.values()
        for adapter in layer.active_adapters
        for p in (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)
    }
    entries = [engine.registry.by_id[key] for key in adapters]
    values = {id(e.param): v.float() for e, v in read_params(engine, entries, master=True)}
    for layer in layers.values():
        delta = LoraDelta()
        for adapter in layer.active_adapters:
            a = values[id(layer.lora_A[adapter].weight)]
            b = values[id(layer.lora_B[adapter].weight)]
            delta.parts.append((a, b, layer.scaling[adapter], layer.fan_in_fan_out))
        merged.deltas[engine.registry.by_id[id(layer.base_layer.weight)].index] = delta
    return merged


def _renamed(name: str, rename: dict[str, str]) -> str | None:
    """``name`` under the longest matching prefix's replacement; None if dropped."""
    for prefix in sorted(rename, key=len, reverse=True):
        if name.startswith(prefix):
            to = rename[prefix]
            return to + name[len(prefix) :] if to else None
    return name


def _check_plain(prefix: str, layer: Any) -> None:
    """Refuse what the merged save does not form: DoRA, LoRA on embeddings or
    convolutions, a bias adapter, a layer merged already."""
    plain = (
        isinstance(layer.base_layer, nn.Linear)
        or type(layer.base_layer).__name__ == "Conv1D"  # GPT-2's, with fan_in_fan_out
    )
    active = layer.active_adapters
    problems = {
        "DoRA": any(layer.use_dora.get(a, False) for a in active),
        "a LoRA bias": any(getattr(layer, "lora_bias", {}).get(a, False) for a in active),
        "merged already": layer.merged,
        "LoRA on an embedding": bool(getattr(layer, "lora_embedding_A", None)),
        type(layer.base_layer).__name__: not plain,
    }
    what = next((name for name, found in problems.items() if found), None)
    if what is not None:
        raise PretrainedError(
            f"the LoRA layer {prefix!r} ({what}) cannot be saved merged: infinity forms "
            "W + B @ A * scaling for Linear and GPT-2's Conv1D layers only. Save the "
            "adapter with model.save_pretrained(path) (peft's own) and merge it on a "
            "model loaded without infinity"
        )
