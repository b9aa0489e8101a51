"""The plan as plain data (L2 plan): what each node runs in, what is converted, and why.

>>> p = Plan(model="m", device="cpu", torch_version="2", dtype=None, input_format="contiguous",
...          output_format="keep", nodes=[], conversions=[], predicted={"planned": 0.0})
>>> Plan.from_json(p.to_json()) == p
True
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_NAMES = ("contiguous", "channels_last")  # label 0, label 1


@dataclass(frozen=True)
class NodeChoice:
    """One layout node: its region, name, op, chosen format and the cost of each format
    (seconds; ``None`` where the op fails in that format). ``timed``: measured here (or read
    from the cache), not agnostic or analytical."""

    region: str
    name: str
    op: str
    format: str
    seconds: dict[str, float | None]
    timed: bool
    #: why it returns another format when fed channels-last (``memlayout.plan.drops``)
    drops: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Conversion:
    """One inserted conversion: the value converted, to which format, shapes, bytes, cost,
    and the nodes (or ``output``) it serves."""

    region: str
    value: str
    to: str
    shapes: list[list[int]]
    nbytes: int
    seconds: float
    consumers: list[str]


CONV1D_OPS = ("Conv1d", "ConvTranspose1d")


def conv1d_notes(nodes: list[NodeChoice]) -> list[str]:
    """What the plan did with rank 3 (1-d convolutions, NCL vs NLC = channels_last_1d), from
    the measured costs: planned where NLC won, else why not (slower, or no kernel).

    >>> n = NodeChoice("", "c", "Conv1d", "contiguous", {"contiguous": 1.0, "channels_last": 1.5}, True)
    >>> conv1d_notes([n])
    ['rank 3: channels-last-1d (NLC) not beneficial here: measured slower for every 1-d convolution (NLC / NCL time 1.50-1.50); all run NCL']
    """
    convs = [n for n in nodes if n.op in CONV1D_OPS]
    if not convs:
        return []
    nlc = sum(n.format == "channels_last" for n in convs)
    timed = [n for n in convs if n.timed]
    if not timed:
        return [f"rank 3: {nlc} of {len(convs)} 1-d convolutions run NLC (channels_last_1d), "
                "by the analytical cost model (not measured)"]
    ratios = [n.seconds["channels_last"] / n.seconds["contiguous"] for n in timed
              if n.seconds.get("channels_last") and n.seconds.get("contiguous")]
    if not ratios:
        return ["rank 3: no channels-last-1d (NLC) kernel for the 1-d convolutions here "
                "(they fail or return NCL when fed NLC); all run NCL"]
    span = f"NLC / NCL time {min(ratios):.2f}-{max(ratios):.2f}"
    if min(ratios) >= 1.0 and nlc == 0:
        return ["rank 3: channels-last-1d (NLC) not beneficial here: measured slower for every "
                f"1-d convolution ({span}); all run NCL"]
    return [f"rank 3 planned: {nlc} of {len(convs)} 1-d convolutions run NLC (channels_last_1d), "
            f"measured per convolution ({span}; < 1: NLC faster)"]


@dataclass
class Plan:
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
    verification: dict[str, Any] = field(default_factory=dict)
    guard: dict[str, Any] = field(default_factory=dict)  # see memlayout.plan.guard
    # issue #10 (defaults keep older plan JSON loading):
    padding: list[dict[str, Any]] = field(default_factory=list)  # memlayout.plan.padding
    memory: dict[str, Any] = field(default_factory=dict)  # memlayout.plan.memory
    blocked: dict[str, Any] = field(default_factory=dict)  # memlayout.plan.blocked
    # issue #6 (defaults keep older plan JSON loading):
    compiled: dict[str, Any] = field(default_factory=dict)  # memlayout.plan.compiled
    notes: list[str] = field(default_factory=list)  # e.g. why rank 3 is not planned here
    # issue #6, training and changing shapes (defaults keep older plan JSON loading):
    train: bool = False  # planned (costs, guard, verification) for a training step
    input_shapes: list[list[int]] = field(default_factory=list)  # the shapes planned for
    weight_formats_kept: bool = False  # nodes owning weights ran in the weights' formats

    @property
    def counts(self) -> dict[str, int]:
        """Layout nodes per chosen format."""
        out = {name: 0 for name in FORMAT_NAMES}
        for n in self.nodes:
            out[n.format] = out.get(n.format, 0) + 1
        return out

    @property
    def conversion_bytes(self) -> int:
        return sum(c.nbytes for c in self.conversions)

    @property
    def is_noop(self) -> bool:
        """No layout node and no conversion: the model runs exactly as given."""
        return not self.conversions and all(n.format == "contiguous" for n in self.nodes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        data["nodes"] = [NodeChoice(**n) for n in data["nodes"]]
        data["conversions"] = [Conversion(**c) for c in data["conversions"]]
        return cls(**data)

    def summary(self) -> str:
        """One paragraph of plain text: counts, conversions, predictions."""
        counts = self.counts
        pred = self.predicted
        lines = [
            f"{self.model}: {len(self.nodes)} layout nodes "
            f"({counts.get('channels_last', 0)} channels_last, {counts.get('contiguous', 0)} contiguous); "
            f"{len(self.conversions)} conversions, {self.conversion_bytes / 1e6:.1f} MB",
        ]
        if pred:
            parts = [f"{k} {v * 1e3:.2f} ms" for k, v in pred.items()]
            step = " (training step: forward + backward)" if self.train else ""
            lines.append(f"predicted{step}: " + ", ".join(parts))
        verify = self.verification.get("seconds")
        of_which = f" (of which verification {verify:.1f} s)" if verify is not None else ""
        lines.append(f"measured {self.measured}, from cache {self.cached}, "
                     f"planning took {self.planning_seconds:.1f} s{of_which}")
        if self.guard:
            lines.append(self.guard_summary())
        from memlayout.plan.describe import blocked_summary, memory_summary, padding_summary

        lines += [line for line in (memory_summary(self.memory), padding_summary(self.padding),
                                    blocked_summary(self.blocked)) if line]
        for path, reason in self.uncaptured:
            lines.append(f"left eager: {path or '(whole model)'}: {reason}")
        lines += [f"drops channels-last: {n.name} ({n.op}): {note}"
                  for n in self.nodes for note in n.drops]
        if self.compiled:
            lines.append(self.compiled_summary())
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
        if g.get("candidates"):
            ratios = ", ".join(f"planned/{name} {c['median']:.3f}"
                               for name, c in g["candidates"].items())
            line += f"; guard kept {g['kept']} ({ratios})"
        elif g.get("skipped"):
            line += f"; the plan is {' and '.join(g['skipped'])}"
        return line

    def compiled_summary(self) -> str:
        """What ``memlayout.compile`` kept (``memlayout.plan.compiled``) in one line."""
        c = self.compiled
        decision = {True: "channels-last for every 2-d convolution", False: "off",
                    None: "unknown"}[c.get("inductor_layout_opt")]
        kept = {"planned": "the plan, compiled with Inductor's layout_optimization off "
                           "(the plan's strides stand)",
                "inductor": "torch.compile of the original model as asked "
                            "(Inductor's own layout; the plan above is not applied)"}
        parts = [f"compile: kept {kept.get(c['kept'], c['kept'])}; Inductor's own layout "
                 f"decision for this graph: {decision}"]
        for name, r in c.get("candidates", {}).items():
            source = "from the cache" if c.get("source") == "cache" else "measured now"
            parts.append(f"planned / {name} time {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}), "
                         f"median of {c['rounds']} interleaved rounds ({source})")
        parts += [f"{name} failed: {err}" for name, err in c.get("errors", {}).items()]
        if c.get("reason"):
            parts.append(c["reason"])
        return "; ".join(parts)

    def guard_summary(self) -> str:
        """The whole-model check of the plan (``memlayout.plan.guard``) in one line."""
        g = self.guard
        if g.get("source") == "none":
            return f"guard: the plan equals {' and '.join(g['skipped'])}; nothing to compare"
        parts = [f"{name} {c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f})"
                 for name, c in g["candidates"].items()]
        parts += [f"{name}: the plan itself, run as that eager model" for name in g["skipped"]]
        parts += [f"{name} failed: {err}" for name, err in g["errors"].items()]
        source = ("from the cache" if g["source"] == "cache"
                  else f"measured now, {g.get('seconds', 0.0):.1f} s")
        if g.get("extended"):
            source += "; a close call, so timed for twice the rounds"
        return (f"guard: kept {g['kept']}; planned / candidate time, whole model, median of "
                f"{g['rounds']} interleaved rounds ({source}; a candidate replaces the plan "
                f"above {1 + g['margin']:.2f}): " + "; ".join(parts))

    def explain(self, console: Any = None) -> None:
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
            from memlayout.plan.describe import padding_table

            console.print(padding_table(self.padding))
        console.print(self.summary())
