"""Which operators keep channels-last on this torch build, device and dtype (L2, "know").

Runs PyTorch's own OpInfo samples (``torch.testing._internal``) in contiguous and in
channels-last form and records, per op, whether outputs and input gradients keep the format
and whether values agree. Results are cached per torch version, device, dtype and format, so
the audit and the planner can ask without running anything:

>>> from memlayout import coverage
>>> coverage.lookup("aten.reflection_pad2d", "cpu", "float32")   # doctest: +SKIP
AtenRecord(name='aten.reflection_pad2d', preserves=2, drops=0, mixed=0, ...)
>>> coverage.explain("nn.functional.pad.circular", "cpu", "float32")   # doctest: +SKIP
'nn.functional.pad.circular drops channels_last on cpu float32 in torch 2.14.1 (coverage: ...)'

Fill the cache with ``memlayout coverage`` (or ``run_coverage`` + ``save_to_cache``).
"""

from memlayout.coverage.opinfo import load_op_db
from memlayout.coverage.records import (
    AtenRecord,
    CoverageReport,
    Disagreement,
    OpRecord,
    Values,
    Verdict,
)
from memlayout.coverage.render import document, to_markdown
from memlayout.coverage.runner import CoverageConfig, run_coverage
from memlayout.coverage.store import (
    cache_path,
    cached_report,
    explain,
    lookup,
    read_json,
    save_to_cache,
    write_json,
)

__all__ = [
    "AtenRecord",
    "CoverageConfig",
    "CoverageReport",
    "Disagreement",
    "OpRecord",
    "Values",
    "Verdict",
    "cache_path",
    "cached_report",
    "document",
    "explain",
    "load_op_db",
    "lookup",
    "read_json",
    "run_coverage",
    "save_to_cache",
    "to_markdown",
    "write_json",
]
