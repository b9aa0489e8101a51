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
from memlayout.machine import SPREAD_LIMIT
from memlayout.plan.graph import LABELS
from memlayout.plan.report import describe
from memlayout.plan.report.records import (
    AUTOCAST_DTYPES,
    SCHEMA,
    BlockedReport,
    CompiledRecord,
    Conversion,
    CostPrediction,
    Coverage,
    GuardRecord,
    MemoryReport,
    NodeChoice,
    PadChoice,
    Price,
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
    planning_seconds: float = 0.0  # making this plan object (a saved plan: applying it)
    price: Price | None = None  # where planning time went, per step (``None``: not recorded)
    # the checks around the plan (``None``: not run)
    verification: Verification | None = None
    guard: GuardRecord | None = None  # memlayout.plan.check.guard
    padding: tuple[PadChoice, ...] = ()  # memlayout.plan.candidates.padding
    memory: MemoryReport | None = None  # memlayout.plan.check.memory
    blocked: BlockedReport | None = None  # memlayout.plan.candidates.blocked
    compiled: CompiledRecord | None = None  # memlayout.plan.compilers.compiled
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
    #: with ``predict``: layout nodes measured and predicted, and the bound of what predicting
    #: can lose (``memlayout.plan.solve.refine``); ``None``: every node measured
    prediction: CostPrediction | None = None

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
        counts = self.counts
        lines = [
            f"{self.model}: {len(self.nodes)} layout nodes "
            f"({counts.get('channels_last', 0)} channels_last, {counts.get('contiguous', 0)} "
            f"contiguous); {len(self.conversions)} conversions, {self.conversion_bytes / 1e6:.1f} MB",
        ]
        if self.predicted:
            parts = [f"{k} {v * 1e3:.2f} ms" for k, v in self.predicted.items()]
            step = " (training step: forward + backward)" if self.train else ""
            measured = self.guard.planned_seconds if self.guard is not None else None
            if measured:  # what the cost table predicts against the whole model, as timed
                parts.append(f"the planned model measured {measured * 1e3:.2f} ms by the guard")
            lines.append(f"predicted{step}: " + ", ".join(parts))
        made_here = self.price is not None and self.price.total == self.planning_seconds
        if not made_here:  # no breakdown, or a saved plan's: this run's own figures first
            of_which = (f" (of which verification {self.verification.seconds:.1f} s)"
                        if self.verification is not None else "")
            lines.append(f"measured {self.measured}, from cache {self.cached}, "
                         f"planning took {self.planning_seconds:.1f} s{of_which}")
        if self.price is not None:
            lines.append(describe.price_summary(self.price, here=made_here,
                                                measure=self.measure))
        if self.prediction is not None:
            lines.append(describe.prediction_summary(self.prediction))
        if self.costs_noisy:
            lines.append(f"warning: {self.costs_noisy} of {self.costs_timed} costs noisy (measured "
                         f"on a busy machine, or their rounds spread beyond {SPREAD_LIMIT:.0%}): the plan may "
                         "differ on a quiet machine, where they are measured again")
        if self.guard is not None:
            lines.append(describe.guard_summary(self.guard))
        lines += [line for line in (describe.memory_summary(self.memory, train=self.train),
                                    describe.padding_summary(self.padding),
                                    describe.blocked_summary(self.blocked)) if line]
        if self.coverage is not None:
            lines.append(f"coverage: {self.coverage.text(reasons=False)}")
        lines += describe.uncaptured_lines(self.uncaptured, full=full)
        lines += describe.drop_lines(self.nodes)
        if self.compiled is not None:
            lines.append(describe.compiled_summary(self.compiled))
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def headline(self) -> str:
        """One short line: what runs in which format and what the guard kept (for a bench
        record's note, a log line)."""
        counts = self.counts
        line = (f"plan: {counts.get('channels_last', 0)}/{len(self.nodes)} layout nodes "
                f"channels_last, {len(self.conversions)} conversions "
                f"({self.conversion_bytes / 1e6:.1f} MB)")
        if self.input_format is not None:
            line += f", input {self.input_format}"
        g = self.guard
        if g is not None and g.candidates:
            ratios = ", ".join(f"planned/{name} {c.median:.3f}" for name, c in g.candidates.items())
            line += f"; guard kept {g.kept} ({ratios})"
        elif g is not None and g.skipped:
            line += f"; the plan is {' and '.join(g.skipped)}"
        return line

    def guard_summary(self) -> str:
        """The whole-model check of the plan (``memlayout.plan.check.guard``) in one line."""
        return describe.guard_summary(self.guard) if self.guard else ""

    def compiled_summary(self) -> str:
        """What ``memlayout.compile`` kept (``memlayout.plan.compilers.compiled``) in one line."""
        return describe.compiled_summary(self.compiled) if self.compiled else ""

    def explain(self, console: Any = None, *, full: bool = False) -> None:
        """Render the plan with rich: per node the choice and both costs, then conversions."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=f"plan for {self.model} ({self.dtype or 'fp32'}, {self.device})")
        for col in ("region", "node", "op", "format", "contiguous ms", "channels_last ms"):
            table.add_column(col, justify="right" if col.endswith("ms") else "left")
        for n in self.nodes:
            def ms(v: float | None, timed: bool = n.timed) -> str:
                if v is None:
                    return "fails"
                if timed:
                    return f"{v * 1e3:.3f}"
                return "-" if self.measure else f"~{v * 1e3:.3f}"  # ~: the analytical model
            table.add_row(n.region or "-", n.name, n.op, n.format,
                          ms(n.seconds.get("contiguous")), ms(n.seconds.get("channels_last")))
        console.print(table)
        if self.conversions:
            conv = Table(title="conversions")
            for col in ("value", "to", "shapes", "MB", "ms", "serves"):
                conv.add_column(col)
            for c in self.conversions:
                conv.add_row(c.value, c.to, " ".join(str(tuple(s)) for s in c.shapes),
                             f"{c.nbytes / 1e6:.2f}", f"{c.seconds * 1e3:.3f}", ", ".join(c.consumers))
            console.print(conv)
        if self.padding:
            console.print(describe.padding_table(self.padding))
        console.print(self.summary(full=full), markup=False, highlight=False)
