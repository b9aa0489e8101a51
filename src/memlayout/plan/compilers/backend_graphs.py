"""What the backend reads off a Dynamo graph (L2 plan, compilers): real inputs for its
example ones, whether its sizes are symbolic, its convolutions' integer arguments made
constants, copies of it, the names and module paths of its nodes, the values written in
place that a conversion would lose, the module state it must not plan, and the parameters
whose gradients it hands back in their own strides (``memlayout.plan.compilers.backend``)."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
import torch._dynamo.exc
from torch import fx

from memlayout.errors import MemlayoutError
from memlayout.layout import strides_agree
from memlayout.plan.check.semantics import mutates_in_place
from memlayout.plan.graph import META_KEY

VIEWS = frozenset({"getitem", "view", "reshape", "narrow", "select", "slice", "permute",
                    "transpose", "unsqueeze", "squeeze", "expand", "as_strided", "unbind",
                    "split", "chunk", "t", "diagonal", "flatten", "unflatten", "detach",
                    "alias", "view_as", "expand_as", "movedim", "swapaxes"})

#: the convolutions of a Dynamo graph, by ``op_name``
CONVOLUTIONS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                          "conv_transpose3d", "convolution", "_convolution"})


def real_inputs(example_inputs: list[Any]) -> list[Any]:
    """Dynamo's example inputs as real values: a real tensor as it is (copied before every
    use), a fake one made from its metadata (normal values; integers zero), a size its hint.

    >>> real_inputs([torch.ones(2), 3])
    [tensor([1., 1.]), 3]
    """
    from torch._subclasses.fake_tensor import is_fake

    out: list[Any] = []
    for x in example_inputs:
        if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
            hint = x.node.hint
            if hint is None:
                raise NotPlanned(f"the size {x} has no example value (data-dependent)")
            out.append(hint)
        elif isinstance(x, torch.Tensor) and is_fake(x):
            shape, strides = [_hint(s) for s in x.shape], [_hint(s) for s in x.stride()]
            t = torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
            t = t.normal_() if t.is_floating_point() else t.zero_()
            out.append(t.requires_grad_(x.requires_grad))
        else:
            out.append(x)
    return out


def is_dynamic(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` was traced with symbolic sizes (``dynamic=True``, ``mark_dynamic``)."""
    from torch.fx.experimental.symbolic_shapes import has_free_symbols

    for n in gm.graph.nodes:
        value = n.meta.get("example_value") if n.op == "placeholder" else None
        if isinstance(value, torch.Tensor | torch.SymInt) and has_free_symbols(value):
            return True
    return False


def fix_convolution_arguments(gm: fx.GraphModule) -> int:
    """Guard each symbolic integer a convolution of ``gm`` takes besides its tensors (stride,
    padding, dilation, groups) to its example value, in Dynamo's shape env; how many.

    Blocks of one class with different strides share one ``forward``: Dynamo's recompile for
    the second stride passes it as a symbolic integer (under FSDP2, automatic dynamic
    shapes). Inductor makes it a constant as it lowers the convolution (its kernels take
    constants), but only after AOTAutograd has traced the graph with it symbolic, and what
    that trace derived from it then fails to lower (a training batch norm's ``1 / count``,
    the count otherwise static: ``TypeError: Cannot convert expression to float``). Guarded
    first, these integers are constants for planning and compiling alike; Dynamo recompiles
    for another value, as it would after Inductor's own guard."""
    from torch.fx.experimental.symbolic_shapes import guard_int, has_free_symbols

    fixed = 0

    def fix(a: fx.Node) -> fx.Node:
        nonlocal fixed
        value = a.meta.get("example_value")
        # a data-dependent one has no example value: left to Inductor
        if isinstance(value, torch.SymInt) and has_free_symbols(value) and value.node.has_hint():
            guard_int(value)
            fixed += 1
        return a

    for n in gm.graph.nodes:
        if n.op == "call_function" and op_name(n) in CONVOLUTIONS:
            fx.node.map_arg((n.args[2:], n.kwargs), fix)  # after the input and the weight
    return fixed


