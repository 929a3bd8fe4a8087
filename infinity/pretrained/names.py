"""The state-dict names of an offloaded model, computed without reading any value.

``model.state_dict()`` on an offloaded model reads every parameter out of the
chunks; the pretrained loader and saver only need the names, shapes and which
parameter (tied ones are one) or buffer each name stands for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn


@dataclass
class StateNames:
    """Every state-dict key of a model, split into parameters and persistent buffers."""

    params: dict[str, nn.Parameter] = field(default_factory=dict)
    buffers: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)

    def names_of(self) -> dict[int, list[str]]:
        """Each parameter's names (several when tied), in state-dict order, by ``id``."""
        grouped: dict[int, list[str]] = {}
        for name, param in self.params.items():
            grouped.setdefault(id(param), []).append(name)
        return grouped


def state_names(model: nn.Module) -> StateNames:
    """The keys ``model.state_dict()`` would have, in the same order (no value is read:
    on an offloaded model ``state_dict()`` would read every chunk)."""
    names = StateNames()

    def walk(module: nn.Module, prefix: str) -> None:
        for name, param in module._parameters.items():
            if param is not None:
                names.params[prefix + name] = param
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                names.buffers[prefix + name] = (module, name)
        for name, child in module._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(model, "")
    return names


def _tied_patterns(model: nn.Module) -> list[str]:
    """The names ``transformers`` declares as tied copies (``_tied_weights_keys``)."""
    patterns = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or ()
        for key in tied:  # a dict {target: source} (transformers 5) or a list of targets
            patterns.append(f"{prefix}.{key}" if prefix else key)
    return patterns


def saved_names(model: nn.Module, names: StateNames) -> dict[int, str]:
    """The one name each parameter (by ``id``) is saved under.

    A tied parameter is saved once, under the name ``transformers`` keeps: the
    names its model declares as tied copies (``lm_head.weight``) are dropped,
    in sorted order, while another name remains, as ``save_pretrained`` does;
    otherwise the first name in state-dict order.
    """
    patterns = _tied_patterns(model)
    chosen = {}
    for key, group in names.names_of().items():
        keep = list(group)
        for name in sorted(group):
            if len(keep) > 1 and any(re.search(p, name) for p in patterns):
                keep.remove(name)
        chosen[key] = keep[0]
    return chosen


def ignore_patterns(model: nn.Module, kind: str) -> list[str]:
    """Regexes of keys a ``transformers`` model declares harmless when ``kind`` is
    ``"missing"`` or ``"unexpected"`` (``_keys_to_ignore_on_load_<kind>``), e.g.
    the causal-mask buffers older GPT-2 files hold."""
    patterns: list[str] = []
    for module in model.modules():
        patterns.extend(getattr(module, f"_keys_to_ignore_on_load_{kind}", None) or ())
    return patterns


def match_prefix(model: nn.Module, file_keys: set[str], known: set[str]) -> dict[str, str]:
    """Model key -> file key, bridging ``transformers``' base-model prefix.

    A file of the base model (``h.0.attn.c_attn.weight``, as the original GPT-2
    checkpoint) loads into the model with a head (``transformer.h.0...``), and
    the other way round, as ``transformers`` allows.
    """
    mapping = {key: key for key in file_keys if key in known}
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return mapping
    for key in file_keys - mapping.keys():
        if f"{prefix}.{key}" in known:
            mapping.setdefault(f"{prefix}.{key}", key)
        elif key.startswith(prefix + ".") and key[len(prefix) + 1 :] in known:
            mapping.setdefault(key[len(prefix) + 1 :], key)
    return mapping
