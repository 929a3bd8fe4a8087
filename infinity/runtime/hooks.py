"""Install the engine's hooks on a model (and remove them).

- root forward pre/post: start an iteration; scope the saved-tensor hooks that
  turn saved weight views into handles (so autograd never pins chunk memory);
- forward pre/post on every module that owns parameters: fetch and release;
- per trainable parameter: a tensor hook (runs before AccumulateGrad) and a
  post-accumulate-grad hook that moves the gradient into its chunk.

Every hook is opaque to ``torch.compile`` (``torch.compiler.disable``): Dynamo
breaks the graph at each one and runs it eagerly, so a compiled model's graphs
end at the forward boundaries of the modules owning parameters. Tracing into
the engine instead would fail (it does I/O, reads storage pointers, keeps
Python state) and would guard on state that changes every step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from infinity.activations.trace import batch_shape
from infinity.runtime.direct_reads import head_read_directly
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.move_guard import MoveGuard

_opaque = torch.compiler.disable


def _weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """A tensor hook that calls the engine's ``method`` through a weak reference, timed
    as the engine's host work (NOTE [the step's bound]).

    NOTE: tensor hooks live in the C++ tensor, where the garbage collector cannot
    see them: a hook holding the engine (which holds the parameter) would be a
    cycle it never frees, so a dropped model would keep its threads and swap file.
    """
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = ref()
        if bound is None:
            return None
        with cast(Any, bound).__self__.manager.traffic.in_hook():
            return bound(*args)

    return hook


class HookSet:
    """Every hook the engine put on a model, removable at once."""

    def __init__(self, model: nn.Module, engine: OffloadEngine) -> None:
        self.handles: list[RemovableHandle] = []
        self._scopes: list[saved_tensors_hooks] = []
        self._engine = engine
        pack, unpack = _opaque(engine.pack), _opaque(engine.unpack)

        @_opaque
        def root_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            engine.begin_forward(batch_shape(args, kwargs))
            scope = saved_tensors_hooks(pack, unpack)
            scope.__enter__()
            self._scopes.append(scope)

        @_opaque
        def root_post(module: nn.Module, args: tuple, output: object) -> None:
            # always_call=True: runs on exceptions too, so the scope never leaks.
            while self._direct_open:
                self._leave(self._direct_open.pop())
            if self._scopes:
                self._scopes.pop().__exit__(None, None, None)
            engine.end_forward()

        # Nesting depth of each owner's binding: a module bound by a direct read
        # (direct_reads.py) may also run its own forward inside it.
        self._depth: dict[nn.Module, int] = {}
        direct = head_read_directly(model, engine.registry)

        @_opaque
        def backbone_post(module: nn.Module, args: tuple, output: object) -> None:
            assert direct is not None
            self._enter(direct.owner)
            self._direct_open.append(direct.owner)

        self._direct_open: list[nn.Module] = []
        self.handles.append(
            model.register_forward_pre_hook(root_pre, prepend=True, with_kwargs=True)
        )
        for module in engine.registry.owners:
            self.handles.append(module.register_forward_pre_hook(self._pre(module)))
            self.handles.append(module.register_forward_hook(self._post(module), always_call=True))
        if direct is not None:
            self.handles.append(direct.backbone.register_forward_hook(backbone_post))
        self.handles.append(model.register_forward_hook(root_post, always_call=True))
        self._move_guard = MoveGuard(model, engine.device, engine.dtype)
        # Blocks: what the forward saves is measured per block (and checkpointed).
        policy = engine.activation_policy
        trace = policy.trace
        for block in policy.blocks:
            enter = _opaque(lambda m, a: trace.enter(m))
            self.handles.append(block.register_forward_pre_hook(enter))
            self.handles.append(
                block.register_forward_hook(
                    _opaque(lambda m, a, o: trace.leave(m)), always_call=True
                )
            )
        policy.attach()
        before_grad = _opaque(_weak(engine.before_grad))
        on_grad = _opaque(_weak(engine.on_grad))
        for entry in engine.registry.entries:
            if entry.trainable:
                param = entry.param
                self.handles.append(param.register_hook(before_grad))
                self.handles.append(param.register_post_accumulate_grad_hook(on_grad))

    def _enter(self, module: nn.Module) -> None:
        depth = self._depth.get(module, 0)
        if depth == 0:
            with self._engine.manager.traffic.in_hook():
                self._engine.begin_module(module)
        self._depth[module] = depth + 1

    def _leave(self, module: nn.Module) -> None:
        depth = self._depth.get(module, 0)
        if depth <= 1:
            self._depth.pop(module, None)
            with self._engine.manager.traffic.in_hook():
                self._engine.end_module(module)
        else:
            self._depth[module] = depth - 1

    def _pre(self, module: nn.Module) -> Callable[..., None]:
        @_opaque
        def hook(mod: nn.Module, args: tuple) -> None:
            self._enter(module)

        return hook

    def _post(self, module: nn.Module) -> Callable[..., None]:
        @_opaque
        def hook(mod: nn.Module, args: tuple, output: object) -> None:
            self._leave(module)

        return hook

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._move_guard.remove()
        self._engine.activation_policy.remove()
