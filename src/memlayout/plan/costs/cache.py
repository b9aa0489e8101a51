"""The measurement cache (L2 plan): key -> JSON record in SQLite, each with the conditions it
was measured under.

Every entry stores, beside its record, the machine's fingerprint (``machine.fingerprint()``:
CPU model, threads, torch version, OpenMP wait policy; part of the primary key, so another
machine's or thread count's numbers are never read), the load average against the cores, the
relative spread of its rounds and when it was taken. An entry measured while the machine was
busy, or whose rounds spread more than ``machine.SPREAD_LIMIT``, is *noisy*, and said to be
when read (:class:`Entry`), so noisy and quiet numbers are never mixed silently. One taken on
a busy machine and read on a quiet one is a miss (measured again and overwritten). One taken
on a quiet machine that spread anyway (taken again before it was stored) is reused: its
spread is the op's own, and measuring it again would move a plan by noise alone, and with it
every decision keyed by the plan.

The cache can never stop a run, and never touches a file memlayout did not create. A cache
file carries memlayout's SQLite ``application_id``; a file without it (another application's
database, or no database at all) is left exactly as it is, and planning measures without a
cache for that run (one :class:`CacheWarning`; ``memlayout cache`` refuses it). A file of
memlayout's that fails SQLite's quick check or holds another schema version is moved aside
(``costs.sqlite.corrupt-<UTC time>``, ``.foreign-...``) by a planning run, and an empty one is
built; a read-only store (``memlayout cache show``) only reports it. A read or write that
fails (read-only file, a lock held past ``timeout``) turns the cache off for the rest of the
run with one warning, and planning measures without it; a record that does not parse, or
fails the reader's check, is a miss (one warning).

A machine's entries travel as a cost-table file (:meth:`CostCache.export_table`,
:meth:`CostCache.import_table`; ``memlayout cache export|import``): JSON lines, a header
naming the fingerprint, then one entry a line. Only a machine of the same fingerprint takes
one in, all of it or nothing, keeping the newer of two entries under one key.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "costs.sqlite"
>>> quiet = Conditions(load_average=0.3, cpu_count=2, threads=2, omp_wait_policy="PASSIVE")
>>> first = CostCache(path, conditions=lambda: quiet)
>>> first.put('["node", "conv"]', {"s": 0.5}, spread=0.1)
>>> first.put('["node", "relu"]', {"s": 0.1}, spread=8.5)  # its rounds spread 850 %
>>> busy = Conditions(load_average=9.0, cpu_count=2, threads=2, omp_wait_policy="PASSIVE")
>>> first.put('["node", "add"]', {"s": 0.2}, spread=0.1, conditions=busy)
>>> later = CostCache(path, conditions=lambda: quiet)  # the next run, on a quiet machine
>>> later.get('["node", "conv"]'), later.entry('["node", "relu"]').noisy
({'s': 0.5}, True)
>>> later.get('["node", "add"]')  # taken busy, read quiet: measure again
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sqlite3
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlayout.files import cache_dir, write_atomic
from memlayout.machine import Conditions, fingerprint, noisy, overloaded
from memlayout.plan.costs.cachefile import (
    APPLICATION_ID,
    COLUMNS,
    CREATE,
    PROBLEMS,
    SCHEMA,
    TIMEOUT,
    application_id,
    foreign_reason,
    schema_problem,
)
from memlayout.plan.costs.transfer import (
    CostTableError,
    ExportReport,
    ImportReport,
    newer,
    now_utc,
    read_cost_table,
    table_text,
    utc_time,
)


class CacheWarning(RuntimeWarning):
    """The cache could not be used as is (repaired, or off for this run); planning goes on."""


def cache_path() -> Path:
    """``costs.sqlite`` in memlayout's cache folder (:func:`memlayout.files.cache_dir`)."""
    return cache_dir() / "costs.sqlite"


def kind_of(key: str) -> str:
    """The kind of a key (its first JSON element: ``node``, ``convert``, ``guard``, ...).

    >>> kind_of('["guard", "cpu"]'), kind_of("plain")
    ('guard', 'other')
    """
    try:
        head = json.loads(key)[0]
    except (ValueError, TypeError, KeyError, IndexError):
        return "other"
    return head if isinstance(head, str) else "other"


