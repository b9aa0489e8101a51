"""The cost-table file (L2 plan): a measurement cache's entries of one machine
fingerprint as JSON lines, a header first, so a fleet or a CI runner measures once and
ships the costs (``CostCache.export_table`` / ``import_table``, ``memlayout cache
export|import``). Read whole and checked before anything is imported."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memlayout.errors import MemlayoutError
from memlayout.plan.costs.cachefile import SQLITE_HEADER

if TYPE_CHECKING:
    from memlayout.plan.costs.cache import Entry


class CostTableError(MemlayoutError, ValueError):
    """A cost-table file that cannot be exported or imported as asked: not one ``memlayout
    cache export`` wrote, damaged, or a cache that cannot be read or written now. Nothing of
    it was imported."""


class OtherMachineError(CostTableError):
    """A cost-table file measured on a machine of another fingerprint (``theirs``) than this
    one (``ours``): its timings say nothing of this machine."""

    def __init__(self, message: str, *, theirs: str, ours: str) -> None:
        super().__init__(message)
        self.theirs = theirs
        self.ours = ours


#: the first field of a cost-table file's header, and the version of its layout this code reads
TABLE_FORMAT = "memlayout cost table"
TABLE_VERSION = 1
_TABLE_FIELDS = ("key", "value", "load_average", "cpu_count", "spread", "noisy", "taken_at")


@dataclass(frozen=True)
class CostTableHeader:
    """The first line of a cost-table file: whose timings it holds and what wrote it."""

    fingerprint: str  # ``machine.fingerprint()`` of the machine that measured them
    memlayout: str
    torch: str
    count: int
    exported_at: str  # UTC, ISO 8601
    busy: bool  # entries taken while the machine was busy are in it


@dataclass(frozen=True)
class CostTableFile:
    """A cost-table file read whole (:func:`read_cost_table`)."""

    path: Path
    header: CostTableHeader
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class ExportReport:
    """What ``export_table`` wrote, and what it left out."""

    path: Path
    fingerprint: str
    exported: int
    busy: int  # taken on a busy machine, left out (a quiet machine measures them again)
    other_machines: int  # entries of other fingerprints, never exported
    unreadable: int  # records that are not JSON (a read would measure them again)


@dataclass(frozen=True)
class ImportReport:
    """What ``import_table`` took in: ``added`` new keys, ``replaced`` older local entries;
    ``skipped`` entries where the local one is as new or newer."""

    path: Path
    fingerprint: str
    added: int
    replaced: int
    skipped: int

    @property
    def imported(self) -> int:
        return self.added + self.replaced


def now_utc() -> str:
    """This moment, UTC, ISO 8601 to the second: when an entry was taken or a table made."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def table_text(fingerprint: str, entries: list[Entry], *, busy: bool) -> str:
    """A cost-table file's text: its header (``fingerprint``, the versions, the count, now),
    then one entry a line, as :func:`read_cost_table` reads it."""
    from memlayout import __version__  # the package's own module: loaded by now

    header = {"format": TABLE_FORMAT, "version": TABLE_VERSION, "fingerprint": fingerprint,
              "memlayout": __version__, "torch": torch.__version__, "count": len(entries),
              "exported_at": now_utc(), "busy": busy}
    lines = [json.dumps({"key": e.key, "value": e.value, "load_average": e.load_average,
                         "cpu_count": e.cpu_count, "spread": e.spread, "noisy": e.noisy,
                         "taken_at": e.taken_at}) for e in entries]
    return "".join(f"{line}\n" for line in [json.dumps(header), *lines])


