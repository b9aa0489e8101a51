"""Graphs of what really runs (L2 plan, capture): ``torch.fx.symbolic_trace`` where it is
faithful, non-strict ``torch.export`` otherwise, and the count of convolution calls that
says how much of a model a plan covers.

Non-strict ``torch.export`` runs ``forward`` as Python on fake tensors: control flow on
shapes and configuration, ``nn.ModuleList`` loops, keyword arguments and attribute reads all
work, and the graph it returns (``ExportedProgram.module()``) reads parameters and buffers
by their original names (``get_attr`` of ``"down_blocks.0.resnets.0.conv1.weight"``), so a
rewritten graph runs on the original module tree. Grad-mode and autocast regions inside
``forward`` come back as wrapper nodes (``wrap_with_set_grad_enabled``,
``wrap_with_autocast``); they are kept, as calls of :func:`run_with_grad_mode` /
:func:`run_with_autocast`, which carry a key of the wrapped graph's code so that two
different regions never share a cost-cache entry.

>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
>>> gm = export_graph(net, (torch.randn(1, 3, 8, 8),), {})
>>> gm.meta[METHOD_KEY], count_convolutions(gm)
('torch.export', 1)
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from memlayout.errors import CaptureError

log = logging.getLogger(__name__)

METHOD_KEY = "memlayout_capture"  # GraphModule.meta key: how the graph was captured
FX = "torch.fx"
EXPORT = "torch.export"

# Convolution ops as they appear in a graph: fx (modules, functions) and aten (export).
_CONV_FUNCTIONS: frozenset[Any] = frozenset({
    torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
    torch.conv_transpose3d, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
    torch.nn.functional.conv3d, torch.nn.functional.conv_transpose1d,
    torch.nn.functional.conv_transpose2d, torch.nn.functional.conv_transpose3d,
})
_CONV_ATEN = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution",
                        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})


# ---------------------------------------------------------------- capture


def throwaway(module: nn.Module) -> nn.Module:
    """A copy of ``module`` to trace: its parameters shared (a trace only reads them), its
    buffers and attributes its own. Tracing runs ``forward`` as Python on Proxies or fake
    tensors, and what ``forward`` assigns stays on the module it ran on (an ultralytics
    ``Detect`` head stores the anchors it makes for a new input shape: fake tensors after
    ``torch.export``); nothing that traced a module is run eagerly again.

    >>> net = nn.BatchNorm2d(3)
    >>> copied = throwaway(net)
    >>> copied.weight is net.weight, copied.running_mean is net.running_mean
    (True, False)
    """
    return copy.deepcopy(module, {id(p): p for p in module.parameters()})



class _ModeTracer(fx.Tracer):
    """``fx.Tracer`` that notes the grad mode and autocast state each node was recorded in:
    fx runs a ``with torch.no_grad():`` block while tracing and records nothing of it."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: set[tuple[bool, ...]] = set()

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        self.modes.add(_modes())
        return super().create_node(*args, **kwargs)


def _modes() -> tuple[bool, ...]:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))