def _hint(size: Any) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def fresh_inputs(inputs: list[Any]) -> list[Any]:
    """Copies of the tensors in ``inputs`` (same strides, same ``requires_grad``, leaves)."""
    return [x.detach().clone().requires_grad_(x.requires_grad)
            if isinstance(x, torch.Tensor) else x for x in inputs]


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` over the same attributes (its own graph and node meta)."""
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copied = fx.GraphModule(gm, graph)
    copied.meta = dict(getattr(gm, "meta", {}))
    return copied


def op_name(n: fx.Node) -> str:
    """The bare name of what ``n`` calls: ``conv2d``, ``dropout``, ``relu_``."""
    if n.op == "call_method":
        return str(n.target)
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def module_path(n: fx.Node) -> str:
    """The module path ``n`` ran in (``layer1.0.conv1``), else its node name."""
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return n.name
    return source_path(str(list(stack.values())[-1][0])) or n.name


def input_name(n: fx.Node) -> str:
    """What a graph input is in the user's model (``layer1.0.conv1.weight``), from the
    source Dynamo recorded for it; else its node name."""
    source = _source_name(n)
    return (source_path(source) if source is not None else "") or n.name


def _source_name(n: fx.Node) -> str | None:
    """The name of the source Dynamo recorded for a placeholder (``L['self']._modules...``)."""
    name = getattr(getattr(n.meta.get("grapharg"), "source", None), "name", None)
    return name if isinstance(name, str) else None


def fsdp_managed(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` reads a module that FSDP2's ``fully_shard`` manages (Dynamo gives such
    a module's attributes an FSDP source: ``torch._dynamo.config.skip_fsdp_guards``, on by
    default). Every rank runs such a graph, in the same order: FSDP's collectives need it."""
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        where = getattr(n.meta.get("grapharg"), "source", None)
        kind = getattr(where, "guard_source", None)
        kind = kind() if callable(kind) else kind  # a method on older torch
        if getattr(kind, "is_fsdp_module", lambda: False)():
            return True
    return False


def source_path(source: str) -> str:
    """A Dynamo source as a dotted path: the frame's local and the module containers dropped.

    >>> source_path("L['self']._modules['layer1']._modules['0']._parameters['weight']")
    'layer1.0.weight'
    >>> source_path("L['self'].__dict__['_modules']['down'][2].conv1")
    'down.2.conv1'
    """
    path = re.sub(r"^L\['[^']*'\]", "", source)
    path = re.sub(r"\.?(?:__dict__\['_(?:modules|parameters|buffers)'\]"
                  r"|(?:__dict__\.)?_(?:modules|parameters|buffers)(?=\[))", "", path)
    path = path.replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    return path.strip(".")


