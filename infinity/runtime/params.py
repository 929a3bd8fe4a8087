"""The parameters of an offloaded model: identity, names, owners, placeholders.

A tied parameter (one ``Parameter`` registered in several modules) is one
entry here and lives once in a chunk. Outside a module's forward, a parameter's
``.data`` is a *placeholder*: right shape, dtype and device, zero bytes of
storage, so metadata (``numel()``, ``shape``) works and no chunk memory is held.

Also :class:`UnsetParameterError` (a parameter used before any load set it) and
:func:`is_pretrained_model` (a ``transformers`` model, recognised without
importing ``transformers``).
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from infinity.activations.blocks import blocks_for, transformers_checkpointing
from infinity.activations.forward_trace import forward_trace
from infinity.chunks.layout import ChunkLayout, TensorInfo
from infinity.core.plan import Plan
from infinity.schedule.device_slots import HeldBlock, min_device_slots

_NAN_CELLS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
# The cells' storage addresses: a saved tensor is checked against them (the pack hook
# reads its storage address anyway), a set lookup per saved tensor.
PLACEHOLDER_STORAGES: set[int] = set()


def _nan_cell(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _NAN_CELLS:
        _NAN_CELLS[key] = torch.full((1,), float("nan"), dtype=dtype, device=device)
        PLACEHOLDER_STORAGES.add(_NAN_CELLS[key].untyped_storage().data_ptr())
    return _NAN_CELLS[key]


def placeholder(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """What a parameter's ``.data`` is while its values live only in chunks.

    One shared NaN element seen with zero strides in the parameter's shape: metadata
    (``shape``, ``numel()``, ``dtype``, ``device``) is right and no memory is
    held; reading gives NaN (obviously not the weights, where a zero-byte
    storage would crash the process), and most writes in place raise (a constant
    fill passes: :func:`check_model` refuses it). Autograd's AccumulateGrad reads
    only metadata, so gradients still arrive.

    NOTE: not a view of the cell (``expand``): a view shares its base's version
    counter, and so would every parameter born on ``meta`` (made from its
    placeholder), so that a write to one looked like a write to all.
    """
    shape = tuple(shape)
    alone = torch.empty(0, dtype=dtype, device=device)
    return alone.set_(_nan_cell(dtype, device).untyped_storage(), 0, shape, (0,) * len(shape))


def is_placeholder(t: torch.Tensor) -> bool:
    """True for a tensor made by :func:`placeholder`."""
    cell = _NAN_CELLS.get((t.dtype, t.device))
    return cell is not None and t.untyped_storage().data_ptr() == cell.untyped_storage().data_ptr()


def placeholder_used(registry: ParamRegistry, tensor: torch.Tensor) -> str:
    """What to say of a parameter's placeholder that autograd was about to save.

    NOTE: a parameter is bound only while a forward that uses it runs (its module's, or
    a reader's: ``ParamRegistry.reads``); a forward that reads it elsewhere, where the
    fake forward at offload could not see it, computed with its placeholder: NaN
    logits, and a NaN gradient written into its chunk, silently. Caught where autograd
    saves it (most such reads feed a product, which saves its operands).
    """
    entry = registry.by_id.get(id(tensor))
    # A view of it (a transpose) is saved as often: then the parameters of its size.
    names = (
        [entry.name]
        if entry is not None
        else [e.name for e in registry.entries if e.param.numel() == tensor.numel()]
    )
    what = (
        f"parameter {' or '.join(repr(n) for n in names[:3])}"
        if names
        else f"a parameter ({tuple(tensor.shape)}, {tensor.dtype})"
    )
    return (
        f"{what} was used outside the forward of the module that holds it: there it "
        "is a NaN placeholder (its values live in infinity's chunks, bound while that "
        "module's forward runs), and nothing was computed from its weights. Call the "
        "module, or make the use a module of its own: a tied output layer is a Linear "
        "whose weight is the embedding's (head.weight = emb.weight), as transformers' "
        "models and infinity's GPT have it"
    )


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
    # The parameter's version counter when its .data last became the placeholder: a
    # write in place since then (nn.init.zeros_, fill_) reached the placeholder, not the
    # chunks (check_model refuses it).
    placeholder_version: int = 0

    def show_placeholder(self) -> None:
        """Point the parameter's ``.data`` at its placeholder (which must exist)."""
        assert self.placeholder is not None
        self.param.data = self.placeholder
        self.placeholder_version = self.param._version


def tensor_index(entry: ParamEntry) -> int:
    """``entry``'s position in the layout (the key of ``ChunkLayout.group_by_chunk``)."""
    return entry.index


_Modules = weakref.WeakKeyDictionary


@dataclass
class ParamRegistry:
    """Unique parameters in registration order and the modules that own them (held
    weakly: NOTE [the model owns its engine])."""

    entries: list[ParamEntry] = field(default_factory=list)
    by_id: dict[int, ParamEntry] = field(default_factory=dict)
    owners: _Modules[nn.Module, list[ParamEntry]] = field(default_factory=_Modules)
    module_names: _Modules[nn.Module, str] = field(default_factory=_Modules)
    parents: _Modules[nn.Module, weakref.ref[nn.Module] | None] = field(default_factory=_Modules)
    # Blocks whose forward runs again in backward (activation checkpointing).
    recomputed: list[nn.Module] = field(default_factory=list)
    # A module -> the owners whose parameters its forward reads while they do not run
    # (forward_trace): bound for its whole forward, as its own are.
    reads: _Modules[nn.Module, list[weakref.ref[nn.Module]]] = field(default_factory=_Modules)

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        recomputed: Sequence[nn.Module] = (),
        order: Sequence[str] | None = None,
    ) -> ParamRegistry:
        """Collect every parameter of ``model`` (tied ones once); ``recomputed``: its
        blocks whose forward runs again in backward (see :meth:`working_sets`).

        ``order``: module names whose parameters come first, in that order; by default
        the order the forward first uses them
        (:func:`~infinity.activations.estimate.forward_order`), so chunks are packed in
        the order backward completes them; ``()``: registration order. Modules it does
        not name follow in registration order."""
        reg = cls(recomputed=list(recomputed))
        reg.parents[model] = None
        modules = dict(model.named_modules(remove_duplicate=True))
        for mod_name, module in modules.items():
            reg.module_names[module] = mod_name
            for child in module.children():
                reg.parents.setdefault(child, weakref.ref(module))
        trace = forward_trace(model) if order is None else None
        if order is None:
            order = trace.order if trace is not None else ()
        used = [name for name in order if name in modules]
        for mod_name in dict.fromkeys([*used, *modules]):
            module = modules[mod_name]
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
        reg._own_once_per_branch()
        if trace is not None:
            reg._bind_reads(model, modules, trace.reads)
        return reg

    def _bind_reads(
        self, model: nn.Module, modules: dict[str, nn.Module], reads: dict[str, set[str]]
    ) -> None:
        """:attr:`reads` from the trace's names: each parameter read by a module's
        forward while no module holding it ran, through the owner that binds it.

        NOTE: DeBERTa's encoder reads its relative-position embedding's weight, and a
        hand-tied head reads the token embedding's, without calling that module: the
        weight was its NaN placeholder (training stopped at the pack hook's check,
        evaluation gave NaN).
        """
        params = dict(model.named_parameters())
        owner_of = {id(e): m for m, entries in self.owners.items() for e in entries}
        for reader_name, names in reads.items():
            reader = modules.get(reader_name)
            entries = [self.by_id.get(id(params[n])) for n in names if n in params]
            owners = {owner_of[id(e)]: None for e in entries if e is not None and id(e) in owner_of}
            if reader is not None and owners:
                self.reads[reader] = [weakref.ref(o) for o in owners]

    def read_owners(self) -> Iterator[tuple[nn.Module, list[nn.Module]]]:
        """:attr:`reads`: each reader and the owners whose parameters it reads."""
        for reader, owners in list(self.reads.items()):
            yield reader, [o for o in (ref() for ref in owners) if o is not None]

    def _own_once_per_branch(self) -> None:
        """A parameter a module and one of its ancestors both register is owned by the
        ancestor alone, whose forward holds the module's.

        NOTE: BERT's MLM head registers its output bias in the head and again in the
        decoder inside it (``self.decoder.bias = self.bias``): binding it twice, nested,
        was an illegal COMPUTE -> COMPUTE in the first forward.
        """
        for module, entries in list(self.owners.items()):
            above = {id(e) for a in self.ancestors(module) for e in self.owners.get(a, ())}
            kept = [e for e in entries if id(e) not in above]
            if len(kept) == len(entries):
                continue
            if kept:
                self.owners[module] = kept
            else:
                del self.owners[module]

    def tensor_infos(self) -> list[TensorInfo]:
        """What the layout needs, in registration order (grouped by first owning module)."""
        group_of: dict[int, int] = {}
        for g, entries in enumerate(self.owners.values()):
            for e in entries:
                group_of.setdefault(e.index, g)
        return [
            TensorInfo(e.name, e.shape, e.trainable, group_of.get(e.index, -1))
            for e in self.entries
        ]

    def ancestors(self, module: nn.Module) -> Iterator[nn.Module]:
        """``module``'s parents up to the root."""
        ref = self.parents.get(module)
        parent = ref() if ref is not None else None
        while parent is not None:
            yield parent
            ref = self.parents.get(parent)
            parent = ref() if ref is not None else None

    def working_sets(self, layout: ChunkLayout) -> list[frozenset[int]]:
        """Chunks each module holds at once: its own and its ancestors' parameters';
        and those of every recomputed block with all it contains.

        A recomputed block runs its whole forward again at the start of its
        backward, and what that forward saves (views of every parameter inside the
        block) lives until the block's backward nodes have run: all of its chunks
        are held at once, beside the gradient chunks receiving.
        """
        own = {m: {layout.slots[e.index].chunk for e in es} for m, es in self.owners.items()}
        for reader, owners in self.read_owners():  # bound for the reader's whole forward
            own.setdefault(reader, set()).update(*(own.get(o, set()) for o in owners))
        sets = []
        for module, chunks in own.items():
            held = set(chunks)
            for parent in self.ancestors(module):
                held |= own.get(parent, set())
            sets.append(frozenset(held))
        for block in self.recomputed:
            held = set()
            for module in block.modules():  # the block itself and all inside it
                held |= own.get(module, set())
            for parent in self.ancestors(block):
                held |= own.get(parent, set())
            sets.append(HeldBlock(held))
        return sets

    @property
    def root(self) -> nn.Module:
        """The model itself (the module without a parent)."""
        root = next((m for m, parent in self.parents.items() if parent is None), None)
        if root is None:
            raise ReferenceError("the offloaded model was dropped: its engine is closing")
        return root

    def entry(self, param: torch.Tensor) -> ParamEntry | None:
        """The entry of ``param`` if it belongs to the model."""
        return self.by_id.get(id(param))


