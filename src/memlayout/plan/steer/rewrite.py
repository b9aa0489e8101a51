"""Rewrite (L2 plan, step 4): apply a solved labelling to a copy of the model.

Conversions (``convert_value``: ``to_format`` on each rank-4/5 tensor; ``convert_value_1d``
for a value with rank-3 tensors of a 1-d convolution model) are inserted only where
a value's format differs from what a consumer was planned for, one per value and target format
however many consumers it serves. Convolution weights (and rank-4/5 attributes used by planned
nodes) are converted once, here, never per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from memlayout import layout
from memlayout.plan.convert import convert_value, convert_value_1d
from memlayout.plan.costs.table import module_has_layout_params
from memlayout.plan.graph import META_KEY, Label, graph_ranks
from memlayout.plan.solve.formulate import OUTPUT_PREFIX, Formulation


class PlannedGraph:
    """A module whose ``forward`` is a rewritten graph: the original module itself (the
    planning copy), its class swapped for a subclass of its own class with this ``forward``.
    Every attribute, method, property and child of the original stays as it was (a
    ``config``, ``dtype``, ``encoder.output_stride`` a parent's forward reads), and so do the
    ``state_dict`` keys. Make one with :func:`planned_graph`.

    >>> from torch import nn
    >>> conv = nn.Conv2d(3, 4, 1)
    >>> planned = planned_graph(conv, fx.symbolic_trace(conv))
    >>> isinstance(planned, nn.Conv2d), planned.in_channels, list(planned.state_dict())
    (True, 3, ['weight', 'bias'])
    """

    @property
    def graph(self) -> fx.Graph:
        return self.__dict__[_GRAPH_KEY].graph

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.__dict__[_GRAPH_KEY]).forward(self, *args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # the planned class is made at run time, so pickle cannot find it by name: it is
        # rebuilt from the original class (``torch.save`` of the module, ``copy.deepcopy``)
        original = type(self).__bases__[1]
        return _planned_instance, (original,), dict(self.__dict__)


_GRAPH_KEY = "_memlayout_graph_module"
_PLANNED_CLASSES: dict[type, type] = {}  # original class -> its planned subclass (a cache)


def _planned_class(cls: type) -> type:
    if cls not in _PLANNED_CLASSES:
        _PLANNED_CLASSES[cls] = type(f"Planned{cls.__name__}", (PlannedGraph, cls),
                                     {"__module__": cls.__module__})
    return _PLANNED_CLASSES[cls]


def _planned_instance(original: type) -> nn.Module:
    cls = _planned_class(original)
    return cls.__new__(cls)


def planned_graph(root: nn.Module, gm: fx.GraphModule) -> nn.Module:
    """``root`` running ``gm``'s code as its ``forward`` (see :class:`PlannedGraph`); ``gm``
    must be a graph over ``root`` (its targets resolve on ``root``)."""
    if not isinstance(root, PlannedGraph):
        root.__class__ = _planned_class(type(root))
    for n in gm.graph.nodes:  # tensor constants the capture put on the graph module only
        if n.op == "get_attr" and "." not in n.target and not hasattr(root, n.target):
            setattr(root, n.target, getattr(gm, n.target))
    for spec in ("_in_spec", "_out_spec"):  # an exported graph's argument structure
        if spec in gm.__dict__:
            root.__dict__[spec] = gm.__dict__[spec]
    root.__dict__[_GRAPH_KEY] = gm  # not a child: its modules are the root's own
    return root


def rewrite(root: nn.Module, gm: fx.GraphModule, form: Formulation, labels: Mapping[str, Label],
            weights: dict[int, torch.Tensor] | None = None,
            ) -> tuple[nn.Module, list[tuple[str, int, tuple[str, ...]]]]:
    """Insert conversions into ``gm`` (traced from ``root``; both are modified: pass copies)
    and convert weights. Returns the planned module and the conversions made
    ``(value, to label, consumers served)``. The layout ranks are the captured graph's; the
    conversions inserted carry them, so the planned forward depends on nothing else.
    ``weights`` (a tensor's id -> its converted tensor, one dict for every region of a
    model): a tensor several modules share (tied weights) is converted once, one tensor."""
    ranks = graph_ranks(gm)
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    made: list[tuple[str, int, tuple[str, ...]]] = []
    weights = {} if weights is None else weights
    output = next(n for n in graph.nodes if n.op == "output")
    for value, users in form.consumers.items():
        producer = form.producers[value]
        out = labels[producer] if isinstance(producer, str) else producer
        node = nodes[value]
        for target in (0, 1):
            served = [u for u in users if labels[u] == target and target != out]
            if not served:
                continue
            user_nodes = [output if u.startswith(OUTPUT_PREFIX) else nodes[u] for u in served]
            first = min(user_nodes, key=order.__getitem__)
            args = (node, target) if _has_rank3(node) else (node, target, ranks)
            convert = convert_value_1d if _has_rank3(node) else convert_value
            with graph.inserting_before(first):
                converted = graph.call_function(convert, args)
            for u in user_nodes:
                u.replace_input_with(node, converted)
            made.append((value, target, tuple(served)))
    for n in graph.nodes:
        if n.name not in labels:
            continue
        if n.op == "call_module" and module_has_layout_params(gm, n):
            _convert_tensors(root.get_submodule(n.target), labels[n.name], ranks, weights)
        for m in n.all_input_nodes:
            if m.op == "get_attr":
                _convert_attr(root, m.target, labels[n.name], ranks, weights)
    graph.lint()
    gm.recompile()
    return planned_graph(root, gm), made




def _quiet_dynamo_about_layout_caches() -> None:
    """The conversions a plan inserts call the layout algebra's ``lru_cache``d stride rules
    (pure functions of shapes); dynamo traces through them and warns that the cache is
    ignored. Declare them safe where this torch has the (private) registry: no warning."""
    try:
        from torch._dynamo.utils import (  # type: ignore[attr-defined]
            allow_lru_cache_wrapper_trace_without_warning as allow,
        )
    except ImportError:  # older torch: no such registry, the warning stays (harmless)
        return
    for value in vars(layout).values():
        if hasattr(value, "cache_info") and hasattr(value, "__wrapped__"):
            allow(value)


_quiet_dynamo_about_layout_caches()


def _has_rank3(node: fx.Node) -> bool:
    meta = node.meta.get(META_KEY)
    return meta is not None and any(len(t.shape) == 3 for t in meta.layout_tensors)


def _convert_tensors(module: nn.Module, label: Label, ranks: tuple[int, ...],
                     converted: dict[int, torch.Tensor]) -> None:
    """``module``'s own parameters and buffers of the layout ``ranks`` in ``label``'s format,
    as new tensors (the originals may be shared with the unplanned copy)."""
    for name in [*module._parameters, *module._buffers]:
        _convert_attr(module, name, label, ranks, converted)


def _convert_attr(root: nn.Module, target: str, label: Label, ranks: tuple[int, ...],
                  converted: dict[int, torch.Tensor]) -> None:
    owner_path, _, name = target.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    value = getattr(owner, name, None)
    if not isinstance(value, torch.Tensor) or value.dim() not in ranks:
        return
    new = converted.get(id(value))
    if new is None:
        # a shared tensor keeps the format its first user wanted: the min cut ties the users
        # of one tensor, so they differ only where a format fails for one of them
        new = convert_value(value.detach(), label, ranks)
        if new is value.detach() or new.stride() == value.stride():
            return
        if isinstance(value, nn.Parameter):
            new = nn.Parameter(new, requires_grad=value.requires_grad)
        converted[id(value)] = new
    if isinstance(value, nn.Parameter):
        owner._parameters[name] = new
    elif name in owner._buffers:
        owner._buffers[name] = new
    else:
        setattr(owner, name, new)
