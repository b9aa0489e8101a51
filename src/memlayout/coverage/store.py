"""Coverage reports on disk: JSON files, and the per-user cache the audit and planner read.

The cache holds one file per torch version, device, dtype and format under ``coverage/`` in
memlayout's cache folder (:func:`memlayout.files.cache_dir`). A run over some ops (``--ops``)
merges into it, so a partial rerun never loses the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import torch

from memlayout.coverage.records import AtenRecord, CoverageReport, OpRecord, Verdict
from memlayout.dtypes import torch_name
from memlayout.files import cache_dir, write_atomic

_FORMAT_VERSION = 1


def cache_path(torch_version: str, device: str, dtype: str, fmt: str = "channels_last") -> Path:
    """The cache file of one torch version, device, dtype and format.

    >>> cache_path("2.14.1", "cpu", "float32").name
    'cpu-float32-channels_last.json'
    """
    safe = torch_version.replace("/", "_")
    return cache_dir() / "coverage" / f"torch-{safe}" / f"{device}-{dtype}-{fmt}.json"


def write_json(reports: list[CoverageReport], path: Path) -> None:
    """Write ``reports`` as one JSON document (``{"format": 1, "reports": [...]}``)."""
    doc = {"format": _FORMAT_VERSION, "reports": [r.to_dict() for r in reports]}
    write_atomic(path, json.dumps(doc, separators=(",", ":"), allow_nan=True) + "\n")


def read_json(path: Path) -> list[CoverageReport]:
    """The reports in a file written by ``write_json``."""
    doc = json.loads(Path(path).read_text())
    return [CoverageReport.from_dict(r) for r in doc.get("reports", ())]


def merge(old: CoverageReport | None, new: CoverageReport) -> CoverageReport:
    """``new``'s records replace ``old``'s of the same op; ``old``'s other ops are kept."""
    if old is None:
        return new
    fresh = {r.name: r for r in new.ops}
    kept = [r for r in old.ops if r.name not in fresh]
    ops = tuple(sorted([*kept, *new.ops], key=lambda r: r.name))
    return dataclasses.replace(new, ops=ops, seconds=new.seconds if not kept else old.seconds)


def save_to_cache(report: CoverageReport) -> Path:
    """Merge ``report`` into the cache file of its torch version, device, dtype and format."""
    path = cache_path(report.torch_version, report.device, report.dtype, report.fmt)
    old = None
    if path.exists():
        try:
            old = read_json(path)[0]
        except (OSError, ValueError, KeyError, IndexError):
            old = None  # a corrupt cache entry is replaced, never trusted
    write_json([merge(old, report)], path)
    _load.cache_clear()
    return path


@functools.lru_cache(maxsize=32)
def _load(path: Path, mtime: float) -> tuple[dict[str, OpRecord], dict[str, AtenRecord], str]:
    report = read_json(path)[0]
    return ({r.name: r for r in report.ops}, {a.name: a for a in report.aten},
            report.torch_version)


def cached_report(device: str = "cpu", dtype: Any = "float32", fmt: Any = "channels_last",
                  torch_version: str | None = None) -> CoverageReport | None:
    """The cached report for this torch build (or ``torch_version``), or ``None``."""
    path = _path_for(device, dtype, fmt, torch_version)
    if not path.exists():
        return None
    try:
        return read_json(path)[0]
    except (OSError, ValueError, KeyError, IndexError):
        return None


def _path_for(device: str, dtype: Any, fmt: Any, torch_version: str | None) -> Path:
    if torch_version is None:
        torch_version = torch.__version__
    fmt_value = getattr(fmt, "value", str(fmt))
    return cache_path(torch_version, str(device).split(":")[0],
                      torch_name(dtype), fmt_value)


