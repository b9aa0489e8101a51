"""How a planned model stores its weights (L2 plan): converted once, or kept contiguous.

By default a node planned channels-last gets its rank-4/5 weights converted once, when the
plan is applied: the kernel then reads input and weight in one format, at no cost per call.
With ``optimize(..., weights="contiguous")`` every parameter stays contiguous (what
``fully_shard`` requires: FSDP2 shards and all-gathers flat, contiguous parameters), and each
channels-last node that owns a weight stores it one of two ways, whichever measures faster:

- ``as_is``: the kernel reads the contiguous weight as it is (a convolution given a
  channels-last input and a contiguous weight runs channels-last, and its weight gradient
  comes back contiguous);
- ``per_call``: the weight is converted to the input's format on every call, inside the
  forward (its gradient is converted back by autograd): the conversion is part of the
  node's measured cost.

Either way gradients come back in their parameters' strides.

>>> import torch
>>> from torch import nn
>>> conv = convert_per_call(nn.Conv2d(3, 4, 3))
>>> x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
>>> conv(x).is_contiguous(memory_format=torch.channels_last), conv.weight.is_contiguous()
(True, True)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from memlayout.layout import Format, channels_last_for_rank, is_format, strides_for
from memlayout.plan.graph import Label
from memlayout.tensors import to_format

#: ``optimize(weights=...)``: weights of channels-last nodes converted once (default), or
#: every parameter kept contiguous
CONVERTED = "converted"
CONTIGUOUS = "contiguous"
WEIGHTS = (CONVERTED, CONTIGUOUS)
#: how a channels-last node reads a contiguous weight
AS_IS = "as_is"
PER_CALL = "per_call"

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class PerCallWeights:
    """Mixin for a convolution whose stored weight stays contiguous and is converted, per
    call, to the format its input arrives in (a contiguous input reads it as it is)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # type: ignore[attr-defined]
        fmt = channels_last_for_rank(input.dim())
        shape, strides = tuple(input.shape), tuple(input.stride())
        # an ambiguous input (C == 1, H == W == 1) is read contiguous: no conversion for it
        if (fmt is not None and input.dim() == weight.dim() and is_format(shape, strides, fmt)
                and not is_format(shape, strides, Format.CONTIGUOUS)):
            weight = to_format(weight, fmt)
        return self._conv_forward(input, weight, self.bias)  # type: ignore[attr-defined]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickled (and deep-copied) as its convolution class plus the mark: the subclass is
        # made again where it is loaded (another rank, another process)
        return _per_call_from, (self._per_call_base, self.__dict__)  # type: ignore[attr-defined]


@functools.cache
def _per_call_class(cls: type[nn.Module]) -> type[nn.Module]:
    # one subclass per convolution class (torchvision's Conv3DSimple and friends included):
    # isinstance checks, state_dict keys and FSDP's own class swap all keep working
    name = f"PerCall{cls.__name__}"
    return type(name, (PerCallWeights, cls), {"__module__": __name__, "__qualname__": name,
                                              "_per_call_base": cls})


def _per_call_from(base: type[nn.Module], state: dict[str, Any]) -> nn.Module:
    module = base.__new__(base)
    module.__setstate__(state)
    return convert_per_call(module)


def can_convert_per_call(module: nn.Module) -> bool:
    """A convolution whose forward :func:`convert_per_call` can take over."""
    return isinstance(module, _CONVS) and not isinstance(module, PerCallWeights)


def convert_per_call(module: nn.Module) -> nn.Module:
    """``module`` (a convolution), in place, converting its weight per call to the input's
    format; anything else unchanged. Returns ``module``."""
    if can_convert_per_call(module):
        module.__class__ = _per_call_class(type(module))
    return module


def keep_contiguous(module: nn.Module, ranks: tuple[int, ...]) -> nn.Module:
    """Every parameter and buffer of ``module`` of a layout rank in contiguous strides, as new
    tensors where they are not (the originals may be shared with an unplanned copy); a tensor
    shared by several modules stays shared. In place; returns ``module``."""
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for kind in ("_parameters", "_buffers"):
            table: dict[str, Any] = getattr(sub, kind)
            for name, t in list(table.items()):
                if t is None or t.dim() not in ranks or tuple(t.stride()) == strides_for(
                        tuple(t.shape), Format.CONTIGUOUS):
                    continue
                if id(t) not in made:
                    data = to_format(t.detach(), Format.CONTIGUOUS)
                    made[id(t)] = (nn.Parameter(data, requires_grad=t.requires_grad)
                                   if isinstance(t, nn.Parameter) else data)
                table[name] = made[id(t)]
    return module


def store_weights(root: nn.Module, gm: fx.GraphModule, labels: Mapping[str, Label],
                  storage: dict[str, str | None], ranks: tuple[int, ...]) -> nn.Module:
    """Apply ``weights="contiguous"`` to a rewritten region: every parameter contiguous again,
    and each channels-last node whose measured storage is ``per_call`` converting its weight
    per call. ``storage``: node name -> ``as_is`` / ``per_call`` / ``None``."""
    keep_contiguous(root, ranks)
    for n in gm.graph.nodes:
        if (n.op == "call_module" and labels.get(n.name) == Label.CHANNELS_LAST
                and storage.get(n.name) == PER_CALL):
            convert_per_call(root.get_submodule(n.target))
    return root


def storage_counts(labels: Mapping[str, Label], storage: dict[str, str | None]) -> dict[str, int]:
    """How many channels-last nodes read their contiguous weights as they are, and how many
    convert them per call."""
    counts = {AS_IS: 0, PER_CALL: 0}
    for name, label in labels.items():
        kind = storage.get(name)
        if label == Label.CHANNELS_LAST and kind in counts:
            counts[kind] += 1
    return counts


__all__ = ["AS_IS", "CONTIGUOUS", "CONVERTED", "PER_CALL", "WEIGHTS", "PerCallWeights",
           "can_convert_per_call", "convert_per_call", "keep_contiguous", "store_weights",
           "storage_counts"]
