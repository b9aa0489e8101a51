"""The audit's plain data: one record per aten call, module calls, and the summary (L2).

Nothing here touches torch: the recorder fills these values, the renderers only read them.
``AuditReport.to_dict()`` is the JSON form (stable keys, documented in the README);
``AuditReport.from_dict`` reads it back.

>>> t = TensorInfo((2, 8, 4, 4), (128, 1, 32, 8), "float32", "channels_last", 1024)
>>> r = OpRecord(0, "forward", "pad", "ReflectionPad2d", 1, "aten.reflection_pad2d.default",
...              (t,), (TensorInfo((2, 8, 6, 6), (288, 36, 6, 1), "float32", "contiguous", 2304),),
...              dropped=True, conversion=False, view=False, bytes=2304)
>>> rep = AuditReport.from_records("channels_last", (r,), ())
>>> rep.summary.drops, rep.summary.groups[0].op
(1, 'aten.reflection_pad2d.default')
>>> AuditReport.from_dict(rep.to_dict()) == rep
True
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("forward", "backward", "optimizer")
OUTSIDE = "(outside modules)"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class TensorInfo:
    """One tensor argument or result: shape, strides, dtype name and format name
    (``channels_last``, ``contiguous``, ``ambiguous(channels_last|contiguous)``, ``none``)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    format: str
    nbytes: int = 0

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        return f"shape {self.shape} strides {self.strides} {self.dtype} {self.format}"


@dataclass(frozen=True)
class OpRecord:
    """One aten call.

    ``module`` is the path of the innermost module it ran under (for backward ops: the module
    whose forward created the autograd node; ``None`` outside every module), ``call`` the index
    of that module call in ``AuditReport.calls`` (-1: none). ``dropped``: an input was
    unambiguously in the requested format and a result of that rank is not. ``conversion``: a
    copy whose only effect is new strides. ``bytes``: bytes the call wrote (0 for views).
    """

    index: int
    phase: str
    module: str | None
    module_type: str | None
    call: int
    op: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    dropped: bool
    conversion: bool
    view: bool
    bytes: int

    def where(self) -> str:
        """``layer1.0.conv1 (Conv2d)``, ``(model) (ResNet)`` or ``(outside modules)``."""
        if self.module is None:
            return OUTSIDE
        return f"{self.module or '(model)'} ({self.module_type})"


@dataclass(frozen=True)
class ModuleCall:
    """One forward call of a module, in execution order; ``outputs`` are the format names of
    its results, ``ranks`` their ranks."""

    index: int
    module: str
    module_type: str
    depth: int
    outputs: tuple[str, ...]
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class OpGroup:
    """Drops and conversions of one (module type, op), counted over all its calls.

    ``dropped_bytes``: bytes its drops wrote out of format; ``bytes``: bytes it moved into the
    wrong place, each call counted once (a conversion's bytes, else a drop's bytes)."""

    module_type: str | None
    op: str
    drops: dict[str, int]
    conversions: int
    conversion_bytes: int
    dropped_bytes: int
    bytes: int

    @property
    def total_drops(self) -> int:
        return sum(self.drops.values())


@dataclass(frozen=True)
class Offender:
    """One module instance and op (and phase) that drops or converts; bytes as in ``OpGroup``."""

    phase: str
    module: str | None
    module_type: str | None
    op: str
    drops: int
    conversions: int
    conversion_bytes: int
    dropped_bytes: int
    bytes: int


@dataclass(frozen=True)
class OffenderPattern:
    """Offenders whose module paths differ only in numbers (``layer1.0.bn1``, ``layer2.1.bn1``
    -> ``layer*.*.bn*``), for one phase, module type and op: a list a reader can take in.
    ``example``: the first instance's path; ``instances``: how many module instances."""

    phase: str
    pattern: str | None
    module_type: str | None
    op: str
    instances: int
    example: str | None
    drops: int
    conversions: int
    bytes: int


