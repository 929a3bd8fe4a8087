"""The parameters of an offloaded model: identity, names, owners, placeholders.

A tied parameter (one ``Parameter`` registered in several modules) is one
entry here and lives once in a chunk. Outside a module's forward, a parameter's
``.data`` is a *placeholder*: right shape, dtype and device, zero bytes of
storage, so metadata (``numel()``, ``shape``) works and no chunk memory is held.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from infinity.chunks.layout import TensorInfo


def placeholder(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor with ``shape`` and contiguous strides over an empty storage.

    NOTE: autograd's AccumulateGrad reads only the parameter's metadata, so a
    gradient still arrives for a parameter whose data is a placeholder.
    """
    strides: list[int] = []
    step = 1
    for d in reversed(tuple(shape)):
        strides.append(step)
        step *= max(d, 1)
    t = torch.empty(0, dtype=dtype, device=device)
    t.set_(torch.UntypedStorage(0, device=device), 0, tuple(shape), tuple(reversed(strides)))
    # NOTE: set_ grows the storage to fit the shape; shrink it back to zero
    # bytes (the tensor keeps its shape and strides, as FSDP's freed params do).
    t.untyped_storage().resize_(0)
    return t


def is_placeholder(t: torch.Tensor) -> bool:
    """True for a tensor made by :func:`placeholder` (no bytes behind it)."""
    return t.untyped_storage().nbytes() == 0 and t.numel() > 0


@dataclass
class ParamEntry:
    """One unique parameter of the model."""

    index: int
    name: str  # first name it is registered under
    aliases: list[str]  # other names (tied parameters)
    param: nn.Parameter
    trainable: bool
    shape: tuple[int, ...]
    placeholder: torch.Tensor | None = None


@dataclass
class ParamRegistry:
    """Unique parameters in registration order and the modules that own them."""

    entries: list[ParamEntry] = field(default_factory=list)
    by_id: dict[int, ParamEntry] = field(default_factory=dict)
    owners: dict[nn.Module, list[ParamEntry]] = field(default_factory=dict)
    module_names: dict[nn.Module, str] = field(default_factory=dict)
    parents: dict[nn.Module, nn.Module | None] = field(default_factory=dict)

    @classmethod
    def from_model(cls, model: nn.Module) -> ParamRegistry:
        """Collect every parameter of ``model`` (tied ones once)."""
        reg = cls()
        reg.parents[model] = None
        for mod_name, module in model.named_modules(remove_duplicate=True):
            reg.module_names[module] = mod_name
            for child in module.children():
                reg.parents.setdefault(child, module)
            own = []
            for p_name, param in module.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                entry = reg.by_id.get(id(param))
                if entry is None:
                    entry = ParamEntry(
                        index=len(reg.entries),
                        name=full,
                        aliases=[],
                        param=param,
                        trainable=param.requires_grad,
                        shape=tuple(param.shape),
                    )
                    reg.entries.append(entry)
                    reg.by_id[id(param)] = entry
                elif full != entry.name:
                    entry.aliases.append(full)
                own.append(entry)
            if own:
                reg.owners[module] = own
        return reg

    def tensor_infos(self) -> list[TensorInfo]:
        """What the layout needs, in registration order."""
        return [TensorInfo(e.name, e.shape, e.trainable) for e in self.entries]

    def ancestors(self, module: nn.Module) -> Iterator[nn.Module]:
        """``module``'s parents up to the root."""
        parent = self.parents.get(module)
        while parent is not None:
            yield parent
            parent = self.parents.get(parent)

    def entry(self, param: torch.Tensor) -> ParamEntry | None:
        """The entry of ``param`` if it belongs to the model."""
        return self.by_id.get(id(param))
