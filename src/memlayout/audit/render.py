"""Renderers of an ``AuditReport`` (L2): terminal (rich), JSON, self-contained HTML.

They only read the report. The HTML page needs nothing from the network: CSS inline, no
script, no fonts, so it opens anywhere and survives being mailed around.

>>> from memlayout.audit.report import AuditReport
>>> page = render_html(AuditReport.from_records("channels_last", (), ()), title="empty")
>>> page.startswith("<!DOCTYPE html>") and "http" not in page.split("<body>")[1]
True
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memlayout.audit.report import (
    OUTSIDE,
    PHASES,
    AuditReport,
    OpRecord,
    drops_by_op,
    in_format_name,
    offender_patterns,
)
from memlayout.machine import SPREAD_LIMIT, noisy
from memlayout.timing import Comparison


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``.

    >>> human_bytes(0), human_bytes(1536), human_bytes(3 * 2**20)
    ('0 B', '1.5 KiB', '3.0 MiB')
    """
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _where(module: str | None, module_type: str | None) -> str:
    if module is None:
        return OUTSIDE
    return f"{module or '(model)'} ({module_type})"


# -- JSON -------------------------------------------------------------------------------------
def write_json(report: AuditReport, path: str | Path) -> None:
    """The whole report as JSON (``AuditReport.to_dict``: stable keys, see the README)."""
    Path(path).write_text(json.dumps(report.to_dict(), indent=1) + "\n")


# -- terminal ---------------------------------------------------------------------------------
def render_terminal(report: AuditReport, console: Console, title: str = "audit", top: int = 20) -> None:
    """A rich summary, then drops and conversions grouped by (module type, op), by bytes; then
    the offending module instances grouped by path pattern, each group counted once."""
    s = report.summary
    share = "n/a" if s.activation_share is None else f"{100 * s.activation_share:.1f} %"
    ops = ", ".join(f"{p} {n}" for p, n in s.ops.items() if n)
    drops = ", ".join(f"{p} {n}" for p, n in s.drops_by_phase.items() if n) or "none"
    console.print(f"[bold]{escape(title)}[/bold] in {report.fmt}  "
                  f"({', '.join(f'{k}={v}' for k, v in report.meta.items() if k in ('train', 'dtype', 'device'))})")
    console.print(f"  aten calls recorded: {ops or 'none'}")
    console.print(f"  drops of {report.fmt}: [{'red' if s.drops else 'green'}]{s.drops}[/] ({drops})")
    console.print(f"  layout conversions: {s.conversions} ({human_bytes(s.conversion_bytes)})")
    console.print(f"  activation bytes in {report.fmt}: {share} of {human_bytes(s.activation_bytes)}")
    if not s.groups:
        console.print(f"[green]No op dropped {report.fmt} and no layout conversion ran.[/green]")
        return
    table = Table(title="drops and conversions by module type and op (most bytes first)")
    for col in ("module type", "op", "drops fwd", "drops bwd", "drops opt", "conversions",
                "bytes converted", "bytes out of format"):
        table.add_column(col, justify="left" if col in ("module type", "op") else "right")
    for g in s.groups[:top]:
        table.add_row(g.module_type or OUTSIDE, g.op, *(str(g.drops.get(p, 0)) for p in PHASES),
                      str(g.conversions), human_bytes(g.conversion_bytes), human_bytes(g.dropped_bytes))
    if len(s.groups) > top:
        table.caption = f"{len(s.groups) - top} more groups in --json / --html"
    console.print(table)
    patterns = offender_patterns(report)
    worst = Table(title="offending modules, instances that differ only in numbers counted together")
    for col in ("phase", "modules", "instances", "op", "drops", "conversions", "bytes"):
        worst.add_column(col, justify="right" if col in ("instances", "drops", "conversions", "bytes") else "left")
    for p in patterns[:top]:
        where = _where(p.example if p.instances == 1 else p.pattern, p.module_type)
        worst.add_row(p.phase, where, str(p.instances), p.op, str(p.drops), str(p.conversions),
                      human_bytes(p.bytes))
    if len(patterns) > top:
        worst.caption = f"{len(patterns) - top} more in --json / --html"
    console.print(worst)
    render_coverage_notes(report, console)


