"""The plan of one model for one input signature (L2 plan, report): plain frozen data, its JSON
(versioned, validated field by field) and its text (``memlayout.plan.report.describe``).

>>> p = Plan(model="m", device="cpu", torch_version="2", dtype=None, input_format="contiguous",
...          output_format="keep", nodes=[], conversions=[], predicted={"planned": 0.0},
...          verification=Verification(True, "dtype tolerance", 0.0, 1e-3, 1))
>>> Plan.from_json(p.to_json()) == p
True
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from memlayout.errors import PlanError
from memlayout.plan.graph import LABELS
from memlayout.plan.report import describe
from memlayout.plan.report.records import (
    AUTOCAST_DTYPES,
    SCHEMA,
    BlockedReport,
    CompiledRecord,
    Conversion,
    Coverage,
    GuardRecord,
    MemoryReport,
    NodeChoice,
    PadChoice,
    Verification,
    decode,
)


@dataclass(frozen=True)
class Plan:
    """The plan of one model for one input signature: every layout node's format, the
    conversions inserted, the predicted costs and the records of the checks around it."""

    model: str
    device: str
    torch_version: str
    dtype: str | None
    input_format: str | None
    output_format: str | None
    nodes: list[NodeChoice]
    conversions: list[Conversion]
    predicted: dict[str, float]  # planned, all_contiguous, all_channels_last (seconds)
    regions: list[str] = field(default_factory=lambda: [""])
    uncaptured: list[list[str]] = field(default_factory=list)  # [path, reason]
    measured: int = 0
    cached: int = 0
    measure: bool = True
    planning_seconds: float = 0.0
    # the checks around the plan (``None``: not run)
    verification: Verification | None = None
    guard: GuardRecord | None = None  # memlayout.plan.check.guard
    padding: tuple[PadChoice, ...] = ()  # memlayout.plan.candidates.padding
    memory: MemoryReport | None = None  # memlayout.plan.check.memory
    blocked: BlockedReport | None = None  # memlayout.plan.candidates.blocked
    compiled: CompiledRecord | None = None  # memlayout.plan.candidates.compiled
    notes: list[str] = field(default_factory=list)  # e.g. why rank 3 is not planned here
    # what it was planned for
    train: bool = False  # planned (costs, guard, verification) for a training step
    input_shapes: list[list[int]] = field(default_factory=list)
    weight_formats_kept: bool = False  # nodes owning weights ran in the weights' formats
    coverage: Coverage | None = None  # convolution calls planned, what stayed eager and why
    #: timed costs (nodes and conversions) and, of those, the noisy ones (measured on a busy
    #: machine, or rounds spread beyond ``machine.SPREAD_LIMIT``; ``memlayout.plan.costs.cache``)
    costs_timed: int = 0
    costs_noisy: int = 0
    #: what ``memlayout.apply`` checks a model against (``memlayout.plan.capture.regions.model_signature``)
    model_signature: str = ""
    #: how parameters are stored (``"converted"`` or ``"contiguous"``) and the model's
    #: train/eval mode it was planned in (a call in the other mode is planned on first sight)
    weights: str = "converted"
    mode: str = "eval"
    #: module results whose format, run, was not the plan's (``memlayout.plan.check.realized``)
    realized: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        """Layout nodes per chosen format."""
        out = {label.text: 0 for label in LABELS}
        for n in self.nodes:
            out[n.format] = out.get(n.format, 0) + 1
        return out

    @property
    def conversion_bytes(self) -> int:
        return sum(c.nbytes for c in self.conversions)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **dataclasses.asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """The plan ``to_json`` wrote. ``PlanError`` for text that is not one: not JSON
        (truncated, corrupt), another schema (older: plan the model again; newer: upgrade
        memlayout), or a field missing, of the wrong type, or naming no format."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise PlanError(f"Plan.from_json takes the JSON text (str or bytes) Plan.to_json "
                            f"wrote, got {type(text).__name__}; read the file first")
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanError(f"plan JSON: not valid JSON ({exc}); the file is truncated or "
                            "corrupt: save the plan again (Plan.to_json, --save)") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan JSON: expected an object with the plan's fields, got "
                            f"{type(data).__name__}; this is not a memlayout plan")
        schema = data.pop("schema", None)
        if schema is None:
            raise PlanError(f"plan JSON schema None: the plan has no \"schema\" (written by a "
                            f"memlayout older than plan schema {SCHEMA}, or not a plan); plan "
                            "the model again with this memlayout")
        if not isinstance(schema, int) or isinstance(schema, bool):
            raise PlanError(f"plan JSON schema {schema!r}: expected an int; not a memlayout plan")
        if schema < SCHEMA:
            raise PlanError(f"plan JSON schema {schema}: written by an older memlayout (this one "
                            f"reads schema {SCHEMA}); plan the model again with this memlayout")
        if schema > SCHEMA:
            raise PlanError(f"plan JSON schema {schema}: written by a newer memlayout (this one "
                            f"reads schema {SCHEMA}); upgrade memlayout to read it, or plan the "
                            "model again with this one")
        plan = decode(cls, data, "plan")
        plan.check_formats()
        return plan

    def check_formats(self) -> None:
        """``PlanError`` for a format or dtype name this memlayout does not know (a plan
        edited by hand or written by another tool): nothing would say what to apply."""
        labels = tuple(lb.text for lb in LABELS)
        names: list[tuple[str, Any, tuple[Any, ...]]] = [
            ("plan.input_format", self.input_format, (None, *labels)),
            ("plan.output_format", self.output_format, (None, "keep", *labels)),
            ("plan.dtype", self.dtype, (None, *AUTOCAST_DTYPES))]
        for i, n in enumerate(self.nodes):
            names.append((f"plan.nodes[{i}].format", n.format, labels))
            names += [(f"plan.nodes[{i}].seconds", k, labels) for k in n.seconds]
        names += [(f"plan.conversions[{i}].to", c.to, labels)
                  for i, c in enumerate(self.conversions)]
        for where, value, allowed in names:
            if value not in allowed:
                raise PlanError(f"{where}: expected one of {', '.join(map(repr, allowed))}, got "
                                f"{value!r}; the plan was edited or written by another tool: "
                                "plan the model again")

    def summary(self, *, full: bool = False) -> str:
        """Plain text: counts, conversions, predictions, and one line per check; ``full``:
        torch's whole text of why each part is not captured (else one short line each)."""
        return describe.summary(self, full=full)

    def headline(self) -> str:
        """One short line: what runs in which format and what the guard kept (for a bench
        record's note, a log line)."""
        return describe.headline(self)

    def guard_summary(self) -> str:
        """The whole-model check of the plan (``memlayout.plan.check.guard``) in one line."""
        return describe.guard_summary(self.guard) if self.guard else ""

    def compiled_summary(self) -> str:
        """What ``memlayout.compile`` kept (``memlayout.plan.candidates.compiled``) in one line."""
        return describe.compiled_summary(self.compiled) if self.compiled else ""

    def explain(self, console: Any = None, *, full: bool = False) -> None:
        """Render the plan with rich: per node the choice and both costs, then conversions."""
        describe.explain(self, console, full=full)
