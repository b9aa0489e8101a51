"""``memlayout cache show|prune|clear|export|import``: the measurement cache."""

from __future__ import annotations

import contextlib
import datetime
import sqlite3
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.markup import escape

from memlayout.cli.app import app
from memlayout.cli.common import UsageError, console, fail, writable_file
from memlayout.errors import CacheFileError, MemlayoutError
from memlayout.machine import SPREAD_LIMIT

if TYPE_CHECKING:
    from memlayout.plan.costs.cache import CacheSummary, CostCache

#: what a cost-table move returns (its report)
Moved = TypeVar("Moved")


cache_app = typer.Typer(help="The measurement cache: show, prune, clear, export, import.",
                        no_args_is_help=True)
app.add_typer(cache_app, name="cache")
CACHE_HELP = "The cache file. Default: $MEMLAYOUT_CACHE_DIR/costs.sqlite, else $XDG_CACHE_HOME/memlayout/costs.sqlite."
IMPORT_CACHE_HELP = CACHE_HELP.replace("The cache file.", "The cache file to import into, created when missing.")


@contextlib.contextmanager
def _cache_store(path: str | None, *, readonly: bool = False,
                 create: bool = False) -> Iterator[tuple[Any, Path] | None]:
    """The cache at ``path`` (default: the user's) opened for one verb and closed after it;
    ``None``, said on screen, when there is no cache file (``create``: an empty one is made).
    A file memlayout did not create is refused (one error line) and left as it is;
    ``readonly``: nothing is created, repaired or moved (``show``, ``export``)."""
    from memlayout.plan.costs.cache import CacheWarning, CostCache, cache_path
    from memlayout.plan.costs.cachefile import foreign_reason

    file = Path(path) if path else cache_path()
    if not file.is_file() and not create:
        console.print(f"no cache at {file}", markup=False, highlight=False)
        yield None
        return
    try:
        foreign = foreign_reason(file)
    except sqlite3.Error as exc:
        fail(CacheFileError(f"the cache {file} cannot be read now ({exc}); another process "
                            "holds it: try again when it is done"))
    if foreign is not None:
        what = (f"give --path a cache memlayout wrote (default {cache_path()})" if path else
                "point MEMLAYOUT_CACHE_DIR at another folder, or move the file")
        fail(CacheFileError(f"{file} is {foreign}, not a memlayout measurement cache; it is "
                            f"left as it is: {what}"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", CacheWarning)
        store = CostCache(file, readonly=readonly)
    for warning in seen:
        if issubclass(warning.category, CacheWarning):
            console.print(f"[yellow]warning[/yellow]: {escape(str(warning.message))}")
    try:
        yield store, file
    finally:
        store.close()


@cache_app.command("show")
def cache_show(
    path: Annotated[str | None, typer.Option(help=CACHE_HELP)] = None,
) -> None:
    """The cache's file and its entries, grouped by machine, kind and quality, with ages."""

    with _cache_store(path, readonly=True) as opened:
        if opened is not None:
            render(opened[0].summary(), console)


@cache_app.command("prune")
def cache_prune(
    older_than: Annotated[float | None, typer.Option(help="Drop entries older than this many days. Default: none.")] = None,
    noisy: Annotated[bool, typer.Option("--noisy", help="Drop noisy entries (busy machine, or rounds spread too far). Default: off.")] = False,
    other_machines: Annotated[bool, typer.Option("--other-machines", help="Drop entries of another machine fingerprint (CPU, threads, torch, OpenMP wait policy). Default: off.")] = False,
    path: Annotated[str | None, typer.Option(help=CACHE_HELP)] = None,
) -> None:
    """Drop entries older than --older-than days, noisy ones, or another machine's."""
    try:
        if older_than is None and not noisy and not other_machines:
            raise UsageError("cache prune: give --older-than DAYS, --noisy and/or "
                             "--other-machines (memlayout cache clear drops everything)")
        if older_than is not None and older_than < 0:
            raise UsageError(f"--older-than {older_than}: give a number of days >= 0")
    except MemlayoutError as exc:
        fail(exc)
    with _cache_store(path) as opened:
        if opened is not None:
            store, file = opened
            dropped = store.prune(older_than_days=older_than, noisy_only=noisy,
                                  other_machines=other_machines)
            console.print(f"pruned {dropped} entries from {file}; {store.summary().count} left",
                          markup=False, highlight=False)


def _with_table(path: str | None, how: Callable[[CostCache], Moved], **opening: bool
                ) -> tuple[Moved, Path]:
    """``how(store)`` on the cache at ``path`` (opened as ``_cache_store(path, **opening)``)
    and the cache's file; a refused cost table (``CostTableError``) is one error line."""
    from memlayout.plan.costs.cache import CostTableError

    with _cache_store(path, **opening) as opened:
        assert opened is not None
        store, file = opened
        try:
            return how(store), file
        except CostTableError as exc:
            fail(exc)


@cache_app.command("clear")
def cache_clear(
    path: Annotated[str | None, typer.Option(help=CACHE_HELP)] = None,
) -> None:
    """Drop every entry: the next plan measures everything."""
    with _cache_store(path) as opened:
        if opened is not None:
            store, file = opened
            console.print(f"cleared {store.clear()} entries from {file}", markup=False,
                          highlight=False)


@cache_app.command("export")
def cache_export(
    table: Annotated[Path, typer.Argument(metavar="PATH", help="The cost-table file to write (JSON lines: a header naming this machine's fingerprint, then one entry a line); replaced whole.")],
    busy: Annotated[bool, typer.Option("--busy", help="Export entries taken while the machine was busy too (a quiet machine measures them again). Default: off.")] = False,
    path: Annotated[str | None, typer.Option(help=CACHE_HELP)] = None,
) -> None:
    """Write this machine's entries to PATH, for machines of its fingerprint to import."""
    from memlayout.plan.costs.cache import cache_path

    file = Path(path) if path else cache_path()
    try:
        writable_file("PATH", table)
        if table.resolve() == file.resolve():
            raise UsageError(f"PATH {table} is the cache itself; give another file")
        if not file.is_file():
            raise UsageError(f"no cache at {file}, nothing to export: plan a model here "
                             "first, or give --path")
    except MemlayoutError as exc:
        fail(exc)
    report, file = _with_table(path, lambda store: store.export_table(table, busy=busy),
                               readonly=True)
    left = [f"{n} {what}" for n, what in (
        (report.busy, "taken on a busy machine (--busy exports them)"),
        (report.other_machines, "of other machines"),
        (report.unreadable, "unreadable")) if n]
    console.print(f"exported {report.exported} entries from {file} to {report.path}"
                  + (f"; left out {', '.join(left)}" if left else ""),
                  markup=False, highlight=False)
    console.print(f"fingerprint: {report.fingerprint}", markup=False, highlight=False)


@cache_app.command("import")
def cache_import(
    table: Annotated[Path, typer.Argument(metavar="PATH", help="A cost-table file `memlayout cache export` wrote on a machine of this fingerprint.")],
    path: Annotated[str | None, typer.Option(help=IMPORT_CACHE_HELP)] = None,
) -> None:
    """Take PATH's entries into the cache, all or none, keeping the newer under each key."""
    from memlayout.machine import fingerprint
    from memlayout.plan.costs.cache import CostTableError, read_cost_table

    try:
        read_cost_table(table, machine=fingerprint())  # refused before a cache is created
    except CostTableError as exc:
        fail(exc)
    report, file = _with_table(path, lambda store: store.import_table(table), create=True)
    console.print(f"imported {report.imported} entries into {file} ({report.added} new, "
                  f"{report.replaced} replacing older ones); skipped {report.skipped} "
                  "where the cache's own is as new or newer", markup=False, highlight=False)


def render(summary: CacheSummary, console: Any) -> None:
    """``memlayout cache show``: the file, then one row per (machine, kind, quality) group
    with its count, ages and highest load, never one row per entry."""
    from rich.table import Table

    now = datetime.datetime.now(datetime.timezone.utc)
    console.print(f"cache: {summary.path} ({summary.bytes / 1e6:.2f} MB, {summary.count} "
                  f"entries)", markup=False, highlight=False)
    console.print(f"this machine: {summary.fingerprint}", markup=False, highlight=False)
    if summary.error is not None:
        console.print(f"could not be read: {summary.error}", markup=False, highlight=False)
        return
    if not summary.groups:
        return
    table = Table("machine", "kind", "quality", "entries", "newest", "oldest", "max load")
    for g in summary.groups:
        machine = "this one" if g.fingerprint == summary.fingerprint else g.fingerprint
        load = "-" if g.max_load is None else f"{g.max_load:.1f}"
        table.add_row(machine, g.kind, "noisy" if g.noisy else "quiet", str(g.count),
                      _age(g.newest, now), _age(g.oldest, now), load)
    console.print(table)
    noisy_count = sum(g.count for g in summary.groups if g.noisy)
    if noisy_count:
        console.print(f"{noisy_count} noisy entries (busy machine or rounds spread beyond "
                      f"{SPREAD_LIMIT:.0%}): a quiet run measures them again; "
                      "`memlayout cache prune --noisy` drops them now", markup=False,
                      highlight=False)


def _age(taken_at: str, now: datetime.datetime) -> str:
    """``3.2 h ago``, ``5.0 d ago``, ``40 s ago``."""
    try:
        seconds = (now - datetime.datetime.fromisoformat(taken_at)).total_seconds()
    except (ValueError, TypeError):
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86400:.1f} d ago"
