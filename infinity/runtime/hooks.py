"""Install the engine's hooks on a model (and remove them).

- root forward pre/post: start an iteration; scope the saved-tensor hooks that
  turn saved weight views into handles (so autograd never pins chunk memory); a
  ``transformers`` backbone called on its own is the root of its call, and any
  other module called outside a forward scopes its saved weights
  (NOTE [modules called on their own]);
- forward pre/post on every module that owns parameters: fetch and release;
- per trainable parameter: a tensor hook (runs before AccumulateGrad) and a
  post-accumulate-grad hook that moves the gradient into its chunk.

Every hook is opaque to ``torch.compile`` (``torch.compiler.disable``): Dynamo
breaks the graph at each one and runs it eagerly, so a compiled model's graphs
end at the forward boundaries of the modules owning parameters. Tracing into
the engine instead would fail (it does I/O, reads storage pointers, keeps
Python state) and would guard on state that changes every step.

Also here: parameters a model's own forward reads without calling their module
(:func:`head_read_directly`) and ``state_dict`` / ``load_state_dict``
(:func:`install_state_dict_hooks`).

Fused losses — TRL's ``SFTTrainer`` (its fused LM head), Liger,
cut-cross-entropy — run the backbone, then take ``lm_head.weight`` and
multiply by it in their own kernel, in tiles, so the head module's forward,
and with it the engine's fetch, never runs. The weight would then be the
parameter's placeholder (NaN). For a ``transformers`` model the engine
therefore keeps the output embedding's parameters bound from the end of the
backbone's forward to the end of the root's (where the head is used in
either case), exactly as if the head's forward had been running.

What torch does to a whole model that an offloaded one cannot take (``model.to``,
``model.half()``, ``copy.deepcopy``, a DDP wrapper) is refused by the guards of
:mod:`infinity.runtime.guards`, installed here with the hooks.

Outside a forward, parameters hold zero-byte placeholders; these hooks put the
real values (read from the chunks) into ``state_dict()`` and route values given
to ``load_state_dict()`` into the chunks (masters included), instead of letting
torch copy into a placeholder.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from infinity.activations.policy import batch_shape
from infinity.devices.choice import autocast_casts_weights
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.guards import CopyGuard, MoveGuard
from infinity.runtime.params import ParamEntry, ParamRegistry, is_pretrained_model
from infinity.runtime.state_access import read_params, write_params

_opaque = torch.compiler.disable
_T = TypeVar("_T")


def _in_backward() -> bool:
    """A backward pass is running (a checkpointed block's forward is recomputed)."""
    return torch._C._current_graph_task_id() != -1


def _to_sink(engine: OffloadEngine, verb: str) -> Callable[..., Any]:
    """A tensor hook that calls the gradient sink's ``verb`` (``on_grad``,
    ``before_grad``) through a weak reference to the engine, timed as the engine's
    host work (NOTE [the step's bound]). The sink is the engine's from its lay-out,
    which a forward runs before any backward.

    NOTE [the model owns its engine]; and tensor hooks live in the C++ tensor, where
    the garbage collector cannot see them: a cycle through one is never freed.
    """
    ref = weakref.ref(engine)

    def hook(*args: Any) -> Any:
        owner = ref()
        if owner is None:
            return None
        with owner.manager.traffic.in_hook():
            return getattr(owner.sink, verb)(*args)

    return hook


def _alive(ref: weakref.ref[_T]) -> _T:
    """What a module's hook refers to (NOTE [the model owns its engine])."""
    found = ref()
    if found is None:
        raise ReferenceError(
            "this module belongs to an offloaded model that was dropped: its chunks are "
            "freed. Keep a reference to the model itself (the module infinity.offload "
            "returned) while any of its modules is used"
        )
    return found


class HookSet:
    """Every hook the engine put on a model, removable at once. Only the root's own
    hooks hold it strongly; every other hook holds it, and modules, weakly:
    NOTE [the model owns its engine]."""

    def __init__(self, model: nn.Module, engine: OffloadEngine) -> None:
        self.handles: list[RemovableHandle] = []
        self._scopes: list[saved_tensors_hooks] = []
        self._engine = engine
        self._autocast_said = False  # autocast_casts_weights: said once
        # NOTE [the model owns its engine]: autograd keeps these in every saved tensor of
        # a graph, in C++ where the collector cannot see them, and a graph may outlive
        # the model (fake tensors' own cycles keep an estimate's): they hold it weakly.
        ref = weakref.ref(engine)

        @_opaque
        def pack(tensor: torch.Tensor) -> Any:
            owner = ref()  # inline, not _alive: this runs for every saved tensor
            return owner.pack(tensor) if owner is not None else _alive(ref)

        @_opaque
        def unpack(packed: Any) -> torch.Tensor:
            # NOTE [the step's bound]: an unpack fetches chunks and waits for saved
            # tensors, host work the device may idle through, like a hook's (a pack only
            # records a handle: not timed, it runs for every saved tensor)
            owner = _alive(ref)
            with owner.manager.traffic.in_hook():
                return owner.unpack(packed)

        @_opaque
        def pack_weight(tensor: torch.Tensor) -> Any:
            handle = _alive(ref).pack_weight(tensor)
            return tensor if handle is None else handle

        self._saved_hooks = (pack, unpack)
        self._weight_hooks = (pack_weight, unpack)
        # The owner module whose call, outside any forward of the model's, holds the
        # weight-only saved-tensor scope (NOTE [modules called on their own]).
        self._outside: tuple[nn.Module, saved_tensors_hooks] | None = None

        @_opaque
        def root_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._begin_forward(batch_shape(args, kwargs))

        @_opaque
        def root_post(module: nn.Module, args: tuple, output: object) -> None:
            # always_call=True: runs on exceptions too, so the scope never leaks.
            self._end_forward()

        # Nesting depth of each owner's binding: a module bound by a direct read
        # (head_read_directly, below) may also run its own forward inside it.
        self._depth: dict[nn.Module, int] = {}
        direct = head_read_directly(model, engine.registry)
        self._backbone_is_root = False
        me = weakref.ref(self)
        head = weakref.ref(direct.owner) if direct is not None else None

        @_opaque
        def backbone_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hooks = _alive(me)
            if not hooks._scopes and not _in_backward():
                # NOTE [modules called on their own]: the loop runs the backbone itself
                # (model.model(...), then model.lm_head(h)): its call is the forward.
                hooks._backbone_is_root = True
                hooks._begin_forward(batch_shape(args, kwargs))

        @_opaque
        def backbone_post(module: nn.Module, args: tuple, output: object) -> None:
            hooks = _alive(me)
            owner = head() if head is not None else None
            if hooks._backbone_is_root:
                hooks._backbone_is_root = False
                hooks._end_forward()
                return
            if owner is not None:
                hooks._enter(owner)
                hooks._direct_open.append(owner)

        self._direct_open: list[nn.Module] = []
        self.handles.append(
            model.register_forward_pre_hook(root_pre, prepend=True, with_kwargs=True)
        )
        # Each module binds its own parameters, and the owners of those its forward reads
        # while they do not run (ParamRegistry.reads), for the length of its forward.
        binds: dict[nn.Module, list[nn.Module]] = {m: [m] for m in engine.registry.owners}
        for reader, owners in engine.registry.read_owners():
            skip = direct.owner if direct is not None else None  # bound from the backbone's end
            binds.setdefault(reader, []).extend(o for o in owners if o is not skip)
        for module, owners in binds.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(module, owners)))
            self.handles.append(
                module.register_forward_hook(self._post(module, owners), always_call=True)
            )
        if direct is not None:
            self.handles.append(
                # prepend: before an owner's hook could take the call for its own
                direct.backbone.register_forward_pre_hook(
                    backbone_pre, prepend=True, with_kwargs=True
                )
            )
            self.handles.append(
                direct.backbone.register_forward_hook(backbone_post, always_call=True)
            )
        self.handles.append(model.register_forward_hook(root_post, always_call=True))
        self._move_guard = MoveGuard(model, engine.device, engine.dtype)
        self._copy_guard = CopyGuard(model)
        # Blocks: what the forward saves is measured per block (and checkpointed).
        policy = engine.activation_policy
        trace = policy.trace
        traced = weakref.ref(trace)
        for block in policy.blocks:
            enter = _opaque(lambda m, a: _alive(traced).enter(m))
            self.handles.append(block.register_forward_pre_hook(enter))
            self.handles.append(
                block.register_forward_hook(
                    _opaque(lambda m, a, o: _alive(traced).leave(m)), always_call=True
                )
            )
        policy.attach()
        before_grad = _opaque(_to_sink(engine, "before_grad"))
        on_grad = _opaque(_to_sink(engine, "on_grad"))
        for entry in engine.registry.entries:
            if entry.trainable:
                param = entry.param
                self.handles.append(param.register_hook(before_grad))
                self.handles.append(param.register_post_accumulate_grad_hook(on_grad))

    def _begin_forward(self, shape: tuple[int, int] | None) -> None:
        """A forward of the model starts: the engine's iteration, and the scope that
        turns what the forward saves into handles."""
        engine = self._engine
        engine.begin_forward(shape)
        device, dtype = engine.device, engine.dtype
        problem = None if self._autocast_said else autocast_casts_weights(device, dtype)
        if problem is not None:
            self._autocast_said = True
            warnings.warn(problem, RuntimeWarning, stacklevel=5)
        scope = saved_tensors_hooks(*self._saved_hooks)
        scope.__enter__()
        self._scopes.append(scope)

    def _end_forward(self) -> None:
        """The forward ended (or raised): close its direct reads and its scope."""
        while self._direct_open:
            self._leave(self._direct_open.pop())
        if self._scopes:
            self._scopes.pop().__exit__(None, None, None)
        self._engine.end_forward()

    def _enter(self, module: nn.Module) -> None:
        depth = self._depth.get(module, 0)
        if depth == 0:
            with self._engine.manager.traffic.in_hook():
                self._engine.begin_module(module)
        self._depth[module] = depth + 1

    def _leave(self, module: nn.Module) -> None:
        if not self._engine.laid_out:
            return  # the lay-out failed in this forward's first hook: nothing is bound
        depth = self._depth.get(module, 0)
        if depth <= 1:
            self._depth.pop(module, None)
            with self._engine.manager.traffic.in_hook():
                self._engine.end_module(module)
        else:
            self._depth[module] = depth - 1

    def _pre(self, module: nn.Module, owners: list[nn.Module]) -> Callable[..., None]:
        me = weakref.ref(self)
        bound = [weakref.ref(o) for o in owners]

        @_opaque
        def hook(mod: nn.Module, args: tuple) -> None:
            self = _alive(me)
            if not self._scopes and self._outside is None and not _in_backward():
                # NOTE [modules called on their own]: a module called outside every
                # forward of the model's (model.lm_head(h), an embedding for
                # inputs_embeds) saves views of its chunks like any: unscoped, they
                # would pin the device slots until backward (PoolExhausted at tight
                # budgets). Only weights become handles here: other saved tensors
                # stay as they are, outside any iteration of the activation policy.
                self._engine.lay_out("a module's forward")
                scope = saved_tensors_hooks(*self._weight_hooks)
                scope.__enter__()
                self._outside = (mod, scope)
            for ref in bound:
                self._enter(_alive(ref))

        return hook

    def _post(self, module: nn.Module, owners: list[nn.Module]) -> Callable[..., None]:
        me = weakref.ref(self)
        bound = [weakref.ref(o) for o in reversed(owners)]

        @_opaque
        def hook(mod: nn.Module, args: tuple, output: object) -> None:
            self = _alive(me)
            for ref in bound:
                self._leave(_alive(ref))
            if self._outside is not None and self._outside[0] is mod:
                self._outside[1].__exit__(None, None, None)
                self._outside = None

        return hook

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._move_guard.remove()
        self._copy_guard.remove()
        self._engine.activation_policy.remove()


