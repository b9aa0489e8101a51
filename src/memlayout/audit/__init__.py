"""Where a model loses its memory format, forward and backward, and what that costs (L2).

``audit(model, inputs)`` runs once and returns an ``AuditReport`` (plain data);
``AuditMode`` records a block of your own code; ``strict(fmt)`` raises ``LayoutDropError``
at the first drop. Renderers (terminal, JSON, HTML) live in ``memlayout.audit.render``.
"""

from memlayout.audit.recorder import AuditMode, audit, strict
from memlayout.audit.report import (
    AuditReport,
    AuditSummary,
    ModuleCall,
    Offender,
    OpGroup,
    OpRecord,
    TensorInfo,
)

__all__ = [
    "AuditMode",
    "AuditReport",
    "AuditSummary",
    "ModuleCall",
    "Offender",
    "OpGroup",
    "OpRecord",
    "TensorInfo",
    "audit",
    "strict",
]