@dataclass(frozen=True)
class AuditSummary:
    """What the records add up to.

    ``activation_share``: of the bytes that non-view calls wrote into tensors of the format's
    rank, the share that is in the requested format (ambiguous counts as in); ``None`` when no
    such tensor was written.
    """

    ops: dict[str, int]
    drops: int
    drops_by_phase: dict[str, int]
    conversions: int
    conversion_bytes: int
    activation_bytes: int
    activation_bytes_in_format: int
    groups: tuple[OpGroup, ...]
    top_offenders: tuple[Offender, ...]

    @property
    def activation_share(self) -> float | None:
        if not self.activation_bytes:
            return None
        return self.activation_bytes_in_format / self.activation_bytes


@dataclass(frozen=True)
class AuditReport:
    """Everything one audited run did, as plain data: ``records`` (one per aten call),
    ``calls`` (module calls in execution order) and ``summary``."""

    fmt: str
    records: tuple[OpRecord, ...]
    calls: tuple[ModuleCall, ...]
    summary: AuditSummary
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_records(cls, fmt: str, records: Iterable[OpRecord], calls: Iterable[ModuleCall],
                     meta: dict[str, Any] | None = None, top: int = 10) -> AuditReport:
        records, calls = tuple(records), tuple(calls)
        return cls(fmt, records, calls, summarize(records, fmt, top), dict(meta or {}))

    @property
    def drops(self) -> tuple[OpRecord, ...]:
        return tuple(r for r in self.records if r.dropped)

    @property
    def conversions(self) -> tuple[OpRecord, ...]:
        return tuple(r for r in self.records if r.conversion)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with stable keys (see the README's ``## Audit``)."""
        s = self.summary
        return {
            "schema": SCHEMA_VERSION,
            "format": self.fmt,
            "meta": dict(self.meta),
            "summary": {
                "ops": dict(s.ops),
                "drops": s.drops,
                "drops_by_phase": dict(s.drops_by_phase),
                "conversions": s.conversions,
                "conversion_bytes": s.conversion_bytes,
                "activation_bytes": s.activation_bytes,
                "activation_bytes_in_format": s.activation_bytes_in_format,
                "activation_share": s.activation_share,
                "groups": [asdict(g) for g in s.groups],
                "top_offenders": [asdict(o) for o in s.top_offenders],
            },
            "calls": [asdict(c) for c in self.calls],
            "records": [asdict(r) for r in self.records],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditReport:
        """The report ``to_dict`` wrote (e.g. read back from ``--json``)."""

        def tensor(d: dict[str, Any]) -> TensorInfo:
            return TensorInfo(tuple(d["shape"]), tuple(d["strides"]), d["dtype"], d["format"],
                              d["nbytes"])

        records = tuple(
            OpRecord(**{**r, "inputs": tuple(map(tensor, r["inputs"])),
                        "outputs": tuple(map(tensor, r["outputs"]))})
            for r in data["records"])
        calls = tuple(ModuleCall(**{**c, "outputs": tuple(c["outputs"]), "ranks": tuple(c["ranks"])})
                      for c in data["calls"])
        return cls.from_records(data["format"], records, calls, data.get("meta"),
                                top=max(len(data["summary"]["top_offenders"]), 1))


def _rank_of(fmt: str) -> frozenset[int]:
    return {"channels_last": frozenset({4}), "channels_last_3d": frozenset({5}),
            "channels_last_1d": frozenset({3})}.get(fmt, frozenset({4, 5}))


def in_format_name(name: str, fmt: str) -> bool:
    """Whether a format name (as in ``TensorInfo.format``) includes ``fmt``.

    >>> in_format_name("ambiguous(channels_last|contiguous)", "channels_last")
    True
    >>> in_format_name("channels_last_3d", "channels_last")
    False
    """
    if name.startswith("ambiguous("):
        return fmt in name[len("ambiguous("):-1].split("|")
    return name == fmt


def summarize(records: tuple[OpRecord, ...], fmt: str, top: int = 10) -> AuditSummary:
    """Counts, groups and top offenders of ``records`` (a pure function of the records)."""
    ranks = _rank_of(fmt)
    ops = {p: 0 for p in PHASES}
    drops_by_phase = {p: 0 for p in PHASES}
    act_total = act_in = 0
    groups: dict[tuple[str | None, str], dict[str, Any]] = {}
    offenders: dict[tuple[str, str | None, str | None, str], list[int]] = defaultdict(
        lambda: [0, 0, 0, 0, 0])
    for r in records:
        ops[r.phase] = ops.get(r.phase, 0) + 1
        if not r.view:
            for t in r.outputs:
                if t.rank in ranks:
                    size = t.nbytes
                    act_total += size
                    act_in += size if in_format_name(t.format, fmt) else 0
        if not (r.dropped or r.conversion):
            continue
        dropped_bytes = sum(t.nbytes for t in r.outputs
                            if t.rank in ranks and not in_format_name(t.format, fmt)) if r.dropped else 0
        g = groups.setdefault((r.module_type, r.op), {"drops": {p: 0 for p in PHASES},
                                                      "conversions": 0, "conversion_bytes": 0,
                                                      "dropped_bytes": 0, "bytes": 0})
        o = offenders[(r.phase, r.module, r.module_type, r.op)]
        moved = r.bytes if r.conversion else dropped_bytes
        g["bytes"] += moved
        o[4] += moved
        if r.dropped:
            drops_by_phase[r.phase] = drops_by_phase.get(r.phase, 0) + 1
            g["drops"][r.phase] = g["drops"].get(r.phase, 0) + 1
            g["dropped_bytes"] += dropped_bytes
            o[0] += 1
            o[3] += dropped_bytes
        if r.conversion:
            g["conversions"] += 1
            g["conversion_bytes"] += r.bytes
            o[1] += 1
            o[2] += r.bytes
    group_list = sorted((OpGroup(mt, op, **v) for (mt, op), v in groups.items()),
                        key=lambda g: (-g.bytes, -g.total_drops, -g.conversions, g.op,
                                       g.module_type or ""))
    offender_list = sorted((Offender(ph, m, mt, op, *v) for (ph, m, mt, op), v in offenders.items()),
                           key=lambda o: (-o.bytes, -o.drops - o.conversions, o.phase,
                                          o.module or "", o.op))
    conversions = [r for r in records if r.conversion]
    return AuditSummary(
        ops=ops, drops=sum(drops_by_phase.values()), drops_by_phase=drops_by_phase,
        conversions=len(conversions), conversion_bytes=sum(r.bytes for r in conversions),
        activation_bytes=act_total, activation_bytes_in_format=act_in,
        groups=tuple(group_list), top_offenders=tuple(offender_list[:top]))


def module_pattern(path: str | None) -> str | None:
    """A module path with every number replaced by ``*``: repeated blocks share one pattern.

    >>> module_pattern("layer1.0.conv1"), module_pattern(""), module_pattern(None)
    ('layer*.*.conv*', '', None)
    """
    return None if path is None else re.sub(r"\d+", "*", path)


def offender_patterns(report: AuditReport) -> tuple[OffenderPattern, ...]:
    """Every offender of ``report`` (not only the top ones), grouped by phase, module pattern,
    module type and op, most bytes first."""
    everyone = summarize(report.records, report.fmt, top=len(report.records)).top_offenders
    groups: dict[tuple[str, str | None, str | None, str], list[Offender]] = {}
    for o in everyone:
        groups.setdefault((o.phase, module_pattern(o.module), o.module_type, o.op), []).append(o)
    patterns = (OffenderPattern(phase, pattern, module_type, op, len(os), os[0].module,
                                sum(o.drops for o in os), sum(o.conversions for o in os),
                                sum(o.bytes for o in os))
                for (phase, pattern, module_type, op), os in groups.items())
    return tuple(sorted(patterns, key=lambda p: (-p.bytes, -p.drops - p.conversions, p.phase,
                                                 p.pattern or "", p.op)))


def drops_by_op(report: AuditReport) -> dict[str, int]:
    """How many calls of each op dropped the format, most first."""
    counts: dict[str, int] = defaultdict(int)
    for r in report.records:
        if r.dropped:
            counts[r.op] += 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