def faithful_trace(module: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace(module)``, refused (``CaptureError``) when the grad mode or
    autocast changes inside ``forward``: fx would drop the region and a training step would
    send gradients where the model sends none.

    >>> class Frozen(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)
    ...     def forward(self, x):
    ...         with torch.no_grad():
    ...             x = self.a(x)
    ...         return self.b(x)
    >>> faithful_trace(Frozen())
    Traceback (most recent call last):
    ...
    memlayout.errors.CaptureError: the grad mode or autocast changes inside forward ...
    """
    tracer = _ModeTracer()
    versions = {name: t._version for name, t in module.state_dict(keep_vars=True).items()
                if isinstance(t, torch.Tensor)}
    graph = tracer.trace(module)
    if len(tracer.modes) > 1:
        raise CaptureError("the grad mode or autocast changes inside forward (torch.no_grad, "
                           "enable_grad, inference_mode, autocast), which torch.fx does not "
                           "record")
    changed = [name for name, t in module.state_dict(keep_vars=True).items()
               if isinstance(t, torch.Tensor) and versions.get(name, t._version) != t._version]
    if changed:
        # fx hands buffers to forward as real tensors: an in-place update of one (a
        # BatchNorm's num_batches_tracked) ran once while tracing and is not in the graph
        raise CaptureError(f"forward updates {changed[0]} in place where torch.fx runs it "
                           "once while tracing instead of recording it")
    gm = fx.GraphModule(tracer.root, graph, type(module).__name__)
    gm.meta[METHOD_KEY] = FX
    return gm


def export_graph(module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> fx.GraphModule:
    """The graph of ``module(*args, **kwargs)`` by non-strict ``torch.export``, as a
    GraphModule over the original parameter names whose ``forward`` takes the original
    arguments (positional or by name) and returns the original output structure."""
    with _export_output(type(module).__name__):
        ep = torch.export.export(module, tuple(args), dict(kwargs), strict=False)
    gm = ep.module()
    gm._forward_pre_hooks.clear()  # export's input checks: a plan is per input signature
    _drop_guard_calls(gm)
    _drop_metadata_asserts(gm)
    _keep_wrappers(gm)
    _dropout_as_torch_functions(gm)
    gm.recompile()
    gm.meta[METHOD_KEY] = EXPORT
    return gm


class _ToDebugLog(logging.Filter):
    """Passes torch's own log records on to this module's debug log, not the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("torch"):
            return True  # a handler torch shares with others: their records pass
        if record.getMessage().strip():
            log.debug("%s logged: %s", record.name, record.getMessage())
        return False


def _torch_handlers() -> set[logging.Handler]:
    """The handlers torch's loggers write through (``torch._logging`` gives each its own
    stderr handler and stops propagation)."""
    loggers = [logging.getLogger("torch"), *(
        lg for name, lg in logging.root.manager.loggerDict.items()
        if name.startswith("torch.") and not name.startswith("torch.__trace")
        and isinstance(lg, logging.Logger))]  # (the trace artifacts' handler writes files)
    return {h for lg in loggers for h in lg.handlers}


@contextlib.contextmanager
def _export_output(name: str) -> Iterator[None]:
    """What ``torch.export`` writes while it runs goes to the debug log (``--debug``), not the
    terminal: on a failure it prints the partial graph's whole code to stderr (thousands of
    lines for a detection model) and logs warnings and the exportdb case; the failure itself
    is the exception, which capture states in one line. Its warnings too: that a tensor
    attribute was assigned during export (an ultralytics head's anchors) is about the
    throwaway copy it traced (:func:`throwaway`), nothing the user's model keeps."""
    printed = io.StringIO()
    quiet = _ToDebugLog()
    handlers = _torch_handlers()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        with contextlib.redirect_stderr(printed), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
        for w in warned:
            log.debug("torch.export warned while exporting %s: %s: %s", name,
                      w.category.__name__, w.message)
        if printed.getvalue().strip():
            log.debug("torch.export printed while exporting %s:\n%s", name, printed.getvalue())


def flat_inputs(gm: fx.GraphModule, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The values of ``gm``'s placeholders, in order, for a call with ``args``/``kwargs``."""
    if not kwargs:
        return tuple(args) if gm.meta.get(METHOD_KEY) == FX else tuple(pytree.tree_leaves(args))
    return tuple(pytree.tree_leaves((tuple(args), kwargs)))


def _drop_guard_calls(gm: fx.GraphModule) -> None:
    """Export's ``_guards_fn`` call checks the inputs against the exported ones; a plan is
    made (and checked) per input signature already."""
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and str(n.target).startswith("_guards_fn") and not n.users:
            gm.graph.erase_node(n)
            if hasattr(gm, str(n.target)):
                delattr(gm, str(n.target))


def _drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Export checks the dtype (and device) of a tensor where forward converts it
    (``x.to(dtype)``): as traced, in fp32. A plan runs the graph under autocast, where such a
    tensor may be bf16 (a diffusers UNet casts its time embedding to the sample's dtype):
    the check would fail where forward runs. The planned model is verified against the
    original's outputs instead; nested graphs too."""
    target = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    if target is None:  # an older torch exports no such check
        return
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in (target, getattr(target, "default", None)) \
                and not n.users:
            gm.graph.erase_node(n)
    for sub in gm.children():
        if isinstance(sub, fx.GraphModule):
            _drop_metadata_asserts(sub)
            sub.recompile()


def _keep_wrappers(gm: fx.GraphModule) -> None:
    """Grad-mode and autocast wrapper nodes as calls of our own wrappers (same semantics),
    which carry a key of the wrapped graph's code; nested graphs too."""
    hops = torch.ops.higher_order
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is getattr(hops, "wrap_with_set_grad_enabled", None):
            enabled, body, *rest = n.args
            n.target = run_with_grad_mode
            n.args = (_code_key(gm, body), enabled, body, *rest)
        elif n.target is getattr(hops, "wrap_with_autocast", None):
            device_type, dtype, enabled, cache, body, *rest = n.args
            n.target = run_with_autocast
            n.args = (_code_key(gm, body), device_type, dtype, enabled, cache, body, *rest)
    for sub in gm.children():
        if isinstance(sub, fx.GraphModule):
            _keep_wrappers(sub)
            sub.recompile()


#: aten dropouts and the torch functions of the same signature: a ``TorchFunctionMode`` sees
#: the latter (a training step is verified with masks drawn in logical order, see
#: ``memlayout.plan.check.training``), never the former
_DROPOUTS = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")


def _dropout_as_torch_functions(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        if (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                and n.target.namespace == "aten"
                and n.target.overloadpacket.__name__ in _DROPOUTS):
            n.target = getattr(torch, n.target.overloadpacket.__name__)
    for sub in gm.children():
        if isinstance(sub, fx.GraphModule):
            _dropout_as_torch_functions(sub)
            sub.recompile()


def _code_key(gm: fx.GraphModule, body: Any) -> str:
    sub = getattr(gm, str(body.target)) if isinstance(body, fx.Node) else body
    return hashlib.sha1(str(getattr(sub, "code", sub)).encode()).hexdigest()[:12]


def run_with_grad_mode(key: str, enabled: bool, body: nn.Module, *args: Any) -> Any:
    """``body(*args)`` with gradients enabled or not, as the model's ``forward`` ran it
    (``torch.no_grad()``, ``enable_grad()``); ``key`` names the body's code."""
    with torch.set_grad_enabled(enabled):
        return body(*args)


def run_with_autocast(key: str, device_type: str, dtype: torch.dtype | None, enabled: bool,
                      cache_enabled: bool | None, body: nn.Module, *args: Any) -> Any:
    """``body(*args)`` in the autocast region the model's ``forward`` opened."""
    with torch.autocast(device_type, dtype, enabled, cache_enabled):
        return body(*args)


# ---------------------------------------------------------------- counting convolutions


class ConvolutionCount(TorchDispatchMode):
    """Counts the convolution calls that really run (the one aten convolution op each call
    reaches a dispatch mode as), as a plan's coverage is stated against.

    >>> with ConvolutionCount() as c:
    ...     _ = nn.Conv2d(3, 4, 3)(torch.randn(1, 3, 8, 8))
    >>> c.calls
    1
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        # one aten op per convolution call reaches a mode: ``convolution`` as autograd
        # decomposes ``conv2d``; under ``torch.inference_mode`` the ``conv2d`` itself
        if func.overloadpacket.__name__ in _CONV_ATEN:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def is_convolution(root: nn.Module, n: fx.Node) -> bool:
    """Whether ``n`` (of a graph over ``root``) is one convolution call."""
    if n.op == "call_module":
        return isinstance(root.get_submodule(str(n.target)), nn.modules.conv._ConvNd)
    if n.op != "call_function":
        return False
    if n.target in _CONV_FUNCTIONS:
        return True
    return isinstance(n.target, torch._ops.OpOverload) and \
        n.target.overloadpacket.__name__ in _CONV_ATEN


def count_convolutions(gm: fx.GraphModule) -> int:
    """The convolution calls in ``gm``, those inside kept grad-mode / autocast regions too."""
    count = 0
    for n in gm.graph.nodes:
        count += is_convolution(gm, n)
        if n.op == "get_attr":
            sub = getattr(gm, str(n.target), None)
            if isinstance(sub, fx.GraphModule):
                count += count_convolutions(sub) * len(n.users)
    return count