@dataclass(frozen=True)
class DirectRead:
    """Bind ``owner``'s parameters once ``backbone``'s forward has ended, until the
    root's forward ends (``owner``: the head, or whichever module owns its weight)."""

    backbone: nn.Module
    owner: nn.Module


def head_read_directly(model: nn.Module, registry: ParamRegistry) -> DirectRead | None:
    """The :class:`DirectRead` of ``model``'s output embedding, if ``model`` is (or
    wraps, like a ``peft`` model) a ``transformers`` model whose head is offloaded."""
    hf = next((m for m in model.modules() if is_pretrained_model(m)), None)
    if hf is None:
        return None
    get_head = getattr(hf, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    backbone = getattr(hf, getattr(hf, "base_model_prefix", ""), None)
    weight = getattr(head, "weight", None)
    if not isinstance(backbone, nn.Module) or not isinstance(weight, nn.Parameter):
        return None
    if isinstance(head, nn.Module) and head in registry.owners:
        # With tied weights the head owns the weight too: its own forward
        # (when a loop does call it) then nests inside the direct read's binding.
        return DirectRead(backbone, head)
    for module, entries in registry.owners.items():
        if any(e.param is weight for e in entries):
            return DirectRead(backbone, module)
    return None


def install_state_dict_hooks(engine: OffloadEngine) -> list[RemovableHandle]:
    """Hooks on every module that owns parameters; returns their handles. They hold
    the engine weakly (NOTE [the model owns its engine])."""
    handles: list[RemovableHandle] = []
    ref = weakref.ref(engine)
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
            for entry, value in read_params(_alive(ref), wanted.values()):
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
                write_params(_alive(ref), values)

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