def _aten_name(op: Any) -> str | None:
    """``aten.relu`` for ``torch.ops.aten.relu``, ``torch.ops.aten.relu.default``,
    ``"aten.relu.default"`` or ``"aten.relu"``; ``None`` for a name without a namespace."""
    packet = getattr(op, "overloadpacket", None)
    if packet is not None:
        return str(packet)
    if hasattr(op, "overloads") and hasattr(op, "_qualified_op_name"):
        return str(op)
    text = str(op)
    return text if text.startswith(("aten.", "prims.")) else None


def lookup(op: Any, device: str = "cpu", dtype: Any = "float32",
           fmt: Any = "channels_last", torch_version: str | None = None,
           ) -> OpRecord | AtenRecord | None:
    """What the cached coverage matrix knows about ``op`` on this torch build (or
    ``torch_version``), ``device``, ``dtype`` and ``fmt``; ``None`` when nothing is cached.

    ``op`` is an OpInfo name (``"nn.functional.pad.reflect"``: an ``OpRecord``) or an aten op
    (``"aten.reflection_pad2d"``, ``"aten.reflection_pad2d.default"``,
    ``torch.ops.aten.reflection_pad2d.default``: an ``AtenRecord``, calls seen inside the
    channels-last runs). Both have a ``verdict``-like field: ``OpRecord.forward`` /
    ``.backward``, ``AtenRecord.verdict``. Reads only the cache: never runs anything.
    """
    path = _path_for(device, dtype, fmt, torch_version)
    try:
        ops, aten, _ = _load(path, path.stat().st_mtime)
    except (OSError, ValueError, KeyError, IndexError):
        return None
    name = _aten_name(op)
    if name is not None:
        if name in aten:
            return aten[name]
        base = name.rsplit(".", 1)[0]  # "aten.relu.default" -> "aten.relu"
        return aten.get(base) if base.count(".") >= 1 else None
    return ops.get(str(op))


def explain(op: Any, device: str = "cpu", dtype: Any = "float32", fmt: Any = "channels_last",
            torch_version: str | None = None) -> str | None:
    """One sentence for a report, from the cache; ``None`` when nothing is cached or the
    matrix has nothing to say (``not applicable``).

    e.g. ``"aten.reflection_pad2d drops channels_last on cpu float32 in torch 2.14.1
    (coverage: 3 of 3 calls)"``.
    """
    rec = lookup(op, device, dtype, fmt, torch_version)
    if rec is None:
        return None
    if torch_version is None:
        torch_version = torch.__version__
    fmt_value = getattr(fmt, "value", str(fmt))
    where = f"on {device} {torch_name(dtype)} in torch {torch_version}"
    if isinstance(rec, AtenRecord):
        v = rec.verdict
        if v is Verdict.NOT_APPLICABLE:
            return None
        total = rec.preserves + rec.drops + rec.mixed
        detail = {Verdict.PRESERVES: f"{rec.preserves} of {total} calls",
                  Verdict.DROPS: f"{rec.drops} of {total} calls"}.get(
            v, f"kept in {rec.preserves}, dropped in {rec.drops} of {total} calls")
        phase = "/".join(rec.phases)
        seen = f"; seen in {', '.join(rec.opinfo_ops[:4])}" if rec.opinfo_ops else ""
        return f"{rec.name} {_verb(v)} {fmt_value} {where} (coverage: {detail}, {phase}{seen})"
    if rec.forward is Verdict.NOT_APPLICABLE and rec.backward is Verdict.NOT_APPLICABLE:
        return None
    if rec.forward is Verdict.ERROR:
        return f"{rec.name} raises on its samples {where} (coverage: {rec.error})"
    return (f"{rec.name} {_verb(rec.forward)} {fmt_value} {where} "
            f"(coverage: forward {rec.forward.value}, backward {rec.backward.value})")


def _verb(v: Verdict) -> str:
    return {Verdict.PRESERVES: "keeps", Verdict.DROPS: "drops",
            Verdict.MIXED: "sometimes drops"}.get(v, "does not apply to")