def render_coverage_notes(report: AuditReport, console: Console) -> None:
    """What the coverage matrix says about each dropping op, one line per op with its count;
    the ops it has no record of in one line, and the hint to run ``memlayout coverage`` once."""
    counts = drops_by_op(report)
    if not counts:
        return
    notes = report.meta.get("coverage") or {}
    explained = [(op, n) for op, n in counts.items() if op in notes]
    if explained:
        console.print("[bold]what the coverage matrix says about the dropping ops:[/bold]")
        for op, n in explained:
            console.print(f"  {n} drop{'s' if n > 1 else ''}: {escape(notes[op])}")
    missing = [op for op in counts if op not in notes]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        console.print(f"[dim]not in the coverage matrix here: {escape(shown)}; run `memlayout "
                      f"coverage` once to have drops explained by op[/dim]")


def render_overhead(c: Comparison, console: Console, heading: str) -> None:
    """The audited and plain runs' medians and the median per-round ratio audited / plain,
    with a warning beside figures whose rounds spread beyond ``machine.SPREAD_LIMIT``."""
    ratio, span = c.speedup("plain"), c.speedup_range("plain")
    figures = ", ".join(f"{name} median {c[name].median * 1e3:.1f} ms (spread {100 * c[name].spread:.0f} %)"
                        for name in ("plain", "audited"))
    console.print(f"{heading}, {c.rounds} interleaved rounds: {figures}")
    if ratio is not None and span is not None:
        console.print(f"audited / plain: median per-round ratio {ratio:.2f}x (range {span[0]:.2f}-{span[1]:.2f})")
    loose = [name for name in ("plain", "audited") if noisy(c[name].spread)]
    if loose:
        console.print(f"[yellow]warning[/yellow]: the {' and '.join(loose)} rounds spread more than "
                      f"{100 * SPREAD_LIMIT:.0f} %: trust the ratio for its direction only")


# -- HTML -------------------------------------------------------------------------------------
_COLOURS = {"in": "#2e9e5b", "ambiguous": "#6cc3d5", "contiguous": "#e0a526", "none": "#b9b9b9",
            "other": "#8a7fd0"}
_MAX_CHIPS = 48


def _kind(name: str, fmt: str) -> str:
    """Colour class of a format name relative to the requested format."""
    if name.startswith("ambiguous("):
        return "ambiguous" if in_format_name(name, fmt) else "other"
    if name == fmt:
        return "in"
    if name in ("contiguous", "none"):
        return name
    return "other"


def _out_kind(r: OpRecord, fmt: str, ranks: set[int]) -> str:
    """The colour of an op: that of its first result of the format's rank; ``rank`` (neutral)
    when it has none, since the format does not apply to it."""
    outs = [t for t in r.outputs if t.rank in ranks]
    return _kind(outs[0].format, fmt) if outs else "rank"


def _chip(r: OpRecord, fmt: str, ranks: set[int]) -> str:
    kind = _out_kind(r, fmt, ranks)
    marks = (" drop" if r.dropped else "") + (" conv" if r.conversion else "") + (" view" if r.view else "")
    tip = "\n".join([f"#{r.index} {r.op} ({r.phase})", _where(r.module, r.module_type)]
                    + [f"in {t.describe()}" for t in r.inputs]
                    + [f"out {t.describe()}" for t in r.outputs]
                    + (["DROPPED " + fmt] if r.dropped else [])
                    + ([f"layout conversion, {human_bytes(r.bytes)}"] if r.conversion else []))
    short = r.op.removeprefix("aten.").rsplit(".", 1)[0]
    return (f'<span class="chip k-{kind}{marks}" title="{html.escape(tip)}">'
            f'{html.escape(short)}</span>')


def _chips(records: list[OpRecord], fmt: str, ranks: set[int]) -> str:
    if not records:
        return '<span class="none-here">·</span>'
    shown = "".join(_chip(r, fmt, ranks) for r in records[:_MAX_CHIPS])
    more = len(records) - _MAX_CHIPS
    return shown + (f'<span class="more">+{more} more</span>' if more > 0 else "")


def _badges(records: list[OpRecord]) -> str:
    drops = sum(r.dropped for r in records)
    convs = [r for r in records if r.conversion]
    out = ""
    if drops:
        out += f'<span class="badge b-drop">{drops} drop{"s" if drops > 1 else ""}</span>'
    if convs:
        out += (f'<span class="badge b-conv">{len(convs)} conv · '
                f'{human_bytes(sum(r.bytes for r in convs))}</span>')
    return out


