"""Which module call each recorded aten op belongs to, and in which phase it ran (L2 audit).

Forward: global module pre/post hooks keep a stack of module calls; an op belongs to the
innermost one. Backward: while the forward is recorded, the autograd node each op created
(the ``grad_fn`` of its results, read right after the op) is labelled with the module call
that made it; in backward ``torch._C._current_autograd_node()`` names the node the engine is
running, so its ops go to that module. ``AccumulateGrad`` ops go to the module owning the
parameter. Optimizer hooks tell ``optimizer.step()``'s ops apart. No monkey-patching: only
hooks, which change nothing the ops compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from memlayout.tensors import iter_tensors

# Private torch hooks into the autograd engine, guarded: without them every op reads as
# forward (no task id) or backward ops fall back to the module stack (no current node).
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_current_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)

Label = tuple[int, str | None, str | None]  # (call index, module path, module type)
NO_MODULE: Label = (-1, None, None)


class ModuleCalls:
    """The module calls of a recorded block (``calls``: per call ``[path, type, depth, output
    formats, output ranks]``) and the stack of those running. ``model`` (optional) names
    modules by their path in it (``layer3.0.downsample.1``); others are named on first call
    from their parent (or their type, at top level). ``output_format(t)`` names an output's
    format; a failure there goes to ``on_error(what, exc)`` instead of breaking the run."""

    def __init__(self, model: nn.Module | None, output_format: Callable[[torch.Tensor], str],
                 on_error: Callable[[str, Exception], None]) -> None:
        self._model, self._output_format, self._on_error = model, output_format, on_error
        self.calls: list[list[Any]] = []
        self.stack: list[tuple[nn.Module, int]] = []
        self._names: dict[nn.Module, str] = {}
        self._roots = 0
        self._last_call: dict[nn.Module, int] = {}
        self._param_owner: dict[int, nn.Module] = {}
        if model is not None:
            self._register(model, "")

    def _register(self, module: nn.Module, prefix: str) -> None:
        for name, sub in module.named_modules(remove_duplicate=False):
            if sub not in self._names:
                self._names[sub] = f"{prefix}.{name}" if prefix and name else (prefix or name)
                for p in sub.parameters(recurse=False):
                    self._param_owner.setdefault(id(p), sub)

    def _name(self, module: nn.Module) -> str:
        name = self._names.get(module)
        if name is not None:
            return name
        if self.stack:
            parent, _ = self.stack[-1]
            parent_path = self._names[parent]
            child = next((n for n, c in parent.named_children() if c is module),
                         type(module).__name__)
            prefix = f"{parent_path}.{child}" if parent_path else child
        else:
            self._roots += 1
            prefix = "" if self._roots == 1 and self._model is None else type(module).__name__
            taken = set(self._names.values())
            base, n = prefix, 1
            while prefix in taken and prefix:
                n += 1
                prefix = f"{base}#{n}"
        self._register(module, prefix)
        return self._names[module]

    def enter(self, module: nn.Module) -> None:
        index = len(self.calls)
        self.calls.append([self._name(module), type(module).__name__, len(self.stack), (), ()])
        self.stack.append((module, index))
        self._last_call[module] = index

    def leave(self, module: nn.Module, output: Any) -> None:
        while self.stack:  # unwind past calls that raised (their post hook never ran)
            top, index = self.stack.pop()
            if top is module:
                outs = [t for t in iter_tensors(output) if isinstance(t, torch.Tensor)]
                try:
                    self.calls[index][3] = tuple(self._output_format(t) for t in outs)
                    self.calls[index][4] = tuple(t.dim() for t in outs)
                except Exception as exc:  # as in the recorder: never break the run
                    self._on_error(f"output of {self.calls[index][0]}", exc)
                break

    def current(self) -> Label:
        """The innermost module call running now."""
        if not self.stack:
            return NO_MODULE
        module, index = self.stack[-1]
        return (index, self._names[module], type(module).__name__)

    def owner_of(self, param: Any) -> Label | None:
        """The last call of the module that owns parameter ``param``, if one does."""
        owner = self._param_owner.get(id(param)) if param is not None else None
        if owner is None:
            return None
        return (self._last_call.get(owner, -1), self._names[owner], type(owner).__name__)


class Attribution:
    """The module call and phase of the op running now (:meth:`now`), while :meth:`start`'s
    hooks are installed; ``modules.calls``: every module call of the block."""

    def __init__(self, model: nn.Module | None, output_format: Callable[[torch.Tensor], str],
                 on_error: Callable[[str, Exception], None]) -> None:
        self.modules = ModuleCalls(model, output_format, on_error)
        self._node_labels: dict[Any, Label] = {}
        self._pending: list[tuple[list[torch.Tensor], Label]] = []
        self._optimizer_depth = 0
        self._handles: list[Any] = []

    def start(self) -> None:
        """Install the global module and optimizer hooks."""
        self._handles = [register_module_forward_pre_hook(self._pre_hook),
                         register_module_forward_hook(self._post_hook),
                         register_optimizer_step_pre_hook(self._optimizer_pre),
                         register_optimizer_step_post_hook(self._optimizer_post)]

    def stop(self) -> None:
        """Remove the hooks and let go of what only a running block needs (autograd nodes
        keep the graph alive); the calls stay."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pending.clear()
        self._node_labels.clear()
        self.modules.stack.clear()
        self._optimizer_depth = 0

    def now(self) -> tuple[str, Label]:
        """The phase (``forward``, ``backward``, ``optimizer``) and module call of the op
        running now."""
        self._flush()
        if _graph_task_id() != -1:
            return "backward", self._backward_label()
        return ("optimizer" if self._optimizer_depth else "forward"), self.modules.current()

    def created(self, outs: list[torch.Tensor], label: Label) -> None:
        """A forward op made ``outs``: their autograd node is ``label``'s, once it exists."""
        self._pending.append((outs, label))

    def _pre_hook(self, module: nn.Module, _args: Any) -> None:
        self._flush()
        self.modules.enter(module)

    def _post_hook(self, module: nn.Module, _args: Any, output: Any) -> None:
        self._flush()
        self.modules.leave(module, output)

    def _optimizer_pre(self, *_: Any) -> None:
        self._optimizer_depth += 1

    def _optimizer_post(self, *_: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)

    def _flush(self) -> None:
        """Label the autograd nodes the last forward op created with its module call."""
        for outs, label in self._pending:
            for t in outs:
                node = t.grad_fn
                if node is not None and node not in self._node_labels:
                    self._node_labels[node] = label
        self._pending.clear()

    def _backward_label(self) -> Label:
        node = _current_node()
        if node is not None:
            label = self._node_labels.get(node)
            if label is not None:
                return label
            # AccumulateGrad: the parameter's module
            owner = self.modules.owner_of(getattr(node, "variable", None))
            if owner is not None:
                return owner
        return self.modules.current()  # e.g. activation checkpointing re-running a forward
