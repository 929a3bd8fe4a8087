"""``model.state_dict()`` and ``model.load_state_dict()`` on an offloaded model.

Outside a forward, parameters hold zero-byte placeholders; these hooks put the
real values (read from the chunks) into ``state_dict()`` and route values given
to ``load_state_dict()`` into the chunks (masters included), instead of letting
torch copy into a placeholder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from infinity.runtime.engine import OffloadEngine
from infinity.runtime.params import ParamEntry
from infinity.runtime.state_access import read_params, write_params


def install_state_dict_hooks(engine: OffloadEngine) -> list[RemovableHandle]:
    """Hooks on every module that owns parameters; returns their handles."""
    handles: list[RemovableHandle] = []
    for module, _entries in engine.registry.owners.items():
        names = {
            name: engine.registry.by_id[id(p)] for name, p in module.named_parameters(recurse=False)
        }
        consumed: list[str] = []

        def save_hook(
            mod: nn.Module,
            state_dict: dict[str, Any],
            prefix: str,
            local_metadata: dict[str, Any],
            names: dict[str, ParamEntry] = names,
        ) -> None:
            wanted = {
                prefix + name: entry for name, entry in names.items() if prefix + name in state_dict
            }
            by_index = {e.index: key for key, e in wanted.items()}
            for entry, value in read_params(engine, wanted.values()):
                state_dict[by_index[entry.index]] = value
                # a tied parameter appears under each of its names
                for key, other in wanted.items():
                    if other is entry:
                        state_dict[key] = value

        def load_pre_hook(
            mod: nn.Module,
            state_dict: dict[str, Any],
            prefix: str,
            local_metadata: dict[str, Any],
            strict: bool,
            missing: list[str],
            unexpected: list[str],
            errors: list[str],
            names: dict[str, ParamEntry] = names,
            consumed: list[str] = consumed,
        ) -> None:
            values: dict[int, torch.Tensor] = {}
            for name, entry in names.items():
                key = prefix + name
                if key in state_dict:
                    values[entry.index] = state_dict.pop(key)
                    consumed.append(key)
            if values:
                write_params(engine, values)

        def load_post_hook(
            mod: nn.Module, incompatible: Any, consumed: list[str] = consumed
        ) -> None:
            for key in consumed:
                if key in incompatible.missing_keys:
                    incompatible.missing_keys.remove(key)
            consumed.clear()

        handles.append(module.register_state_dict_post_hook(save_hook))
        handles.append(module.register_load_state_dict_pre_hook(load_pre_hook))
        handles.append(module.register_load_state_dict_post_hook(load_post_hook))
    return handles
