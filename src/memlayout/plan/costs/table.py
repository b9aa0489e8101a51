"""What the costs of a graph are (L2 plan, costs): the records a measurement makes (a layout
node's seconds in each label and its output's label, a conversion's seconds), which nodes are
layout nodes, which run the same kernel in either format, and what a cached record must hold
(``memlayout.plan.costs.measure`` takes them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from memlayout.devices import seam
from memlayout.plan.graph import (
    LABELS,
    META_KEY,
    Label,
    ValueMeta,
    graph_ranks,
)

# Ops whose kernel does the same work in either format: not timed, only run to see the format
# of their output. Binary ops among them get their inputs in one format (a mismatch is a
# conversion, costed as such).
_AGNOSTIC_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh,
    nn.LeakyReLU, nn.ELU, nn.Mish, nn.Identity, nn.Dropout, nn.Dropout2d, nn.Dropout3d,
)
_AGNOSTIC_FUNCTIONS: frozenset[Any] = frozenset({
    operator.add, operator.iadd, operator.mul, operator.imul, operator.sub, operator.truediv,
    operator.getitem, torch.add, torch.mul, torch.sub, torch.relu, torch.sigmoid, torch.tanh,
    torch.nn.functional.relu, torch.nn.functional.relu6, torch.nn.functional.silu,
    torch.nn.functional.gelu, torch.nn.functional.hardswish, torch.nn.functional.hardsigmoid,
    torch.nn.functional.sigmoid, torch.nn.functional.dropout, torch.nn.functional.mish,
})
_AGNOSTIC_METHODS: frozenset[str] = frozenset({
    "relu", "relu_", "add", "add_", "mul", "mul_", "sub", "sub_", "div", "div_", "sigmoid",
    "sigmoid_", "tanh", "clamp", "clamp_",
})


@dataclass(frozen=True)
class NodeCost:
    """One layout node: seconds in label 0 / 1 (``None``: fails in that format), the label of
    its output when run in each (a ``Label``, ``None``: no layout tensor), and whether
    the seconds were timed (``False``: agnostic op, or the analytical model). ``weights``:
    with contiguous weights, how the channels-last run reads them (``AS_IS`` or ``PER_CALL``,
    the faster; ``None``: no weights, or weights converted once)."""

    name: str
    op: str
    seconds: tuple[float | None, float | None]
    out: tuple[Label | None, Label | None]
    timed: bool
    noisy: bool = False  # measured on a busy machine, or its rounds spread too far
    weights: str | None = None


@dataclass(frozen=True)
class ConversionCost:
    value: str
    to_1: float
    to_0: float
    nbytes: int
    shapes: tuple[tuple[int, ...], ...]
    timed: bool = True  # ``False``: the analytical model
    noisy: bool = False


@dataclass
class CostTable:
    nodes: dict[str, NodeCost] = field(default_factory=dict)
    conversions: dict[str, ConversionCost] = field(default_factory=dict)
    measured: int = 0  # timings taken in this call
    cached: int = 0  # records read from the cache
    #: nodes whose seconds are predicted (``memlayout.plan.costs.predict``), not measured:
    #: how far their ``c1 - c0`` may be off (seconds)
    predicted: dict[str, float] = field(default_factory=dict)
    #: nodes never run channels-last, and why (``memlayout.plan.costs.faults``)
    faults: dict[str, str] = field(default_factory=dict)
    #: nodes timed in this call (not read from the cache, nor kept from an earlier pass)
    fresh: set[str] = field(default_factory=set)

    @property
    def timed_costs(self) -> int:
        """Timed node costs and conversions (agnostic and analytical ones excluded)."""
        return (sum(n.timed for n in self.nodes.values())
                + sum(c.timed for c in self.conversions.values()))

    @property
    def noisy_costs(self) -> int:
        """Of ``timed_costs``, those measured on a busy machine or with rounds spread too far."""
        return (sum(n.noisy for n in self.nodes.values())
                + sum(c.noisy for c in self.conversions.values()))


def input_kind(gm: fx.GraphModule, m: fx.Node) -> str | None:
    """How a node's input ``m`` is handled: ``"param"`` (a rank-4/5 attribute, converted once
    when the plan is applied), ``"term"`` (a value in one definite format: converted per plan),
    ``"asis"`` (ambiguous or in no format: passed unchanged), ``None`` (no layout tensor)."""
    meta: ValueMeta | None = m.meta.get(META_KEY)
    if meta is None or meta.label is None:
        return None
    if m.op == "get_attr":
        return "param"
    if meta.label not in LABELS:
        return "asis"
    return "term"


def module_has_layout_params(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op != "call_module":
        return False
    sub = gm.get_submodule(str(n.target))
    ranks = graph_ranks(gm)
    return any(t.dim() in ranks for t in [*sub.parameters(), *sub.buffers()])


def is_layout_node(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op not in ("call_module", "call_function", "call_method"):
        return False
    meta: ValueMeta | None = n.meta.get(META_KEY)
    if meta is None or not meta.tensors:
        return False  # .size(), .dim(): no tensor out, nothing to decide
    if module_has_layout_params(gm, n):
        return True
    return any(input_kind(gm, m) in ("term", "param") for m in n.all_input_nodes)


def is_agnostic(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(gm.get_submodule(str(n.target)), _AGNOSTIC_MODULES)
    if n.op == "call_function":
        return n.target in _AGNOSTIC_FUNCTIONS
    return n.op == "call_method" and n.target in _AGNOSTIC_METHODS


def measured_on(device: torch.device) -> str:
    """What a timing depends on, a cache key's first part: the device seam's fingerprint (the
    CPU's model, instruction set and threads; or the GPU, its CUDA and cuDNN versions and
    the settings that pick its kernels)."""
    return seam(device).fingerprint()


def valid_node_record(record: Any) -> bool:
    """A node's cached record as this code writes it: ``{"s": seconds or None, "out": label}``.

    >>> valid_node_record({"s": 0.1, "out": 1}), valid_node_record({"s": "fast"})
    (True, False)
    """
    return (isinstance(record, dict) and "out" in record and _seconds_or_none(record.get("s"))
            and (record["out"] is None or record["out"] in set(Label)))


def valid_conversion_record(record: Any) -> bool:
    """A conversion's cached record: ``{"s": seconds}``."""
    return isinstance(record, dict) and record.get("s") is not None and _seconds_or_none(record["s"])


def _seconds_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and value >= 0)