@dataclass(frozen=True)
class Entry:
    """One cached measurement and the conditions it was taken under."""

    key: str
    kind: str
    value: Any
    fingerprint: str
    load_average: float | None
    cpu_count: int | None
    spread: float | None  # (max - min) / median of its rounds; ``None``: not a timing
    noisy: bool  # busy machine or spread above ``machine.SPREAD_LIMIT``
    taken_at: str  # UTC, ISO 8601

    @property
    def taken_busy(self) -> bool:
        """Taken while the load average was above the core count."""
        return overloaded(self.load_average, self.cpu_count)

    def age(self, now: datetime.datetime | None = None) -> float | None:
        """Seconds from when it was taken to ``now`` (default: this moment); ``None`` where
        its time does not read as one."""
        try:
            taken = utc_time(self.taken_at)
        except ValueError:
            return None
        return ((now or datetime.datetime.now(datetime.timezone.utc)) - taken).total_seconds()


@dataclass(frozen=True)
class CacheGroup:
    """Entries of one kind on one machine fingerprint, noisy or quiet."""

    kind: str
    fingerprint: str
    noisy: bool
    count: int
    oldest: str
    newest: str
    max_load: float | None


@dataclass(frozen=True)
class CacheSummary:
    """What a cache file holds, grouped (``memlayout cache show``)."""

    path: Path
    bytes: int
    fingerprint: str  # this machine's
    groups: tuple[CacheGroup, ...]
    error: str | None = None  # why it could not be read

    @property
    def count(self) -> int:
        return sum(g.count for g in self.groups)


