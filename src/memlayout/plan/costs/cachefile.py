"""What a measurement-cache file is (L2 plan): its schema, memlayout's SQLite
``application_id``, and whether a file on disk is one memlayout created (read only: a file
that is not is never touched; ``memlayout.plan.costs.cache``)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA = 2  # ``PRAGMA user_version`` of a cache file this code reads
#: ``PRAGMA application_id`` of every cache file memlayout creates ("MLay"): only a file that
#: carries it (or holds exactly this schema, written before the id was set) is memlayout's
APPLICATION_ID = int.from_bytes(b"MLay", "big")
SQLITE_HEADER = b"SQLite format 3\x00"
#: seconds a read or write waits for another process's lock before the cache is turned off
#: (a planning run commits one small row at a time: a longer lock is a stuck process)
TIMEOUT = 1.0
COLUMNS = ("key", "fingerprint", "kind", "value", "load_average", "cpu_count", "spread",
           "noisy", "taken_at")
CREATE = """CREATE TABLE entries (
    key TEXT NOT NULL, fingerprint TEXT NOT NULL, kind TEXT NOT NULL, value TEXT NOT NULL,
    load_average REAL, cpu_count INTEGER, spread REAL, noisy INTEGER NOT NULL,
    taken_at TEXT NOT NULL, PRIMARY KEY (key, fingerprint))"""
#: what a file memlayout created may have become, said in a warning
PROBLEMS = {"corrupt": "not a readable SQLite database",
            "foreign": "written with another schema (another memlayout version)"}


def application_id(path: Path) -> int | None:
    """The SQLite ``application_id`` in the file's header, ``None`` for a file too short or
    not SQLite's (read from the header: a corrupt database still tells whose it is)."""
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except OSError:
        return None
    if len(head) < 72 or not head.startswith(SQLITE_HEADER):
        return None
    return int.from_bytes(head[68:72], "big")


def foreign_reason(path: Path | str) -> str | None:
    """Why the file at ``path`` is not a measurement cache memlayout created, or ``None``: it
    is one, or there is no file (or an empty one) yet. Reads only; a lock held on an SQLite
    file raises ``sqlite3.OperationalError``.

    >>> import tempfile, pathlib
    >>> other = pathlib.Path(tempfile.mkdtemp()) / "app.db"
    >>> _ = other.write_bytes(b"not a database")
    >>> foreign_reason(other)
    'a file that is not an SQLite database'
    """
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return None
    app = application_id(path)
    if app is None:
        return "a file that is not an SQLite database"
    if app == APPLICATION_ID:
        return None
    if app != 0:
        return f"another application's SQLite database (application_id {app:#x})"
    # no application id: memlayout's own cache written before it set one holds exactly its
    # table, at its schema version; anything else is someone else's
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=TIMEOUT)
    except sqlite3.Error:
        return "an SQLite database memlayout cannot open"
    try:
        tables = sorted(r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'"))
        version = db.execute("PRAGMA user_version").fetchone()[0]
        columns = {r[1] for r in db.execute("PRAGMA table_info(entries)")}
    except sqlite3.OperationalError:
        raise  # a lock: whose it is cannot be told now
    except sqlite3.DatabaseError:
        return "an SQLite database that cannot be read, without memlayout's application id"
    finally:
        db.close()
    if tables == ["entries"] and version == SCHEMA and columns == set(COLUMNS):
        return None
    return (f"an SQLite database of another application (tables: "
            f"{', '.join(tables) or 'none'})")


def schema_problem(db: sqlite3.Connection) -> str | None:
    """``None`` (this schema), ``"empty"``, ``"corrupt"`` or ``"foreign"``; raises
    ``OperationalError`` when the file cannot be read now (a lock)."""
    check = db.execute("PRAGMA quick_check").fetchone()
    if check is None or check[0] != "ok":
        return "corrupt"
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        return "empty"
    version = db.execute("PRAGMA user_version").fetchone()[0]
    columns = {r[1] for r in db.execute("PRAGMA table_info(entries)")}
    if version != SCHEMA or columns != set(COLUMNS):
        return "foreign"
    return None