def _strip(records: list[OpRecord], fmt: str, ranks: set[int]) -> str:
    """One thin bar per op in execution order: the run at a glance."""
    if not records:
        return '<div class="strip empty">no ops</div>'
    width = 100 / len(records)
    bars = "".join(
        f'<i class="k-{_out_kind(r, fmt, ranks)}{" drop" if r.dropped else ""}'
        f'{" conv" if r.conversion else ""}" style="width:{width:.4f}%" '
        f'title="{html.escape(f"#{r.index} {r.op} at {_where(r.module, r.module_type)}")}"></i>'
        for r in records)
    return f'<div class="strip">{bars}</div>'


_CSS = """
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 -apple-system,"Segoe UI",Roboto,"DejaVu Sans",Helvetica,Arial,sans-serif;
 color:#1d2330;background:#f4f5f8}
header{background:#1d2330;color:#fff;padding:22px 32px 18px}
header h1{margin:0;font-size:22px;font-weight:600}
header .sub{color:#aeb6c6;margin-top:4px;font-size:13px}
main{padding:20px 32px 40px;max-width:1500px}
.cards{display:flex;gap:14px;flex-wrap:wrap;margin-bottom:18px}
.card{background:#fff;border-radius:10px;padding:14px 18px;min-width:170px;
 box-shadow:0 1px 3px rgba(0,0,0,.08)}
.card .v{font-size:26px;font-weight:650;margin-top:2px}
.card .l{color:#5b6475;font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .d{color:#5b6475;font-size:12px}
.v.bad{color:#c8362d}.v.good{color:#2e9e5b}
.legend{display:flex;gap:16px;flex-wrap:wrap;margin:6px 0 16px;font-size:13px;color:#3d4555}
.legend span{display:inline-flex;align-items:center;gap:6px}
.sw{display:inline-block;width:14px;height:14px;border-radius:3px}
section{background:#fff;border-radius:10px;padding:16px 20px;margin-bottom:18px;
 box-shadow:0 1px 3px rgba(0,0,0,.08)}
h2{font-size:16px;margin:0 0 10px}
.strip{display:flex;height:22px;border-radius:4px;overflow:hidden;background:#eee;margin:4px 0 10px}
.strip i{display:block;height:100%}
.strip i.drop{box-shadow:inset 0 -7px 0 #c8362d}
.strip i.conv{box-shadow:inset 0 7px 0 #e4572e}
.striplabel{font-size:12px;color:#5b6475}
table{border-collapse:collapse;width:100%}
th{white-space:nowrap;text-align:left;font-size:12px;color:#5b6475;font-weight:600;text-transform:uppercase;
 letter-spacing:.03em;border-bottom:2px solid #e3e6ec;padding:6px 8px;position:sticky;top:0;background:#fff}
td{border-bottom:1px solid #eef0f4;padding:5px 8px;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.hasdrop td.mod{border-left:4px solid #c8362d}
tr.hasconv td.mod{border-left:4px solid #e4572e}
td.mod{border-left:4px solid transparent;white-space:nowrap;font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12.5px}
td.type{color:#3d4555;white-space:nowrap}
.outfmt{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-size:12px;white-space:nowrap}
.chip{display:inline-block;margin:1px 2px;padding:0 6px;border-radius:4px;font-size:11.5px;
 font-family:ui-monospace,"DejaVu Sans Mono",monospace;color:#fff;line-height:18px}
.chip.view{opacity:.55}
.chip.drop{outline:2px solid #c8362d;outline-offset:1px}
.chip.conv{background-image:repeating-linear-gradient(135deg,rgba(255,255,255,.35) 0 4px,transparent 4px 8px)}
.k-in{background:#2e9e5b}.k-ambiguous{background:#6cc3d5}.k-contiguous{background:#e0a526}
.k-none{background:#b9b9b9}.k-other{background:#8a7fd0}.k-rank{background:#9fb0c8}
.badge{display:inline-block;margin-left:6px;padding:0 7px;border-radius:9px;font-size:11.5px;
 font-weight:600;color:#fff}
.b-drop{background:#c8362d}.b-conv{background:#e4572e}
.none-here{color:#c3c8d2}
.more{font-size:11.5px;color:#5b6475;margin-left:4px}
.ok{color:#2e9e5b;font-weight:600}
td.fw,td.bw{width:38%}
"""