class CostCache:
    """Measurements in SQLite with their conditions (module docstring).

    ``refresh=True``: records written before this store was opened read as missing, so every
    cost and whole-model decision is measured again and overwrites the old record; what this
    store itself wrote reads back as usual. ``conditions``: where the machine's load is read
    (``Conditions.now``; tests inject one).
    """

    def __init__(self, path: Path | str | None = None, *, refresh: bool = False,
                 timeout: float = TIMEOUT,
                 conditions: Callable[[], Conditions] | None = None,
                 readonly: bool = False) -> None:
        self.path = Path(path) if path is not None else cache_path()
        self.refresh = refresh
        self.readonly = readonly
        self.fingerprint = fingerprint()
        self.timeout = timeout
        self._conditions = conditions or Conditions.now
        self._written: set[str] = set()
        self._warned = False
        self._reads, self._writes = True, not readonly
        self._db: sqlite3.Connection | None = None
        #: why the file could not be read as a cache (``summary`` reports it)
        self.problem: str | None = None
        try:
            foreign = foreign_reason(self.path)
        except (sqlite3.Error, OSError) as exc:
            self._off(exc, "opening it", reads=True)
            return
        if foreign is not None:
            self.problem = foreign
            self._reads = self._writes = False
            if not readonly:
                self._warn(f"memlayout: {self.path} is {foreign}, not a memlayout measurement "
                           "cache: it is left as it is, and planning measures without a cache "
                           "this run; point MEMLAYOUT_CACHE_DIR at another folder, or move "
                           "the file")
            return
        try:
            self._db = self._open()
        except (sqlite3.Error, OSError) as exc:
            self._off(exc, "opening it", reads=True)

    # ------------------------------------------------------------ opening and repairing

    def _connect(self) -> sqlite3.Connection:
        if self.readonly or (self.path.exists() and not os.access(self.path, os.W_OK)):
            # read what it holds; a write turns writing off (one warning)
            return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=self.timeout)
        return sqlite3.connect(self.path, timeout=self.timeout)

    def _create(self, db: sqlite3.Connection) -> None:
        with db:
            db.execute(CREATE)
            db.execute(f"PRAGMA user_version = {SCHEMA}")
            db.execute(f"PRAGMA application_id = {APPLICATION_ID}")

    def _open(self) -> sqlite3.Connection | None:
        if self.readonly and not self.path.is_file():
            return None  # a reader creates nothing
        if not self.readonly:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        db = self._connect()
        try:
            problem = schema_problem(db)
        except sqlite3.OperationalError:
            db.close()
            raise  # locked, unreadable: off for this run, the file is left as it is
        except sqlite3.DatabaseError:
            problem = "corrupt"
        if problem == "empty" and not self.readonly:
            self._create(db)
            return db
        if problem is None:
            if not self.readonly and application_id(self.path) != APPLICATION_ID:
                # memlayout's file from before the id was set: mark it as memlayout's
                with contextlib.suppress(sqlite3.Error), db:
                    db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            return db
        db.close()
        if problem == "empty":
            return None
        if self.readonly:  # a reader reports what it found and moves nothing
            self.problem = (f"{PROBLEMS[problem]}; the next plan (or `memlayout cache "
                            "clear`) moves it aside and starts afresh")
            self._reads = False
            return None
        aside = self._move_aside(problem)
        self._warn(f"memlayout: the measurement cache {self.path} was {PROBLEMS[problem]}; "
                   f"moved to {aside.name} and started afresh (everything is measured again)")
        db = self._connect()
        self._create(db)
        return db

    def _move_aside(self, problem: str) -> Path:
        # only ever a file memlayout created (``foreign_reason`` is None): another
        # application's file is never moved
        assert not self.readonly and foreign_reason(self.path) is None
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.{problem}-{stamp}")
        self.path.rename(aside)
        for suffix in ("-journal", "-wal", "-shm"):  # SQLite's side files belong to the old one
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                side.rename(aside.with_name(aside.name + suffix))
        return aside

    # ------------------------------------------------------------ failing softly

    def _warn(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(text, CacheWarning, stacklevel=3)

    def _off(self, exc: BaseException, doing: str, *, reads: bool) -> None:
        self._writes = False
        if reads:
            self._reads = False
        what = "off for this run" if reads else "read-only for this run"
        self._warn(f"memlayout: the measurement cache {self.path} failed while {doing} "
                   f"({type(exc).__name__}: {exc}); it is {what} and planning measures "
                   "without it")

    @property
    def usable(self) -> bool:
        """Reads still work (``False`` after a failure turned the cache off)."""
        return self._reads and self._db is not None

    # ------------------------------------------------------------ reading and writing

    def entry(self, key: str, check: Callable[[Any], bool] | None = None) -> Entry | None:
        """The entry under ``key`` for this machine's fingerprint, or ``None``: missing,
        refreshed, not valid (``check(value)`` false or not JSON), or taken on a busy machine
        while this one is quiet now (measure it again)."""
        if self.refresh and key not in self._written:
            return None
        row = self._row(key)
        if row is None:
            return None
        try:
            found = _entry(row)
            valid = check is None or bool(check(found.value))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            valid = False
        if not valid:
            self._warn(f"memlayout: a record of unexpected shape in the measurement cache "
                       f"{self.path} ({kind_of(key)}) was ignored and is measured again")
            return None
        if (found.noisy and found.taken_busy and key not in self._written
                and not self._conditions().busy):
            return None  # a busy machine's number, read on a quiet one: measure it again
        return found

    def recorded(self, key: str) -> Entry | None:
        """The entry under ``key`` for this machine's fingerprint as it is stored, ``refresh``
        or not: a record of what happened (``memlayout.plan.costs.attempts``), not a number
        to measure again; ``None`` when missing or not readable."""
        row = self._row(key)
        try:
            return None if row is None else _entry(row)
        except ValueError:  # not JSON: no record to go by
            return None

    def _row(self, key: str) -> tuple[Any, ...] | None:
        """The stored row under ``key`` for this machine's fingerprint (``None``: none, or the
        cache cannot be read)."""
        if not self.usable:
            return None
        assert self._db is not None
        try:
            row = self._db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM entries WHERE key = ? AND fingerprint = ?",
                (key, self.fingerprint)).fetchone()
        except sqlite3.Error as exc:
            self._off(exc, "reading", reads=True)
            return None
        return None if row is None else tuple(row)

    def delete(self, key: str) -> None:
        """Delete this machine's entry under ``key``, if any."""
        self._delete("key = ? AND fingerprint = ?", [key, self.fingerprint])

    def get(self, key: str, check: Callable[[Any], bool] | None = None) -> Any:
        """The record under ``key`` (see :meth:`entry`), or ``None``."""
        found = self.entry(key, check)
        return None if found is None else found.value

    def records(self, kind: str) -> list[tuple[str, Any]]:
        """``(key, record)`` of every entry of ``kind`` on this machine's fingerprint (what a
        fit of the cost model reads: noisy ones too, as planning reuses them, their spread
        widening the fit's); empty when the cache cannot be read or is refreshed (everything
        is measured again)."""
        if not self.usable or self.refresh:
            return []
        assert self._db is not None
        try:
            rows = self._db.execute(
                "SELECT key, value FROM entries WHERE fingerprint = ? AND kind = ?",
                (self.fingerprint, kind)).fetchall()
        except sqlite3.Error as exc:
            self._off(exc, "reading", reads=True)
            return []
        out = []
        for key, value in rows:
            try:
                out.append((str(key), json.loads(value)))
            except ValueError:
                continue
        return out

    def put(self, key: str, value: Any, *, spread: float | None = None,
            conditions: Conditions | None = None, is_noisy: bool | None = None) -> None:
        """Store ``value`` with the conditions it was measured under (default: now) and the
        spread of its rounds; noisy when the machine was busy or the spread is beyond
        ``machine.SPREAD_LIMIT``, unless ``is_noisy`` says otherwise (a decision from
        interleaved ratios weighs its own spread)."""
        if not self._writes or self._db is None:
            return
        conditions = conditions or self._conditions()
        row = (key, self.fingerprint, kind_of(key), json.dumps(value),
               conditions.load_average, conditions.cpu_count, spread,
               int(conditions.busy or noisy(spread) if is_noisy is None else is_noisy),
               conditions.taken_at or now_utc())
        try:
            with self._db:
                self._db.execute(f"INSERT OR REPLACE INTO entries ({', '.join(COLUMNS)}) "
                                 f"VALUES ({', '.join('?' * len(COLUMNS))})", row)
        except sqlite3.Error as exc:
            # a read-only file still serves reads; anything else (a lock) turns it off
            readonly = "readonly" in str(exc).lower()
            self._off(exc, "writing", reads=not readonly)
            return
        self._written.add(key)

    @contextlib.contextmanager
    def remeasuring(self) -> Iterator[CostCache]:
        """Within it, every record read is missing until written again (as ``refresh``)."""
        saved = self.refresh, self._written
        self.refresh, self._written = True, set()
        try:
            yield self
        finally:
            self.refresh, self._written = saved[0], saved[1] | self._written

    # ------------------------------------------------------------ the file as a whole

    def summary(self) -> CacheSummary:
        """The entries grouped by kind, fingerprint and noise, with their ages and loads."""
        size = self.path.stat().st_size if self.path.is_file() else 0
        if self._db is None and self.problem is None and self._reads:
            return CacheSummary(self.path, size, self.fingerprint, ())  # empty, or no file
        if not self.usable:
            return CacheSummary(self.path, size, self.fingerprint, (),
                                self.problem or "could not be read")
        assert self._db is not None
        try:
            rows = self._db.execute(
                "SELECT kind, fingerprint, noisy, COUNT(*), MIN(taken_at), MAX(taken_at), "
                "MAX(load_average) FROM entries GROUP BY kind, fingerprint, noisy "
                "ORDER BY fingerprint, kind, noisy").fetchall()
        except sqlite3.Error as exc:
            return CacheSummary(self.path, size, self.fingerprint, (), str(exc))
        return CacheSummary(self.path, size, self.fingerprint,
                            tuple(CacheGroup(k, f, bool(n), c, lo, hi, load)
                                  for k, f, n, c, lo, hi, load in rows))

    def prune(self, *, older_than_days: float | None = None, noisy_only: bool = False,
              other_machines: bool = False) -> int:
        """Delete entries older than ``older_than_days``, noisy ones, and/or those of another
        fingerprint (any of the criteria given); returns how many."""
        clauses: list[str] = []
        args: list[Any] = []
        if older_than_days is not None:
            cutoff = (datetime.datetime.now(datetime.timezone.utc)
                      - datetime.timedelta(days=older_than_days))
            clauses.append("taken_at < ?")
            args.append(cutoff.isoformat(timespec="seconds"))
        if noisy_only:
            clauses.append("noisy = 1")
        if other_machines:
            clauses.append("fingerprint != ?")
            args.append(self.fingerprint)
        if not clauses:
            return 0
        return self._delete(" OR ".join(clauses), args)

    def clear(self) -> int:
        """Delete every entry; returns how many."""
        return self._delete("1 = 1", [])

    def _delete(self, where: str, args: list[Any]) -> int:
        if self._db is None or not self._writes:
            return 0
        try:
            with self._db:
                return self._db.execute(f"DELETE FROM entries WHERE {where}", args).rowcount
        except sqlite3.Error as exc:
            self._off(exc, "deleting", reads=False)
            return 0

    def export_table(self, path: Path | str, *, busy: bool = False) -> ExportReport:
        """Write this machine's entries (its fingerprint only) to ``path`` as a cost-table
        file, replacing it whole (``files.write_atomic``), one entry a line sorted by key.
        Noisy entries taken on a quiet machine (their rounds spread: the op's own) go with
        their mark, as this machine reuses them; those taken on a busy machine are left out
        unless ``busy`` (a quiet machine measures them again, so they would only carry a busy
        day's numbers). Raises :class:`CostTableError` when the cache cannot be read.

        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> quiet = Conditions(load_average=0.3, cpu_count=2, threads=2, omp_wait_policy="")
        >>> store = CostCache(folder / "costs.sqlite", conditions=lambda: quiet)
        >>> store.put('["node", "conv"]', {"s": 0.5, "out": 0}, spread=0.1)
        >>> store.export_table(folder / "costs.jsonl").exported
        1
        >>> CostCache(folder / "empty.sqlite").import_table(folder / "costs.jsonl").added
        1
        """
        path = Path(path)
        if self.problem is not None or (self._db is None and self.path.is_file()):
            raise CostTableError(f"the cache {self.path} cannot be read "
                                 f"({self.problem or 'opening it failed'}); nothing was exported")
        rows: list[tuple[Any, ...]] = []
        if self._db is not None:
            try:
                rows = self._db.execute(
                    f"SELECT {', '.join(COLUMNS)} FROM entries ORDER BY key").fetchall()
            except sqlite3.Error as exc:
                raise CostTableError(f"the cache {self.path} cannot be read now ({exc}); "
                                     "nothing was exported") from exc
        kept: list[Entry] = []
        left_busy = others = unreadable = 0
        for row in rows:
            if row[1] != self.fingerprint:
                others += 1
                continue
            try:
                found = _entry(row)
            except (ValueError, TypeError):
                unreadable += 1
                continue
            if found.noisy and found.taken_busy and not busy:
                left_busy += 1
                continue
            kept.append(found)
        try:
            write_atomic(path, table_text(self.fingerprint, kept, busy=busy))
        except OSError as exc:
            raise CostTableError(f"cannot write the cost table {path} "
                                 f"({exc.strerror or exc})") from exc
        return ExportReport(path, self.fingerprint, len(kept), left_busy, others, unreadable)

    def import_table(self, path: Path | str) -> ImportReport:
        """Take in the cost-table file at ``path`` (:meth:`export_table`'s), all of it in one
        transaction or nothing. Under a key this cache holds already the newer entry (by
        ``taken_at``) is kept; a tie keeps the local one. Raises :class:`OtherMachineError`
        for a table of another fingerprint, :class:`CostTableError` for a file that is no
        cost table, a damaged one, or a cache that cannot be written."""
        table = read_cost_table(path, machine=self.fingerprint)
        if self._db is None or not self._writes:
            raise CostTableError(f"the cache {self.path} cannot be written "
                                 f"({self.problem or 'read-only, or locked'}); nothing was "
                                 "imported")
        added = replaced = skipped = 0
        insert = (f"INSERT OR REPLACE INTO entries ({', '.join(COLUMNS)}) "
                  f"VALUES ({', '.join('?' * len(COLUMNS))})")
        try:
            with self._db:  # one transaction: all of the table, or nothing
                for e in table.entries:
                    local = self._db.execute(
                        "SELECT taken_at FROM entries WHERE key = ? AND fingerprint = ?",
                        (e.key, self.fingerprint)).fetchone()
                    if local is not None and not newer(e.taken_at, str(local[0])):
                        skipped += 1
                        continue
                    self._db.execute(insert, (
                        e.key, self.fingerprint, e.kind, json.dumps(e.value), e.load_average,
                        e.cpu_count, e.spread, int(e.noisy), e.taken_at))
                    if local is None:
                        added += 1
                    else:
                        replaced += 1
        except sqlite3.Error as exc:
            raise CostTableError(f"the cache {self.path} failed while importing {table.path} "
                                 f"({type(exc).__name__}: {exc}); nothing was imported") from exc
        return ImportReport(table.path, self.fingerprint, added, replaced, skipped)

    def close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None


def _entry(row: tuple[Any, ...]) -> Entry:
    key, fp, kind, value, load, cpus, spread, is_noisy, taken = row
    return Entry(key, str(kind), json.loads(value), str(fp),
                 None if load is None else float(load), None if cpus is None else int(cpus),
                 None if spread is None else float(spread), bool(is_noisy), str(taken))

