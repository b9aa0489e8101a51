"""Which rank-3/4/5 values are image-like (L1): the planner's layout variables, the audit's drops.

A value is *spatial* when it feeds or comes from a spatial op (convolution, pooling, spatial
normalization, padding, resampling) or is joined to one by element-wise ops (activations,
residual adds, concatenation). Attention scores and token tensors of rank 4 (batch, heads,
tokens, dim) are not: their "channels" are no channels, and NCHW vs channels-last means
nothing for a matmul. ``mark_spatial`` clears the label (``ValueMeta.label = None``) of every
other value, so no later step sees it as a layout choice. The audit asks the same question
of aten ops through :func:`is_spatial_name`.

>>> is_spatial_name("aten.convolution"), is_spatial_name("aten.bmm")
(True, False)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch import fx, nn

#: fragments of op / module names that make a value spatial (lower case)
SPATIAL_FRAGMENTS = ("conv", "pool", "batch_norm", "batchnorm", "group_norm", "groupnorm",
                     "instance_norm", "instancenorm", "upsample", "interpolate", "pad",
                     "pixel_shuffle", "pixel_unshuffle", "grid_sampler", "grid_sample",
                     "local_response_norm", "localresponsenorm")
#: element-wise / joining ops (by name) that carry spatial-ness between values
PASS_NAMES = frozenset({
    "add", "add_", "iadd", "sub", "sub_", "isub", "mul", "mul_", "imul", "div", "div_",
    "truediv", "itruediv", "neg", "relu", "relu_", "relu6", "silu", "silu_", "gelu", "sigmoid",
    "sigmoid_", "tanh", "tanh_", "hardswish", "hardswish_", "hardsigmoid", "hardtanh",
    "hardtanh_", "leaky_relu", "leaky_relu_", "elu", "elu_", "mish", "softplus", "clamp",
    "clamp_", "dropout", "dropout_", "native_dropout", "feature_dropout", "alpha_dropout",
    "clone", "contiguous", "to", "_to_copy", "type_as", "float", "half", "bfloat16", "cat",
    "concat", "concatenate", "getitem", "chunk", "split", "split_with_sizes", "detach",
    "alias", "identity", "lift_fresh_copy", "where", "maximum", "minimum", "abs", "exp",
    "pow", "sqrt", "rsqrt", "square", "erf",
})
_PASS_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid,
    nn.Tanh, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus, nn.Identity, nn.Dropout, nn.Dropout2d,
    nn.Dropout3d, nn.AlphaDropout,
)
_OPERATORS = {operator.add: "add", operator.iadd: "add", operator.sub: "sub",
              operator.mul: "mul", operator.imul: "mul", operator.truediv: "div",
              operator.neg: "neg", operator.getitem: "getitem"}


def is_spatial_name(name: str) -> bool:
    """Whether an op or module called ``name`` works on spatial values (by name fragment).

    >>> [is_spatial_name(n) for n in ("Conv3d", "aten.max_pool2d", "F.pad", "aten.softmax")]
    [True, True, True, False]
    """
    low = name.lower()
    return any(f in low for f in SPATIAL_FRAGMENTS)


def _name(root: nn.Module, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(root.get_submodule(str(n.target))).__name__
    if n.op == "call_method":
        return str(n.target)
    target = n.target
    if target in _OPERATORS:
        return _OPERATORS[target]
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def _wrapped(root: nn.Module, n: fx.Node) -> list[fx.GraphModule]:
    """Graphs a node runs (a kept grad-mode / autocast region, a leaf module's children)."""
    found = []
    for m in n.all_input_nodes:
        if m.op == "get_attr":
            value = getattr(root, str(m.target), None)
            if isinstance(value, fx.GraphModule):
                found.append(value)
    return found


def is_spatial_op(root: nn.Module, n: fx.Node) -> bool:
    """A convolution, pooling, spatial normalization, padding or resampling node (or a module
    or kept region that holds one)."""
    if n.op not in ("call_module", "call_function", "call_method"):
        return False
    if is_spatial_name(_name(root, n)):
        return True
    if n.op == "call_module":
        sub = root.get_submodule(str(n.target))
        return any(is_spatial_name(type(m).__name__) for m in sub.modules())
    return any(is_spatial_op(g, m) for g in _wrapped(root, n) for m in g.graph.nodes)


def is_passthrough(root: nn.Module, n: fx.Node) -> bool:
    """An element-wise or joining op: its layout inputs and output are alike spatial or not."""
    if n.op == "call_module":
        return isinstance(root.get_submodule(str(n.target)), _PASS_MODULES)
    if (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.pointwise in n.target.tags):
        return True
    return n.op in ("call_function", "call_method") and _name(root, n) in PASS_NAMES


def spatial_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` whose values are spatial (see the module docstring)."""
    spatial: set[fx.Node] = set()
    passing: list[fx.Node] = []
    for n in gm.graph.nodes:
        if is_spatial_op(gm, n):
            spatial.add(n)
            spatial.update(n.all_input_nodes)
        elif is_passthrough(gm, n):
            passing.append(n)
    changed = True
    while changed:  # to a fixed point: a residual add between two convolutions, a chain
        changed = False
        for n in passing:
            group = [n, *n.all_input_nodes]
            if any(m in spatial for m in group) and not all(m in spatial for m in group):
                spatial.update(group)
                changed = True
    return spatial


def mark_spatial(gm: fx.GraphModule, key: str = "memlayout") -> None:
    """Clear the layout label of every non-spatial value in ``gm``'s meta (``key``)."""
    spatial = spatial_nodes(gm)
    for n in gm.graph.nodes:
        meta: Any = n.meta.get(key)
        if meta is not None and meta.label is not None and n not in spatial:
            n.meta[key] = dataclasses.replace(meta, label=None)
