"""A plan made real on the user's module tree (application): each parameter's format, converted
once in place, and each steered module's boundary.

:class:`Steering` is what one plan changes; :func:`steer` applies it to a model (its own class
and tree: a copy the planner made, or the caller's object with ``inplace=True``), and
:func:`unsteer` takes the boundaries off again (an analysis copy must run the user's code).
A ``torch.fx.GraphModule`` in the model is pickled and copied with its steering
(:func:`carry_steering`).

>>> from torch import nn
>>> from memlayout.plan.steer.boundary import Boundary, Leaf, Returned
>>> net = nn.Sequential(nn.Conv2d(3, 4, 3))
>>> last, first = Label.CHANNELS_LAST, Label.CONTIGUOUS
>>> s = Steering(parameters=(("0.weight", last),), boundaries=(("", Boundary(inputs=(Leaf(0, last, 4),))),))
>>> state = steer(net, s, key="example", input_label=None, outputs=(Returned(0, first, 4),), plan=None)
>>> net(torch.zeros(1, 3, 5, 5)).is_contiguous(), net[0].weight.is_contiguous()
(True, False)
>>> type(net) is nn.Sequential, list(net.state_dict())
(True, ['0.weight', '0.bias'])
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph_module import _format_import_block, reduce_graph_module
from torch.package import sys_importer

from memlayout.plan.graph import BASE_RANKS, Label
from memlayout.plan.steer.boundary import Boundary
from memlayout.plan.steer.forward import RootForward, SteeredForward, steered
from memlayout.plan.steer.state import Formats, PlannedState, Replanner
from memlayout.tensors import to_format

#: the attribute a planned model keeps its :class:`PlannedState` under
STATE = "memlayout"
#: what memlayout puts on a module of a planned model: a steered forward, the root's planned
#: state and ``model.plan``
CARRIED = ("forward", STATE, "plan")


@dataclass(frozen=True)
class Steering:
    """What one plan changes on a model: ``parameters`` (a parameter's or buffer's name and
    the label its format takes) and ``boundaries`` (a module's path, ``""`` the root, and
    what its calls convert)."""

    parameters: tuple[tuple[str, Label], ...] = ()
    boundaries: tuple[tuple[str, Boundary], ...] = ()

    def padded(self, channels: dict[str, tuple[int, int]]) -> Steering:
        """This steering with the convolutions at the given paths padded to ``(C_in, C_out)``."""
        boundaries = dict(self.boundaries)
        for path, pads in channels.items():
            boundaries[path] = dataclasses.replace(boundaries.get(path, Boundary()), padding=pads)
        return dataclasses.replace(self, boundaries=tuple(sorted(boundaries.items())))

    @property
    def conversions(self) -> int:
        """The conversions at boundaries (a leaf converted on the way in or out)."""
        return sum(len(b.inputs) + len(b.outputs) for _, b in self.boundaries)


def steer(model: nn.Module, steering: Steering, *, key: Any, input_label: Label | None,
          outputs: Formats, plan: Any, dtype: torch.dtype | None = None,
          ranks: tuple[int, ...] = BASE_RANKS, max_plans: int = 8,
          replanner: Replanner | None = None) -> PlannedState:
    """Apply ``steering`` to ``model`` as the plan of ``key`` (in place): parameters converted,
    boundaries installed, the root's forward a :class:`RootForward` holding the model's
    :class:`PlannedState` (created here, or the one the model has: another shape's plan)."""
    state = planned_state(model)
    converted = convert_parameters(model, steering.parameters)
    if state is None:
        state = PlannedState(plan=plan, key=key, dtype=dtype, ranks=ranks,
                             input_label=input_label, outputs=outputs, max_plans=max_plans,
                             replanner=replanner, original_strides=converted)
        model.__dict__[STATE] = state
    state.outputs[key] = outputs
    _root_forward(model, state)
    for path, boundary in steering.boundaries:
        module = model.get_submodule(path) if path else model
        forward = steered(module)
        if forward is None:
            forward = SteeredForward(module, state, module.__dict__.get("forward"))
            module.__dict__["forward"] = forward
        forward.boundaries[key] = boundary
    carry_steering(model)
    return state


def _root_forward(model: nn.Module, state: PlannedState) -> None:
    forward = steered(model)
    if isinstance(forward, RootForward):
        return
    root = RootForward(model, state, forward.inner if forward is not None else
                       model.__dict__.get("forward"))
    if forward is not None:
        root.boundaries.update(forward.boundaries)
    model.__dict__["forward"] = root


def convert_parameters(model: nn.Module, parameters: tuple[tuple[str, Label], ...]
                       ) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each named parameter or buffer of ``model`` in its label's format, in place: the same
    ``nn.Parameter`` (an optimizer holding it keeps it), its gradient too; a tensor several
    names share is converted once. Returns the name and former strides of each one whose
    strides changed."""
    seen: set[int] = set()
    changed = []
    for name, label in parameters:
        owner_path, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        t = owner._parameters.get(attr) if attr in owner._parameters else owner._buffers.get(attr)
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        fmt = Label(label).format(t.dim())
        with torch.no_grad():
            new = to_format(t.detach(), fmt)
            if new.stride() != t.stride():
                changed.append((name, tuple(t.stride())))
                t.data = new
            if isinstance(t, nn.Parameter) and t.grad is not None:
                t.grad = to_format(t.grad, fmt)
    return tuple(changed)


def planned_state(model: nn.Module) -> PlannedState | None:
    """The :class:`PlannedState` of a planned model, ``None`` for any other module."""
    state = model.__dict__.get(STATE)
    return state if isinstance(state, PlannedState) else None


def plan_of(model: nn.Module) -> Any:
    """The plan of a planned model (``memlayout.optimize``, ``memlayout.apply``,
    ``memlayout.compile``), ``None`` for any other module.

    >>> plan_of(nn.Linear(2, 2)) is None
    True
    """
    state = planned_state(model)
    return state.plan if state is not None else None


def prepare_inputs(model: nn.Module, *args: Any) -> tuple[Any, ...]:
    """``args`` as a planned model's plan takes them (``plan.input_format``), converted once
    here so that the calls that follow convert nothing: what a data pipeline (or a
    benchmark) does before its loop. ``args`` unchanged for a model with no plan, or a plan
    that takes inputs as they come."""
    state = planned_state(model)
    return state.prepare_inputs(*args) if state is not None else args


def unsteer(model: nn.Module) -> nn.Module:
    """``model`` with every boundary taken off and its planned state dropped, in place (the
    parameters keep their formats): the user's own code, as an analysis copy must run it."""
    for module in model.modules():
        forward = steered(module)
        if forward is not None:
            if forward.inner is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = forward.inner
    model.__dict__.pop(STATE, None)
    return model


# ---------------------------------------------------------------- torch.fx GraphModules


def carry_steering(model: nn.Module) -> None:
    """Every ``torch.fx.GraphModule`` in ``model`` (a traced model, or one inside a model)
    pickled (``torch.save``) and deep-copied with the attributes in :data:`CARRIED`; in place.

    torch pickles a GraphModule as its generated code and rebuilds it by tracing that code:
    the rebuilt module keeps the instance attributes that do not shadow its class's (a steered
    ``forward`` does); ``copy.deepcopy`` keeps those the graph reads (the planned state does
    not). On torch 2.10 to 2.12 (2.13 not run) the code of a model written under ``from
    __future__ import annotations`` does not pickle at all: an annotation is a ``str`` global
    of the generated code (``_torch_Tensor_ = 'torch.Tensor'``), which torch looks up as an
    importable name. So the class ``GraphModule.__new__`` made for each such instance alone
    gets a ``__reduce__`` that writes those globals as assignments and a ``__deepcopy__``,
    both carrying the attributes across; torch's own loader rebuilds the module. A
    GraphModule whose class other instances share is left as torch pickles it.

    >>> import pickle
    >>> gm = fx.symbolic_trace(nn.Conv2d(3, 4, 1))
    >>> gm.__dict__["plan"] = "the plan"
    >>> carry_steering(gm)
    >>> pickle.loads(pickle.dumps(gm)).plan, copy.deepcopy(gm).plan
    ('the plan', 'the plan')
    """
    for module in model.modules():
        cls = type(module)
        if isinstance(module, fx.GraphModule) and \
                cls.__qualname__.rpartition(".")[2] == "GraphModuleImpl":
            cls.__reduce__ = _reduce_graph_module  # type: ignore[method-assign]
            cls.__deepcopy__ = _deepcopy_graph_module  # type: ignore[attr-defined]


def _reduce_graph_module(gm: fx.GraphModule) -> tuple[Any, ...]:
    body = gm.__dict__.copy()
    code = fx.GraphModule.recompile(gm)  # a lazy GraphModule's own recompile only marks it
    del body["_graph"]  # the code is kept, and traced again on load
    carried = {k: body.pop(k) for k in CARRIED if k in body}
    # set as the state, after the module exists: a steered forward refers to the rebuilt one
    return _rebuilt_graph_module, (body, _import_block(code.globals)), carried or None


def _rebuilt_graph_module(body: dict[str, Any], import_block: str) -> fx.GraphModule:
    gm = reduce_graph_module(body, import_block)
    carry_steering(gm)
    return gm


def _deepcopy_graph_module(gm: fx.GraphModule, memo: dict[int, Any]) -> fx.GraphModule:
    copied = super(type(gm), gm).__deepcopy__(memo)  # type: ignore[misc]
    for k in CARRIED:
        if k in gm.__dict__:
            copied.__dict__[k] = copy.deepcopy(gm.__dict__[k], memo)
    carry_steering(copied)
    return copied


def _import_block(names: dict[str, Any]) -> str:
    """The imports of generated code's globals as torch writes them, and its ``str`` globals
    (forward-reference annotations) as assignments."""
    imports = _format_import_block({k: v for k, v in names.items() if not isinstance(v, str)},
                                   sys_importer)
    assigned = sorted(f"{k} = {v!r}" for k, v in names.items() if isinstance(v, str))
    return "\n".join([imports, *assigned])
