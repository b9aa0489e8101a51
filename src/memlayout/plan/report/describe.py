"""What a plan's records say on screen (L2 plan): plain-text lines and rich tables, read from
the records (``memlayout.plan.report.records``) and nothing else; the plan's own text
(``Plan.summary``, ``headline``, ``explain``) is built from them.

>>> memory_summary(MemoryReport("tensor_lifetime", 2_000_000, 3_000_000, 0, 0, 10, 10, None,
...                             "planned"))
'peak activation memory (tensor-lifetime count, one inference forward): planned 3.00 MB vs original 2.00 MB (1.50x)'
>>> drop_lines([NodeChoice("", f"norm{i}", "GroupNorm", "contiguous", {}, True,
...                        ["native_group_norm returns contiguous"]) for i in range(5)])
['drops channels-last: 5 GroupNorm nodes (norm0, norm1, norm2, ...): native_group_norm returns contiguous']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memlayout.machine import SPREAD_LIMIT
from memlayout.plan.report.records import (
    UNPADDED,
    BlockedReport,
    CompiledRecord,
    CostPrediction,
    GuardRecord,
    MemoryReport,
    NodeChoice,
    PadChoice,
    Price,
)
from memlayout.plan.runners import Runner

_METHODS = {"tensor_lifetime": "tensor-lifetime count", "cuda_allocator": "CUDA allocator"}


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def uncaptured_lines(uncaptured: Sequence[Sequence[str]], *, full: bool = False) -> list[str]:
    """One line per distinct short reason (a reason's first line) with the parts it applies
    to; ``full``: one entry per part with torch's whole text indented below it.

    >>> uncaptured_lines([["", "torch.fx: TraceError: no.\\nthe whole text"],
    ...                   ["body", "torch.fx: TraceError: no.\\nthe whole text"]])
    ['not captured whole: (whole model), body: torch.fx: TraceError: no.']
    """
    if full:
        return [f"not captured whole: {path or '(whole model)'}:\n" + "\n".join(
            f"    {line}" for line in reason.splitlines()) for path, reason in uncaptured]
    groups: dict[str, list[str]] = {}
    for path, reason in uncaptured:
        groups.setdefault(reason.partition("\n")[0], []).append(path or "(whole model)")
    return [f"not captured whole: {', '.join(paths)}: {reason}"
            for reason, paths in groups.items()]


def drop_lines(nodes: Sequence[NodeChoice], *, shown: int = 3) -> list[str]:
    """One line per (op, reason) a node drops channels-last for, with the count and the first
    ``shown`` node names: a model with dozens of GroupNorms gets one line, not dozens."""
    groups: dict[tuple[str, str], list[str]] = {}
    for n in nodes:
        for note in n.drops:
            groups.setdefault((n.op, note), []).append(n.name)
    lines = []
    for (op, note), names in groups.items():
        listed = ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
        what = f"{op} ({listed})" if len(names) == 1 else f"{len(names)} {op} nodes ({listed})"
        lines.append(f"drops channels-last: {what}: {note}")
    return lines


_STEPS = {"capture": "capture", "costs": "costs", "solve": "solve", "guard": "build and guard",
          "padding": "padding", "memory": "memory check", "blocked": "mkldnn report",
          "verify": "verification"}


def price_summary(price: Price, *, here: bool = True, measure: bool = True) -> str:
    """Where planning time went, in one line; ``here=False``: a saved plan's, made elsewhere;
    ``measure=False``: its costs came from the analytical model.

    >>> price_summary(Price(total=3.0, capture=0.5, costs=2.0, measured=10, cached=4,
    ...                     solve=0.004, guard=0.4, verify=0.05))
    'planning took 3.0 s: capture 0.5 s, costs 2.0 s (10 measured, 4 from the cache), solve 4 ms, build and guard 0.4 s, verification 50 ms, other 46 ms'
    """
    parts = []
    for name, seconds in price.steps.items():
        part = f"{_STEPS[name]} {_seconds(seconds)}"
        if name == "costs":
            predicted = f", {price.predicted} predicted" if price.predicted else ""
            part += (f" ({price.measured} measured, {price.cached} from the cache{predicted})"
                     if measure else " (analytical)")
        parts.append(part)
    parts.append(f"other {_seconds(price.other)}")
    head = "planning took" if here else "the saved plan's planning took"
    return f"{head} {_seconds(price.total)}: " + ", ".join(parts)


def prediction_summary(p: CostPrediction) -> str:
    """What a plan's node costs came from when only what could change it was timed, and
    what predicting can lose, in one line.

    >>> print(prediction_summary(CostPrediction(measured=20, predicted=12, regret=0.0,
    ...                                         widths=1.5e-4, passes=2)))
    costs: 20 layout nodes timed, 12 predicted from this machine's fitted model (2 passes); worst loss from predicting 0 us if each true cost is in its interval (at most 150 us were every predicted node free to flip)
    """
    return (f"costs: {p.measured} layout nodes timed, {p.predicted} predicted from this "
            f"machine's fitted model ({p.passes} pass{'es' if p.passes != 1 else ''}); worst "
            f"loss from predicting {p.regret * 1e6:.0f} us if each true cost is in its "
            f"interval (at most {p.widths * 1e6:.0f} us were every predicted node free to "
            "flip)")


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s >= 0.1 else f"{s * 1e3:.0f} ms"


def guard_summary(g: GuardRecord) -> str:
    """The whole-model check of the plan in one line (two when its figures are suspect)."""
    if g.source == "none":
        return f"guard: the plan equals {' and '.join(g.skipped)}; nothing to compare"
    parts = [f"{name} {c.median:.3f} ({c.min:.3f}-{c.max:.3f})"
             for name, c in g.candidates.items()]
    parts += [f"{name}: the plan itself, run as that eager model" for name in g.skipped]
    parts += [f"{name} failed: {err}" for name, err in g.errors.items()]
    source = ("from the cache" if g.source == "cache"
              else f"measured now, {g.seconds or 0.0:.1f} s")
    if g.extended:
        source += "; a close call, so timed for twice the rounds"
    line = (f"guard: kept {g.kept}; planned / candidate time, whole model, median of "
            f"{g.rounds} interleaved rounds ({source}; a candidate replaces the plan "
            f"above {1 + g.margin:.2f}): " + "; ".join(parts))
    if g.spread is not None and g.spread > SPREAD_LIMIT:
        line += (f"\nnote: the plan's whole-model rounds spread {g.spread:.0%} (beyond "
                 f"{SPREAD_LIMIT:.0%}); the choice weighs per-round ratios, where drift cancels")
    if g.conditions is not None and g.conditions.busy:
        line += (f"\nwarning: the guard's ratios were measured on a busy machine "
                 f"({g.conditions.describe()}): its choice is noisy")
    return line


def compiled_summary(c: CompiledRecord) -> str:
    """What ``memlayout.compile`` kept in one line."""
    decision = {True: "channels-last for every 2-d convolution", False: "off",
                None: "unknown"}[c.inductor_layout_opt]
    kept = {Runner.PLAN_COMPILED: "the plan, compiled with Inductor's layout_optimization off "
                       "(the plan's strides stand)",
            Runner.INDUCTOR_OWN: "torch.compile of the original model with the compile settings "
                        "given (Inductor chooses the layouts; the plan above is not applied)",
            Runner.INDUCTOR_FROZEN: "torch.compile of the original model with Inductor's freezing "
                                 "(weights folded and prepacked; the plan above is not applied)"}
    what = kept.get(c.kept, f"the {c.kept} runtime's model (its own copy of the weights)")
    if c.kept in c.precision:
        what += f", {c.precision[c.kept]}"
    if c.input_format:
        what += f", input {c.input_format}"
    parts = [f"compile: kept {what}; Inductor's own layout decision for this graph: {decision}"]
    source = "from the cache" if c.source == "cache" else "measured now"
    if c.candidates:
        ratios = ", ".join(f"{name} {r.median:.3f} ({r.min:.3f}-{r.max:.3f})"
                           for name, r in c.candidates.items())
        parts.append(f"{c.baseline} / candidate time, median of {c.rounds} interleaved rounds "
                     f"({source}): {ratios}")
    if c.compile_seconds:
        parts.append("built in " + ", ".join(f"{n} {s:.1f} s" for n, s in c.compile_seconds.items()))
    parts += [f"{name} failed: {err}" for name, err in c.errors.items()]
    parts += [f"{name} not a candidate: {why}" for name, why in c.unavailable.items()]
    if c.reason:
        parts.append(c.reason)
    return "; ".join(parts)


def memory_summary(memory: MemoryReport | None, *, train: bool = False) -> str:
    """One or two lines: planned vs original peak; weights when they differ; the budget. The
    peak is of one forward without gradients, also for a plan made for training."""
    if memory is None:
        return ""
    o, p = memory.original, memory.planned
    ratio = f" ({p / o:.2f}x)" if o else ""
    run = ("one forward without gradients, not the training step planned: a training step "
           "also keeps activations for the backward" if train else "one inference forward")
    line = (f"peak activation memory ({_METHODS.get(memory.method, memory.method)}, {run}): "
            f"planned {_mb(p)} vs original {_mb(o)}{ratio}")
    if memory.parameters_planned != memory.parameters_original:
        line += f"; weights {_mb(memory.parameters_planned)} vs {_mb(memory.parameters_original)}"
    if memory.budget is not None:
        if memory.candidates:
            others = ", ".join(f"{n} {_mb(r.peak)}" for n, r in memory.candidates.items())
            line += (f"\nmemory budget {_mb(memory.budget)}: chose {memory.chosen} (fastest "
                     f"predicted that fits; measured peaks: {others})")
        else:
            line += f"\nmemory budget {_mb(memory.budget)}: the fastest plan fits"
    return line


def padding_summary(padding: Sequence[PadChoice]) -> str:
    """One line: how many candidate convolutions were padded, and the time saved."""
    if not padding:
        return ""
    padded = [p for p in padding if p.chosen != UNPADDED]
    reverted = [p for p in padding if p.reverted]
    if reverted:
        ratio = reverted[0].whole_model
        measured = "failed" if ratio is None else f"unpadded / padded time {ratio:.3f}"
        return (f"padded channels: {len(reverted)} of {len(padding)} candidate convolutions "
                f"measured faster padded alone, but not the whole model with them padded "
                f"({measured}, median of interleaved rounds): left unpadded")
    if padded:
        saved = sum(p.saved for p in padded)
        names = ", ".join(f"{p.module} {p.chosen}" for p in padded)
        whole = padded[0].whole_model
        model = "" if whole is None else f"; whole model unpadded / padded {whole:.3f}"
        return (f"padded channels: {len(padded)} of {len(padding)} candidate convolutions "
                f"padded ({names}; measured {saved * 1e3:.3f} ms saved per call{model})")
    return (f"padded channels: 0 of {len(padding)} candidate convolutions padded (padded "
            "variants measured slower, pad and crop included)")


def blocked_summary(blocked: BlockedReport | None) -> str:
    """One line: mkldnn unavailable, or how its chains compared."""
    if blocked is None:
        return ""
    if not blocked.available:
        return f"blocked formats (mkldnn): unavailable: {blocked.note}"
    ratios = [c.ratio for c in blocked.chains if c.ratio]
    errors = [c for c in blocked.chains if c.error is not None]
    text = f"blocked formats (mkldnn): {blocked.note}"
    if ratios:
        text += (f"; planned / mkldnn time per chain {min(ratios):.2f}-{max(ratios):.2f}x "
                 "(> 1: mkldnn faster)")
    if errors:
        text += f"; {len(errors)} chains failed in mkldnn ({errors[0].error})"
    return text


def padding_table(padding: Sequence[PadChoice]) -> Any:
    """A rich table: per candidate convolution the measured microseconds of each variant."""
    from rich.table import Table

    table = Table(title="padded channels (measured, pad and crop included)")
    for col in ("module", "C in -> out", "input", "unpadded us", "padded variants us", "chosen"):
        table.add_column(col)
    for p in padding:
        def us(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e6:.1f}"
        table.add_row(p.module, f"{p.in_channels} -> {p.out_channels}",
                      f"{tuple(p.input_shape)} {p.input_format}", us(p.seconds.get(UNPADDED)),
                      " ".join(f"{n} {us(v)}" for n, v in p.seconds.items() if n != UNPADDED),
                      p.chosen)
    return table


