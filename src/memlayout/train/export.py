"""``torch.export`` of an optimized (or channels-last) model for inference, keeping its layouts.

The planned model is ordinary eager PyTorch (its conversions are ``memlayout.to_format``
calls, its weights already converted), so ``torch.export`` traces it like any module: the
exported program holds the planned weights in their planned strides and the conversions as
graph ops. When export cannot trace a model, the reason comes back as an ``ExportError``.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).to(memory_format=torch.channels_last)
>>> ep = export_model(net, torch.randn(1, 3, 8, 8))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlayout.dtypes import torch_name
from memlayout.errors import ExportError
from memlayout.train.ddp import unwrap


def _describe(args: tuple[Any, ...]) -> str:
    return ", ".join(f"{tuple(a.shape)} {torch_name(a.dtype)}"
                     if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)


def export_model(model: nn.Module, example_inputs: Any, *, strict: bool = False) -> Any:
    """``torch.export.export`` of ``model`` (DDP unwrapped, eval mode, no grad) on
    ``example_inputs`` (a tensor or a tuple of forward's arguments). Returns the
    ``ExportedProgram``; ``.module()`` runs it.

    Raises ``ExportError`` naming the model, the inputs and torch's reason when export fails.
    """
    export = getattr(getattr(torch, "export", None), "export", None)
    if export is None:
        raise ExportError(f"this torch ({torch.__version__}) has no torch.export; "
                          "torch >= 2.1 is needed to export")
    module = unwrap(model)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return export(module, args, strict=strict)
    except Exception as exc:  # torch raises many kinds; all mean "this did not export"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(
            f"torch.export of {type(module).__name__} with inputs ({_describe(args)}) failed: "
            f"{type(exc).__name__}: {reason}. The layouts are not the cause unless the reason "
            "names a memlayout function; rewrite the part torch names (data-dependent control "
            "flow, unsupported Python), or export the model before optimizing it"
        ) from exc
    finally:
        module.train(was_training)
