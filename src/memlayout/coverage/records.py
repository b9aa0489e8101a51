"""Plain data of the coverage matrix: verdicts, per-op and per-aten-op records, one report.

Everything here is printable and JSON round-trippable; nothing imports torch.

>>> Verdict.combine(["preserves", "preserves", "n/a"])
<Verdict.PRESERVES: 'preserves'>
>>> Verdict.combine(["preserves", "drops"])
<Verdict.MIXED: 'mixed'>
>>> Verdict.combine([])
<Verdict.NOT_APPLICABLE: 'not applicable'>
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class Verdict(str, enum.Enum):
    """Whether an op keeps the memory format of its channels-last inputs."""

    PRESERVES = "preserves"
    DROPS = "drops"
    MIXED = "mixed"  # depends on the sample (or on the output, for multi-output ops)
    NOT_APPLICABLE = "not applicable"
    ERROR = "error"

    @classmethod
    def combine(cls, sample_verdicts: Iterable[str]) -> Verdict:
        """One verdict from per-sample ones (``preserves``/``drops``/``mixed``; anything else,
        such as ``n/a`` for a sample that cannot tell, does not count)."""
        seen = {v for v in sample_verdicts if v in ("preserves", "drops", "mixed")}
        if not seen:
            return cls.NOT_APPLICABLE
        if seen == {"preserves"}:
            return cls.PRESERVES
        if seen == {"drops"}:
            return cls.DROPS
        return cls.MIXED


class Values(str, enum.Enum):
    """Whether channels-last and contiguous runs give the same values (dtype tolerance, NaN == NaN)."""

    AGREE = "agree"
    DISAGREE = "disagree"  # a bug in torch or in memlayout: always listed
    RANDOM = "random"  # values depend on the random generator's order: not comparable
    NONDETERMINISTIC = "nondeterministic"  # differs between two identical contiguous runs
    NOT_COMPARABLE = "not comparable"  # values depend on the layout by definition (as_strided)
    NOT_APPLICABLE = "n/a"


@dataclass(frozen=True)
class Disagreement:
    """Where one channels-last run differs from its contiguous twin."""

    sample: int
    what: str  # "output 0", "grad of arg 1"
    max_abs: float
    max_rel: float
    mismatched: int  # elements outside tolerance
    numel: int
    call: str  # a short description of the sample


@dataclass(frozen=True)
class OpRecord:
    """Coverage of one OpInfo op (``name`` is OpInfo's name plus ``.variant`` when it has one)."""

    name: str
    forward: Verdict
    backward: Verdict
    values: Values
    grads: Values
    samples: int = 0  # samples run (after the cap)
    lifted: bool = False  # samples lifted to the format's rank by memlayout (OpInfo has none)
    forward_counts: Mapping[str, int] = field(default_factory=dict)
    backward_counts: Mapping[str, int] = field(default_factory=dict)
    output_formats: Mapping[str, int] = field(default_factory=dict)  # channels-last run
    grad_formats: Mapping[str, int] = field(default_factory=dict)
    disagreements: tuple[Disagreement, ...] = ()
    errors: tuple[str, ...] = ()  # distinct messages, first few
    error_samples: int = 0
    rejected_samples: int = 0  # lifted samples the op rejects in contiguous form too
    notes: tuple[str, ...] = ()
    #: per aten op its channels-last runs called with an input in the format, what came out:
    #: ``{"aten.relu": {"preserves": 3, "phase:forward": 3}}``
    aten: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def error(self) -> str | None:
        """The first error message, if any sample failed."""
        return self.errors[0] if self.errors else None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["forward"], d["backward"] = self.forward.value, self.backward.value
        d["values"], d["grads"] = self.values.value, self.grads.value
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpRecord:
        d = dict(d)
        d["forward"], d["backward"] = Verdict(d["forward"]), Verdict(d["backward"])
        d["values"], d["grads"] = Values(d["values"]), Values(d["grads"])
        d["disagreements"] = tuple(Disagreement(**x) for x in d.get("disagreements", ()))
        for key in ("errors", "notes"):
            d[key] = tuple(d.get(key, ()))
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class AtenRecord:
    """One aten op as seen inside the channels-last runs: of its calls with an input in the
    format (unambiguously), how many gave outputs in the format, how many did not.

    >>> AtenRecord("aten.reflection_pad2d", preserves=0, drops=3, mixed=0).verdict.value
    'drops'
    """

    name: str
    preserves: int = 0
    drops: int = 0
    mixed: int = 0
    phases: tuple[str, ...] = ()  # "forward", "backward"
    opinfo_ops: tuple[str, ...] = ()  # some OpInfo ops whose runs called it

    @property
    def verdict(self) -> Verdict:
        counts = {"preserves": self.preserves, "drops": self.drops, "mixed": self.mixed}
        return Verdict.combine(k for k, n in counts.items() if n)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["verdict"] = self.verdict.value
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AtenRecord:
        return cls(name=d["name"], preserves=d.get("preserves", 0), drops=d.get("drops", 0),
                   mixed=d.get("mixed", 0), phases=tuple(d.get("phases", ())),
                   opinfo_ops=tuple(d.get("opinfo_ops", ())))


def aten_records(ops: Iterable[OpRecord], examples: int = 4) -> tuple[AtenRecord, ...]:
    """Per aten op, the calls of every OpInfo op's channels-last runs added up (sorted by name).

    >>> r = OpRecord("nn.functional.pad.reflect", Verdict.PRESERVES, Verdict.PRESERVES,
    ...              Values.AGREE, Values.AGREE,
    ...              aten={"aten.reflection_pad2d": {"preserves": 2, "phase:forward": 2}})
    >>> aten_records([r])[0]
    AtenRecord(name='aten.reflection_pad2d', preserves=2, drops=0, mixed=0, phases=('forward',), opinfo_ops=('nn.functional.pad.reflect',))
    """
    totals: dict[str, dict[str, Any]] = {}
    for r in ops:
        for name, counts in r.aten.items():
            t = totals.setdefault(name, {"preserves": 0, "drops": 0, "mixed": 0,
                                         "phases": set(), "ops": []})
            for key, n in counts.items():
                if key.startswith("phase:"):
                    t["phases"].add(key.removeprefix("phase:"))
                elif key in ("preserves", "drops", "mixed"):
                    t[key] += n
            if len(t["ops"]) < examples:
                t["ops"].append(r.name)
    return tuple(
        AtenRecord(name, t["preserves"], t["drops"], t["mixed"],
                   tuple(p for p in ("forward", "backward") if p in t["phases"]), tuple(t["ops"]))
        for name, t in sorted(totals.items()))


@dataclass(frozen=True)
class CoverageReport:
    """The matrix for one torch build, device, dtype and format."""

    torch_version: str
    device: str
    dtype: str
    fmt: str
    ops: tuple[OpRecord, ...]
    seconds: float = 0.0
    command: str = ""
    max_samples: int = 0

    @property
    def aten(self) -> tuple[AtenRecord, ...]:
        """Per aten op, what the channels-last runs saw (see ``aten_records``)."""
        return aten_records(self.ops)

    def counts(self, phase: str = "forward") -> dict[str, int]:
        """Ops per verdict, every verdict listed (zeros included), in ``Verdict`` order."""
        out = {v.value: 0 for v in Verdict}
        for r in self.ops:
            out[getattr(r, phase).value] += 1
        return out

    def disagreements(self) -> list[tuple[str, Disagreement]]:
        """Every value disagreement between channels-last and contiguous runs."""
        return [(r.name, d) for r in self.ops for d in r.disagreements]

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch_version": self.torch_version, "device": self.device, "dtype": self.dtype,
            "fmt": self.fmt, "seconds": self.seconds, "command": self.command,
            "max_samples": self.max_samples,
            "counts": {"forward": self.counts("forward"), "backward": self.counts("backward")},
            "ops": [r.to_dict() for r in self.ops],
            "aten": [a.to_dict() for a in self.aten],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CoverageReport:
        return cls(
            torch_version=d["torch_version"], device=d["device"], dtype=d["dtype"], fmt=d["fmt"],
            ops=tuple(OpRecord.from_dict(r) for r in d.get("ops", ())),
            seconds=d.get("seconds", 0.0), command=d.get("command", ""),
            max_samples=d.get("max_samples", 0),
        )