def converted_weights(gm: fx.GraphModule, inputs: list[Any],
                      converted: list[str]) -> tuple[tuple[str, int], ...]:
    """``(name, bytes)`` of each parameter among the graph inputs named in ``converted`` (the
    values a plan converts): a weight stored in another format than the plan runs it in,
    converted on every call (in training its gradient back too)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = set(converted)
    out: dict[str, int] = {}
    for n, value in zip(placeholders, inputs, strict=False):
        if n.name in names and is_parameter(n, value):
            out[input_name(n)] = value.numel() * value.element_size()
    return tuple(sorted(out.items()))


def is_parameter(n: fx.Node, value: Any) -> bool:
    """Whether the graph input ``n`` (its example ``value``) is one of the model's parameters
    (Dynamo lifts them; a split graph of DDP's optimizer gets them as fake tensors)."""
    return isinstance(value, torch.Tensor) and (
        isinstance(value, torch.nn.Parameter) or "_parameters" in (_source_name(n) or ""))


class _GradInStrides(torch.autograd.Function):
    """The identity, whose backward hands the gradient on in the input's own strides."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        ctx.size, ctx.strides = tuple(t.shape), tuple(t.stride())
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad is None or tuple(grad.stride()) == ctx.strides:
            return grad
        if strides_agree(ctx.size, tuple(grad.stride()), ctx.strides):  # size-1 dims only: a view
            return grad.as_strided(ctx.size, ctx.strides, grad.storage_offset())
        return torch.empty_strided(ctx.size, ctx.strides, dtype=grad.dtype,
                                   device=grad.device).copy_(grad)


def grad_in_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a view), whose gradient comes back in ``t``'s exact strides, a size-1 dim's
    included: a view of the gradient where only those differ, else a copy.

    >>> w = torch.ones(4, 2, 1, 1, requires_grad=True)  # strides (2, 1, 1, 1)
    >>> x = torch.ones(1, 2, 3, 3).to(memory_format=torch.channels_last)
    >>> torch.nn.functional.conv2d(x, grad_in_strides(w)).sum().backward()
    >>> w.grad.stride()
    (2, 1, 1, 1)
    """
    return _GradInStrides.apply(t)


def grads_in_parameter_strides(gm: fx.GraphModule, inputs: list[Any]) -> int:
    """Route each parameter among ``gm``'s inputs that needs a gradient and has a size-1 dim
    (a 1x1 convolution's weight) through :func:`grad_in_strides`, in place; the count.

    Autograd's gradient layout contract ignores a size-1 dim's stride, so a convolution run
    channels-last hands such a weight a gradient strided ``(C, 1, C, C)`` for a parameter
    strided ``(C, 1, 1, 1)``, and ``.grad`` keeps it; DDP compares all strides with its
    bucket views ("Grad strides do not match bucket view strides") and copies. Other
    gradients in another layout than their parameter's are copied into its strides by
    autograd itself (and a weight the plan converts has its gradient converted back)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    chosen = [n for n, value in zip(placeholders, inputs, strict=False)
              if is_parameter(n, value) and value.requires_grad and value.dim() >= 2
              and value.numel() > 1 and 1 in tuple(value.shape) and n.users]
    if not chosen:
        return 0
    with gm.graph.inserting_after(placeholders[-1]):
        for n in chosen:
            users = list(n.users)
            routed = gm.graph.call_function(grad_in_strides, (n,))
            for user in users:
                user.replace_input_with(n, routed)
    gm.recompile()
    return len(chosen)


class NotPlanned(MemlayoutError):
    """Why a graph is compiled without a plan (a fact about the graph, not a failure)."""


def mutated_aliases(gm: fx.GraphModule) -> set[fx.Node]:
    """Values a node writes into in place (directly or through a view) that someone else
    reads, or that are graph inputs, with their views. Dynamo's graphs are not functional:
    a conversion is a copy, and a write into a converted copy would not reach the other
    readers (``batched = x.new_zeros(...); batched[..., :h, :w].copy_(x)``, then ``batched``
    read by a convolution and returned)."""
    def writes(n: fx.Node) -> bool:
        return mutates_in_place(gm, n) or (n.op == "call_function" and op_name(n) == "setitem")

    def is_view(n: fx.Node) -> bool:
        return (n.op in ("call_function", "call_method") and op_name(n) in VIEWS
                and bool(n.args) and isinstance(n.args[0], fx.Node))

    protected: set[fx.Node] = set()
    for m in gm.graph.nodes:
        target = m.args[0] if m.args and m.op in ("call_function", "call_method") else None
        if not isinstance(target, fx.Node) or not writes(m):
            continue
        root = target
        while is_view(root):
            root = root.args[0]
        family, todo = {root}, [root]
        while todo:  # every view of the written tensor, transitively
            for u in todo.pop().users:
                if is_view(u) and u not in family:
                    family.add(u)
                    todo.append(u)
        readers = {u for a in family for u in a.users} - family - {m}
        if readers or root.op == "placeholder":
            protected |= family
    return protected


def refuse_module_state(gm: fx.GraphModule, ranks: tuple[int, ...]) -> None:
    """A graph that reads layout tensors as module attributes (``call_module``, ``get_attr``;
    Dynamo with ``inline_inbuilt_nn_modules`` off) is not planned: rewriting converts such
    tensors in place, and they are the user's."""
    for n in gm.graph.nodes:
        meta = n.meta.get(META_KEY)
        if n.op == "call_module" and any(
                p.dim() in ranks for p in gm.get_submodule(str(n.target)).parameters()):
            raise NotPlanned(f"{n.target} is called as a module, its weights are not graph "
                              "inputs (torch._dynamo.config.inline_inbuilt_nn_modules=True "
                              "lifts them)")
        if n.op == "get_attr" and meta is not None and meta.label is not None:
            raise NotPlanned(f"{n.target} is an image-like tensor held by the graph itself")


def graph_id(gm: fx.GraphModule) -> str:
    """Dynamo's compile id of ``gm`` (``frame/recompile``)."""
    return str(gm.meta.get("dynamo_compile_id", "?"))


def training(inputs: list[Any]) -> bool:
    """A graph is compiled for training when grad mode is on and an input requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