def render_html(report: AuditReport, title: str = "memlayout audit") -> str:
    """One self-contained page: summary cards, an op strip per phase, the modules in
    execution order (coloured by their output layout) with forward and backward ops side by
    side, drops and conversions marked, and the offender tables."""
    fmt, esc = report.fmt, html.escape
    ranks = {4} if fmt == "channels_last" else {5} if fmt == "channels_last_3d" else \
        {3} if fmt == "channels_last_1d" else {4, 5}
    by_phase: dict[str, list[OpRecord]] = defaultdict(list)
    for r in report.records:
        by_phase[r.phase].append(r)
    strips = "".join(
        f'<div class="striplabel">{p}: {len(by_phase[p])} ops in execution order</div>'
        + _strip(by_phase[p], fmt, ranks) for p in PHASES if by_phase[p])
    meta = " · ".join(f"{esc(str(k))}: {esc(str(v))}" for k, v in report.meta.items()
                      if k in ("model", "train", "dtype", "device", "inputs", "torch"))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_CSS}</style></head>
<body>
<header><h1>{esc(title)}</h1><div class="sub">requested format: {esc(fmt)} · {meta}</div></header>
<main>
<div class="cards">{_cards(report)}</div>
<div class="legend">{_legend(fmt, ranks)}</div>
<section><h2>Every op, in execution order, coloured by the layout of its result</h2>{strips}</section>
{_detail(report)}
<section><h2>Modules in execution order</h2>
<p class="striplabel">Each op is a chip coloured by its result's layout (hover for shapes and
strides); backward ops sit on the row of the module whose forward created them.</p>
{_module_table(report, ranks)}</section>
</main></body></html>
"""


def _cards(report: AuditReport) -> str:
    """The summary cards: aten calls, drops, conversions, the share of activation bytes in
    the format."""
    fmt, s, esc = report.fmt, report.summary, html.escape
    share = "n/a" if s.activation_share is None else f"{100 * s.activation_share:.1f}%"
    cards = [
        ("aten calls", str(sum(s.ops.values())),
         " · ".join(f"{p} {n}" for p, n in s.ops.items() if n) or "none", ""),
        (f"drops of {fmt}", str(s.drops),
         " · ".join(f"{p} {n}" for p, n in s.drops_by_phase.items() if n) or "none",
         "bad" if s.drops else "good"),
        ("layout conversions", str(s.conversions), human_bytes(s.conversion_bytes) + " copied",
         "bad" if s.conversions else "good"),
        (f"activation bytes in {fmt}", share, "of " + human_bytes(s.activation_bytes) + " written",
         "good" if s.activation_share is None or s.activation_share >= 0.999 else "bad"),
    ]
    return "".join(
        f'<div class="card"><div class="l">{esc(label)}</div><div class="v {cls}">{esc(value)}</div>'
        f'<div class="d">{esc(detail)}</div></div>' for label, value, detail, cls in cards)


def _legend(fmt: str, ranks: set[int]) -> str:
    """What each colour and mark means."""
    esc = html.escape
    legend = "".join(
        f'<span><i class="sw k-{k}"></i>{esc(text)}</span>'
        for k, text in (("in", fmt), ("ambiguous", f"ambiguous (also {fmt})"),
                        ("contiguous", "contiguous"), ("none", "no format (views, broadcasts)"),
                        ("other", "other format"),
                        ("rank", f"result not {'/'.join(f'{n}-D' for n in sorted(ranks))} (format n/a)")))
    return legend + ('<span><i class="sw" style="background:#fff;outline:2px solid #c8362d"></i>'
                     f'dropped {esc(fmt)}</span><span><i class="sw k-in conv chip" style="padding:0">'
                     '</i>layout conversion (copy)</span>')


def _module_table(report: AuditReport, ranks: set[int]) -> str:
    """A row per module call in execution order: its output layout, its forward ops and the
    backward ops its forward created; ops outside every module in a last row."""
    fmt, esc = report.fmt, html.escape
    by_call: dict[tuple[int, str], list[OpRecord]] = defaultdict(list)
    for r in report.records:
        by_call[(r.call, r.phase)].append(r)
    rows = []
    for c in sorted(report.calls, key=lambda c: c.index):
        fw, bw = by_call.get((c.index, "forward"), []), by_call.get((c.index, "backward"), [])
        mine = fw + bw
        cls = " ".join(x for x, on in (("hasdrop", any(r.dropped for r in mine)),
                                       ("hasconv", any(r.conversion for r in mine))) if on)
        outs = "".join(f'<span class="outfmt k-{_kind(o, fmt) if r in ranks else "rank"}">{esc(o)}</span> '
                       for o, r in zip(c.outputs[:3], c.ranks[:3], strict=False))
        pad = 10 * min(c.depth, 12)
        rows.append(
            f'<tr class="{cls}"><td class="num">{c.index}</td>'
            f'<td class="mod" style="padding-left:{pad + 8}px">{esc(c.module or "(model)")}</td>'
            f'<td class="type">{esc(c.module_type)}</td><td>{outs}</td>'
            f'<td class="fw">{_chips(fw, fmt, ranks)}{_badges(fw)}</td>'
            f'<td class="bw">{_chips(bw, fmt, ranks)}{_badges(bw)}</td></tr>')
    loose = [r for r in report.records if r.call < 0]
    if loose:
        fw = [r for r in loose if r.phase == "forward"]
        bw = [r for r in loose if r.phase != "forward"]
        rows.append(
            f'<tr><td class="num">–</td><td class="mod">{esc(OUTSIDE)}</td><td class="type"></td>'
            f'<td></td><td class="fw">{_chips(fw, fmt, ranks)}{_badges(fw)}</td>'
            f'<td class="bw">{_chips(bw, fmt, ranks)}{_badges(bw)}</td></tr>')
    if not rows:
        return "<p>No module ran.</p>"
    return ('<table><thead><tr><th>#</th><th>module, in execution order</th><th>type</th>'
            '<th>output layout</th><th>forward ops</th><th>backward / optimizer ops</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def _detail(report: AuditReport) -> str:
    """Drops and conversions by module type and op, the top offenders, and what the coverage
    matrix says about the dropping ops; one line when nothing dropped or converted."""
    s, esc = report.summary, html.escape
    if not s.groups:
        return (f'<section><h2>Drops and conversions</h2><p class="ok">No op dropped '
                f'{esc(report.fmt)} and no layout conversion ran.</p></section>')
    group_rows = "".join(
        f'<tr><td>{esc(g.module_type or OUTSIDE)}</td><td class="mod">{esc(g.op)}</td>'
        + "".join(f'<td class="num">{g.drops.get(p, 0)}</td>' for p in PHASES)
        + f'<td class="num">{g.conversions}</td><td class="num">{human_bytes(g.conversion_bytes)}</td>'
        f'<td class="num">{human_bytes(g.dropped_bytes)}</td></tr>' for g in s.groups)
    groups = ('<table><thead><tr><th>module type</th><th>op</th><th>drops fwd</th>'
              '<th>drops bwd</th><th>drops opt</th><th>conversions</th><th>bytes converted</th>'
              f'<th>bytes out of format</th></tr></thead><tbody>{group_rows}</tbody></table>')
    off_rows = "".join(
        f'<tr><td>{o.phase}</td><td class="mod">{esc(_where(o.module, o.module_type))}</td>'
        f'<td class="mod">{esc(o.op)}</td><td class="num">{o.drops}</td>'
        f'<td class="num">{o.conversions}</td><td class="num">{human_bytes(o.bytes)}</td></tr>'
        for o in s.top_offenders)
    offenders = ('<table><thead><tr><th>phase</th><th>module</th><th>op</th><th>drops</th>'
                 f'<th>conversions</th><th>bytes</th></tr></thead><tbody>{off_rows}</tbody></table>')
    notes = report.meta.get("coverage") or {}
    explained = ("<section><h2>What the coverage matrix says about the dropping ops</h2><ul>"
                 + "".join(f"<li>{esc(n)}</li>" for n in notes.values())
                 + "</ul></section>") if notes else ""
    return (f'<section><h2>Drops and conversions by module type and op</h2>{groups}</section>'
            f'<section><h2>Top offenders</h2>{offenders}</section>{explained}')


def write_html(report: AuditReport, path: str | Path, title: str = "memlayout audit") -> None:
    """Write ``render_html(report, title)`` to ``path``."""
    Path(path).write_text(render_html(report, title), encoding="utf-8")
