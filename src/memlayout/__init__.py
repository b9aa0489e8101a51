"""memlayout: tensor memory layout for PyTorch, made a solved problem.

>>> import torch, memlayout
>>> memlayout.format_of(memlayout.to_format(torch.empty(10, 3, 32, 32), memlayout.Format.CHANNELS_LAST))
<Format.CHANNELS_LAST: 'channels_last'>
"""

# ``memlayout.audit`` is the function (eager, so importing a submodule cannot rebind the name);
# the package's modules are reached with ``from memlayout.audit.render import ...``.
from memlayout.audit import AuditMode, AuditReport, audit, strict
from memlayout.errors import (
    CaptureError,
    LayoutDropError,
    LayoutError,
    LayoutVerificationError,
    MemlayoutError,
    ModelSpecError,
    PlanError,
)
from memlayout.layout import (
    Format,
    dim_order,
    formats_of,
    is_non_overlapping_and_dense,
    strides_for,
)
from memlayout.tensors import convert_batch, convert_module, format_of, to_format

__version__ = "0.1.0"

_PLANNER = {"optimize", "apply", "Plan", "PlanOptions", "plan_of", "prepare_inputs"}


def __getattr__(name: str):
    # The planner (torch.fx, scipy) loads on first use: `import memlayout` stays light.
    # memlayout.compile: plan, then torch.compile. Not in __all__: `from memlayout import *`
    # must not shadow the builtin compile in the caller's namespace.
    if name == "compile":
        from memlayout.plan.compilers import compiled

        return compiled.compile
    # memlayout.backend(...): the torch.compile backend's options record (the backend itself);
    # backend="memlayout" is its default. memlayout.backend_report(): what it decided.
    if name == "backend":
        from memlayout.plan.compilers import backend

        return backend.Backend
    if name == "backend_report":
        from memlayout.plan.compilers import backend_report

        return backend_report.backend_report
    if name in _PLANNER:
        from memlayout.plan import apply, options, pipeline
        from memlayout.plan.report import plan as plan_record
        from memlayout.plan.steer import steering

        return {"optimize": pipeline.optimize, "apply": apply.apply, "Plan": plan_record.Plan,
                "PlanOptions": options.PlanOptions, "plan_of": steering.plan_of,
                "prepare_inputs": steering.prepare_inputs}[name]
    raise AttributeError(f"module 'memlayout' has no attribute {name!r}")

__all__ = [
    "AuditMode",
    "AuditReport",
    "CaptureError",
    "Format",
    "LayoutDropError",
    "LayoutError",
    "LayoutVerificationError",
    "MemlayoutError",
    "ModelSpecError",
    "Plan",
    "PlanError",
    "PlanOptions",
    "apply",
    "audit",
    "convert_batch",
    "convert_module",
    "dim_order",
    "format_of",
    "formats_of",
    "is_non_overlapping_and_dense",
    "optimize",
    "plan_of",
    "prepare_inputs",
    "strict",
    "strides_for",
    "to_format",
]