def check_model(
    registry: ParamRegistry,
    dtype: torch.dtype,
    device: torch.device,
    count: int,
    training: bool,
) -> None:
    """Refuse to run if parameters were swapped, added, converted or written in place
    after offload (``count``: the parameters the model had then), or, when ``training``,
    unfrozen since."""
    for entry in registry.entries:
        if training and not entry.trainable and entry.param.requires_grad:
            # NOTE: the chunks were cut at offload with frozen tensors apart, without
            # gradient or optimizer room; such a parameter's gradient had nowhere to go
            # and it silently never trained.
            raise ModelChangedError(
                f"parameter {entry.name!r} was frozen (requires_grad=False) when the model "
                "was offloaded and requires gradients now: infinity laid out no gradient or "
                "optimizer state for it, so it would not train. Set requires_grad on every "
                "parameter to train before infinity.offload() (freezing later is fine)"
            )
        data = entry.param.data
        if not is_placeholder(data) or data.dtype != dtype or data.device != device:
            raise ModelChangedError(
                f"parameter {entry.name!r} was changed after infinity.offload() "
                f"(now {data.dtype} on {data.device}); move or convert the model before "
                "offloading it, not after"
            )
        if entry.param._version != entry.placeholder_version:
            # NOTE: constant fills (fill_, zero_, nn.init.zeros_/ones_/constant_) pass on
            # a zero-stride tensor and wrote the NaN cell every placeholder shares.
            _nan_cell(dtype, device).fill_(float("nan"))
            entry.placeholder_version = entry.param._version
            raise ModelChangedError(
                f"parameter {entry.name!r} was written in place after infinity.offload() "
                "(nn.init.zeros_, ones_, constant_, fill_, ...): outside a forward its .data "
                "is a placeholder and its values live in infinity's chunks, so the write "
                "reached no weight and was dropped. Initialise the model before offloading "
                "it, or load values with model.load_state_dict(...)"
            )
    root = registry.root
    now = sum(1 for _ in root.parameters())
    if now != count:
        raise ModelChangedError(
            f"the model now has {now} parameters but had {count} when it was "
            "offloaded; build the final model first, then call infinity.offload()"
        )
    for name, p in root.named_parameters():  # as many, but one replaced since
        if id(p) not in registry.by_id:
            raise ModelChangedError(
                f"parameter {name!r} was replaced after infinity.offload() (a module swapped "
                "since, as resize_token_embeddings does); build the final model first, then "
                "call infinity.offload()"
            )


