"""The analytical cost model (L2 plan, costs), used only with ``measure=False``: dense
convolutions are FLOP-bound and somewhat faster channels-last; everything else moves the same
bytes either way. Rough by design: it orders formats, it does not predict times.
"""

from __future__ import annotations

import math

from torch import fx

from memlayout.plan.capture.trace import is_convolution
from memlayout.plan.costs.table import ConversionCost
from memlayout.plan.graph import META_KEY, Label, ValueMeta

_FLOPS = 5e10  # flop/s of a dense convolution, contiguous


_CL_CONV_GAIN = 0.85  # channels-last dense convolution time relative to contiguous (oneDNN)


_BANDWIDTH = 1e10  # bytes/s of a strided copy


def analytical_seconds(gm: fx.GraphModule, n: fx.Node, label: Label) -> float:
    """A rough model, used only with ``measure=False``: dense convolutions are FLOP-bound and
    somewhat faster channels-last; everything else moves the same bytes either way."""
    meta: ValueMeta = n.meta[META_KEY]
    work = _convolution_work(gm, n) if meta.layout_tensors else None
    if work is not None:
        reads, dense = work  # input values each output element reads; groups == 1
        numel = math.prod(meta.layout_tensors[0].shape)
        flops = 2.0 * numel * reads
        return flops / _FLOPS * (_CL_CONV_GAIN if label == Label.CHANNELS_LAST and dense else 1.0)
    return meta.nbytes / _BANDWIDTH


def _convolution_work(gm: fx.GraphModule, n: fx.Node) -> tuple[float, bool] | None:
    """``(input values each output element reads, dense)`` of a convolution node: a module
    (torch.fx) or an aten op whose weight is its second argument (torch.export); ``None``
    for any other node."""
    if not is_convolution(gm, n):
        return None
    if n.op == "call_module":
        sub = gm.get_submodule(str(n.target))
        return math.prod(sub.kernel_size) * sub.in_channels / sub.groups, sub.groups == 1
    x, w = (n.args + (None, None))[:2]
    xm = x.meta.get(META_KEY) if isinstance(x, fx.Node) else None
    wm = w.meta.get(META_KEY) if isinstance(w, fx.Node) else None
    if xm is None or wm is None or not xm.tensors or not wm.tensors:
        return None
    weight, channels = wm.tensors[0].shape, xm.tensors[0].shape[1]
    name = getattr(n.target, "__name__", str(n.target))
    if "transpose" in name or (name.startswith("convolution") and len(n.args) > 6
                               and n.args[6] is True):
        return math.prod(weight[2:]) * weight[0], True  # (C_in, C_out / groups, *kernel)
    return math.prod(weight[2:]) * weight[1], weight[1] == channels  # (C_out, C_in / groups, ...)


def analytical_conversion(name: str, meta: ValueMeta) -> ConversionCost:
    seconds = 2.0 * meta.nbytes / _BANDWIDTH
    return ConversionCost(name, seconds, seconds, meta.nbytes,
                          tuple(t.shape for t in meta.layout_tensors), timed=False)