def read_cost_table(path: Path | str, *, machine: str | None = None) -> CostTableFile:
    """The cost-table file at ``path``, checked whole: its header, every entry's fields and
    types, one entry per key, and as many entries as the header counts (a file cut short is
    damaged). Raises :class:`CostTableError` naming the file and what is wrong with it, and
    :class:`OtherMachineError` where ``machine`` is given and the file's fingerprint is
    another."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CostTableError(f"cannot read the cost table {path} "
                             f"({exc.strerror or exc})") from exc
    what = ("an SQLite database (a measurement cache itself?)" if data.startswith(SQLITE_HEADER)
            else "a file")
    not_table = (f"{path} is {what}, not a cost table `memlayout cache export` wrote; "
                 "nothing was imported")
    try:
        lines = data.decode("utf-8").splitlines()
        header = json.loads(lines[0]) if lines else None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CostTableError(not_table) from exc
    if not isinstance(header, dict) or header.get("format") != TABLE_FORMAT:
        raise CostTableError(not_table)
    if header.get("version") != TABLE_VERSION:
        raise CostTableError(f"{path} is a cost table of layout version "
                             f"{header.get('version')!r}, and this memlayout reads version "
                             f"{TABLE_VERSION}; nothing was imported (export it again with "
                             "this memlayout)")
    try:
        head = CostTableHeader(
            _typed(header, "fingerprint", str), _typed(header, "memlayout", str),
            _typed(header, "torch", str), _typed(header, "count", int),
            _typed(header, "exported_at", str), _typed(header, "busy", bool))
    except ValueError as exc:
        raise CostTableError(f"{path} is damaged: its header {exc}; nothing was "
                             "imported") from exc
    if machine is not None and head.fingerprint != machine:
        raise OtherMachineError(
            f"{path} was measured on another machine: its fingerprint is "
            f"{head.fingerprint!r}, this machine's {machine!r}; nothing was imported (timings "
            "hold only where they were taken: export the table on a machine of this "
            "fingerprint, or plan here to measure)", theirs=head.fingerprint, ours=machine)
    entries: list[Entry] = []
    keys: set[str] = set()
    for number, line in enumerate(lines[1:], start=2):
        try:
            entry = _table_entry(line, head.fingerprint)
            if entry.key in keys:
                raise ValueError(f"the key {entry.key} comes twice")
        except ValueError as exc:
            raise CostTableError(f"{path} is damaged at line {number}: {exc}; nothing was "
                                 "imported") from exc
        keys.add(entry.key)
        entries.append(entry)
    if len(entries) != head.count:
        raise CostTableError(f"{path} is damaged: its header counts {head.count} entries and "
                             f"it holds {len(entries)} (cut short?); nothing was imported")
    return CostTableFile(path, head, tuple(entries))


def _typed(record: dict[str, Any], name: str, kind: type, *, optional: bool = False) -> Any:
    """``record[name]`` when it is of ``kind`` (an int where a float is asked; ``None`` where
    ``optional``), else a ``ValueError`` naming the field.

    >>> _typed({"count": 3}, "count", float), _typed({"spread": None}, "spread", float, optional=True)
    (3.0, None)
    """
    value = record.get(name)
    if value is None and optional and name in record:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number if kind is float else (isinstance(value, kind)
                                       and (kind is bool or not isinstance(value, bool)))
    if not ok:
        raise ValueError(f"has no {kind.__name__} {name!r} (found {value!r})")
    return float(value) if kind is float else value


def _table_entry(line: str, machine: str) -> Entry:
    """One line of a cost-table file as an entry of ``machine``; a ``ValueError`` says what
    is wrong with it."""
    from memlayout.plan.costs.cache import Entry, kind_of

    record = json.loads(line)  # a ValueError of its own where the line is not JSON
    if not isinstance(record, dict) or set(record) != set(_TABLE_FIELDS):
        raise ValueError(f"an entry has exactly the fields {', '.join(_TABLE_FIELDS)}")
    key = _typed(record, "key", str)
    taken_at = _typed(record, "taken_at", str)
    utc_time(taken_at)  # a time, or a ValueError
    return Entry(key, kind_of(key), record["value"], machine,
                 _typed(record, "load_average", float, optional=True),
                 _typed(record, "cpu_count", int, optional=True),
                 _typed(record, "spread", float, optional=True),
                 _typed(record, "noisy", bool), taken_at)


def utc_time(stamp: str) -> datetime.datetime:
    """An ISO 8601 time as an aware UTC datetime (one without a zone is taken as UTC)."""
    moment = datetime.datetime.fromisoformat(stamp)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment


def newer(imported: str, local: str) -> bool:
    """The imported entry was taken after the local one (a local time that does not parse
    loses: the imported one was checked when read)."""
    try:
        return utc_time(imported) > utc_time(local)
    except ValueError:
        return True