def check_late_checkpointing(
    registry: ParamRegistry, plan: Plan, activation_blocks: tuple[str, ...] | None
) -> bool:
    """Refuse a training forward whose backward recomputes blocks the plan made no room
    for: ``transformers``' gradient checkpointing turned on after ``offload`` (``plan``:
    the engine's; ``activation_blocks``: ``Config.activation_blocks``). True when such
    blocks were accepted now: the device cache must then keep slots to their sizes, as
    under a plan made with them (``TierCache.lend_larger``).

    NOTE: a recomputed block holds all its chunks at once in backward, beside a
    receiving gradient slot of each size. A plan made without one may lack the slots,
    and backward then ran out of them (PoolExhausted) at budgets that train with
    checkpointing turned on first; where the plan's slots hold every block, the
    blocks are accepted (and recorded, so this is asked once).
    """
    if registry.recomputed:
        return False
    root = registry.root
    if not transformers_checkpointing(root):
        return False
    blocks = [module for _, module in blocks_for(root, activation_blocks, False)]
    with_blocks = dataclasses.replace(registry, recomputed=blocks)
    need = min_device_slots(
        plan.layout,
        plan.element_size,
        with_blocks.working_sets(plan.layout),
        2 if plan.sharded else 1,
    )
    short = {size: n for size, n in need.items() if plan.device_slots.get(size, 0) < n}
    if not short:
        registry.recomputed = blocks
        return True
    missing = sum(size * (n - plan.device_slots.get(size, 0)) for size, n in short.items())
    raise ModelChangedError(
        "transformers' gradient checkpointing was turned on after infinity.offload() "
        "(model.gradient_checkpointing_enable(), which the Trainer calls with "
        "TrainingArguments(gradient_checkpointing=True)), and the device slots planned "
        f"without it are {missing} bytes short of holding a recomputed block in backward. "
        "Turn it on before infinity.offload() (the Trainer then finds it on), or offload "
        "with infinity.Config(activations='checkpoint')"
    )


class ModelChangedError(RuntimeError):
    """The model's parameters were replaced, added or converted after ``offload``."""


class UnsetParameterError(RuntimeError):
    """A parameter offloaded with ``init="load"`` was used before anything loaded it."""


def is_pretrained_model(module: nn.Module) -> bool:
    """``module`` is a ``transformers.PreTrainedModel``.

    NOTE: looked up in ``sys.modules``, never imported: a module can only be a
    PreTrainedModel if ``transformers`` is already loaded, and the core package
    does not depend on it.
    """
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers else None
    return pretrained is not None and isinstance(module, pretrained)
