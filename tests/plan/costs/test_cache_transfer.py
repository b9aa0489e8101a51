"""``memlayout cache export|import``: a cost table measured once travels to machines of the same
fingerprint, and planning there measures nothing. A table of another fingerprint, a damaged
one, or a file that is none is refused in one line, and the cache is left exactly as it was:
an import is one transaction, all of the table or nothing."""

from __future__ import annotations

import json
import sqlite3
import warnings

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import memlayout
from memlayout import machine
from memlayout.cli import app
from memlayout.machine import Conditions
from memlayout.plan.costs import cache as cache_module
from memlayout.plan.costs.cache import CacheWarning, CostCache
from memlayout.plan.costs.transfer import CostTableError, OtherMachineError, read_cost_table
from tests.support.models import batch as _x

QUIET = Conditions(0.5, 2, 2, "PASSIVE", "2026-12-01T10:00:00+00:00")
BUSY = Conditions(9.0, 2, 2, "PASSIVE", "2026-12-01T10:00:00+00:00")
LATER = Conditions(0.5, 2, 2, "PASSIVE", "2026-12-02T10:00:00+00:00")
OTHER = "another CPU|threads=1|torch=x|omp=default|isa=DEFAULT"


def _cli(*args: str):
    return CliRunner().invoke(app, ["cache", *map(str, args)])


def _rows(db) -> list[tuple]:
    """Every row of a cache file, as SQLite holds it (empty where there is no file)."""
    if not db.exists():
        return []
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT * FROM entries ORDER BY key, fingerprint").fetchall()
    finally:
        con.close()


def _refused(result, *words: str) -> str:
    """A CLI refusal: exit code 2, one error line, no traceback; its text, unwrapped."""
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error:") and text.count("error:") == 1 and "Traceback" not in text
    for word in words:
        assert word in text, (word, text)
    return text


@pytest.fixture
def table(tmp_path):
    """A cost table of this machine with three entries, and the cache it was exported from."""
    db = tmp_path / "source" / "costs.sqlite"
    store = CostCache(db, conditions=lambda: QUIET)
    for name in ("a", "b", "c"):
        store.put(json.dumps(["node", name]), {"s": 1.0, "out": 0}, spread=0.05)
    out = tmp_path / "costs.jsonl"
    store.export_table(out)
    store.close()
    return out


def test_planning_after_an_import_into_an_empty_cache_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (0.1, 0.1, 0.1))  # no entry taken busy
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 3))
    first_db, second_db = tmp_path / "one" / "costs.sqlite", tmp_path / "two" / "costs.sqlite"

    def plan(db, reuse=True):
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheWarning)
            opt = memlayout.optimize(net.eval(), _x(), cache=db, rounds=1, guard_rounds=2,
                                     reuse=reuse)
        assert opt.plan.verification.ok
        return opt.plan

    first = plan(first_db)
    assert first.measured > 0
    exported = _cli("export", tmp_path / "costs.jsonl", "--path", first_db)
    assert exported.exit_code == 0, exported.output
    imported = _cli("import", tmp_path / "costs.jsonl", "--path", second_db)
    assert imported.exit_code == 0, imported.output
    count = len(_rows(first_db))
    assert f"exported {count} entries" in exported.output
    assert f"imported {count} entries" in " ".join(imported.output.split())
    assert _rows(second_db) == _rows(first_db)  # every column as measured
    again = plan(second_db, reuse=False)  # from the imported costs
    assert again.measured == 0 and again.cached > 0 and again.guard.source == "cache"
    assert [n.format for n in again.nodes] == [n.format for n in first.nodes]
    stored = plan(second_db)  # the imported plan itself, rebuilt and verified
    assert stored.measured == 0 and stored.guard.source == "cache"
    assert [n.format for n in stored.nodes] == [n.format for n in first.nodes]


def test_the_header_says_whose_timings_and_what_wrote_them(table):
    lines = table.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["fingerprint"] == machine.fingerprint()
    assert (header["memlayout"], header["torch"]) == (memlayout.__version__, torch.__version__)
    assert header["count"] == len(lines) - 1 == 3
    read = read_cost_table(table)
    assert [e.key for e in read.entries] == [json.dumps(["node", n]) for n in "abc"]
    assert read.header.exported_at >= QUIET.taken_at


def test_export_takes_this_machines_entries_and_leaves_busy_ones_out(tmp_path, monkeypatch):
    db = tmp_path / "costs.sqlite"
    store = CostCache(db, conditions=lambda: QUIET)
    store.put('["node", "quiet"]', {"s": 1.0, "out": 0}, spread=0.05)
    store.put('["node", "spread"]', {"s": 1.0, "out": 0}, spread=25.0)  # the op's own spread
    store.put('["node", "busy"]', {"s": 1.0, "out": 0}, spread=0.05, conditions=BUSY)
    store.close()
    monkeypatch.setattr(cache_module, "fingerprint", lambda: OTHER)
    CostCache(db, conditions=lambda: QUIET).put('["node", "elsewhere"]', {"s": 2.0, "out": 0})
    monkeypatch.undo()

    result = _cli("export", tmp_path / "quiet.jsonl", "--path", db)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "exported 2 entries" in text and "1 taken on a busy machine" in text
    assert "1 of other machines" in text
    quiet = {e.key: e for e in read_cost_table(tmp_path / "quiet.jsonl").entries}
    assert set(quiet) == {'["node", "quiet"]', '["node", "spread"]'}
    assert quiet['["node", "spread"]'].noisy and not quiet['["node", "quiet"]'].noisy

    assert _cli("export", tmp_path / "all.jsonl", "--busy", "--path", db).exit_code == 0
    everything = read_cost_table(tmp_path / "all.jsonl")
    assert everything.header.busy and len(everything.entries) == 3


@pytest.mark.parametrize(("local", "imported", "kept", "replaced"), [
    (QUIET, LATER, "imported", 1),  # the table's is newer: it replaces the local one
    (LATER, QUIET, "local", 0),  # the local one is newer: kept
    (QUIET, QUIET, "local", 0),  # as new: the local one is kept
])
def test_of_two_entries_under_one_key_the_newer_is_kept(tmp_path, local, imported, kept,
                                                        replaced):
    source = CostCache(tmp_path / "source.sqlite", conditions=lambda: imported)
    source.put('["node", "conv"]', {"s": 1.0, "out": 0}, spread=0.05)
    source.put('["node", "new"]', {"s": 3.0, "out": 0}, spread=0.05)
    source.export_table(tmp_path / "costs.jsonl")
    target = CostCache(tmp_path / "target.sqlite", conditions=lambda: local)
    target.put('["node", "conv"]', {"s": 2.0, "out": 0}, spread=0.05)
    report = target.import_table(tmp_path / "costs.jsonl")
    assert (report.added, report.replaced, report.skipped) == (1, replaced, 1 - replaced)
    found = target.entry('["node", "conv"]')
    expected = {"imported": (imported, 1.0), "local": (local, 2.0)}[kept]
    assert (found.taken_at, found.value) == (expected[0].taken_at, {"s": expected[1], "out": 0})
    assert target.get('["node", "new"]') == {"s": 3.0, "out": 0}


def test_a_table_of_another_fingerprint_is_refused_naming_both(table, tmp_path, monkeypatch):
    db = tmp_path / "target" / "costs.sqlite"
    monkeypatch.setattr(cache_module, "fingerprint", lambda: OTHER)
    monkeypatch.setattr(machine, "fingerprint", lambda: OTHER)
    with pytest.raises(OtherMachineError) as refused:
        CostCache(db).import_table(table)
    theirs = json.loads(table.read_text().splitlines()[0])["fingerprint"]
    assert (refused.value.theirs, refused.value.ours) == (theirs, OTHER)
    assert len(str(refused.value).splitlines()) == 1 and _rows(db) == []
    db.unlink()
    _refused(_cli("import", table, "--path", db), theirs, OTHER, "nothing was imported")
    assert not db.exists()  # refused before a cache was made for it


def test_a_header_edited_to_another_fingerprint_is_refused(table, tmp_path):
    lines = table.read_text().splitlines()
    header = json.loads(lines[0])
    header["fingerprint"] = OTHER
    table.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    db = tmp_path / "target" / "costs.sqlite"
    _refused(_cli("import", table, "--path", db), OTHER, machine.fingerprint())
    assert not db.exists()


def _cut_short(lines):
    return lines[:-1]


def _damaged_line(lines):
    return [*lines[:2], "{oops", *lines[2:]]


def _wrong_type(lines):
    entry = json.loads(lines[2])
    entry["noisy"] = "no"
    return [*lines[:2], json.dumps(entry), *lines[3:]]


def _extra_field(lines):
    entry = json.loads(lines[3])
    entry["fingerprint"] = OTHER
    return [*lines[:3], json.dumps(entry)]


def _bad_time(lines):
    entry = json.loads(lines[3])
    entry["taken_at"] = "yesterday"
    return [*lines[:3], json.dumps(entry)]


def _twice(lines):
    header = json.loads(lines[0])
    header["count"] += 1
    return [json.dumps(header), *lines[1:], lines[1]]


def _newer_layout(lines):
    header = json.loads(lines[0])
    header["version"] += 1
    return [json.dumps(header), *lines[1:]]


def _other_json(lines):
    return ['{"name": "a package manifest"}']


DAMAGED = [(_cut_short, "cut short"), (_damaged_line, "line 3"), (_wrong_type, "'noisy'"),
           (_extra_field, "exactly the fields"), (_bad_time, "line 4"),
           (_twice, "comes twice"), (_newer_layout, "layout version"),
           (_other_json, "not a cost table")]


@pytest.mark.faults
@pytest.mark.parametrize(("damage", "words"), DAMAGED, ids=[d.__name__ for d, _ in DAMAGED])
def test_a_damaged_or_foreign_file_is_refused_and_nothing_is_imported(table, tmp_path, damage,
                                                                      words):
    table.write_text("\n".join(damage(table.read_text().splitlines())) + "\n")
    db = tmp_path / "target" / "costs.sqlite"
    store = CostCache(db, conditions=lambda: QUIET)
    store.put('["node", "mine"]', {"s": 5.0, "out": 0}, spread=0.05)
    before = _rows(db)
    with pytest.raises(CostTableError) as refused:
        store.import_table(table)
    assert len(str(refused.value).splitlines()) == 1 and words in str(refused.value)
    store.close()
    _refused(_cli("import", table, "--path", db), str(table), "nothing was imported")
    assert _rows(db) == before


@pytest.mark.faults
@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00binary", "cache"])
def test_bytes_and_databases_that_are_no_table_are_refused(tmp_path, content):
    file = tmp_path / "costs.jsonl"
    if content == "cache":  # the cache file itself, given by mistake
        CostCache(file).put('["node", "a"]', {"s": 1.0, "out": 0})
        words = ["SQLite database"]
    else:
        file.write_bytes(content)
        words = ["not a cost table"]
    db = tmp_path / "target" / "costs.sqlite"
    _refused(_cli("import", file, "--path", db), *words)
    assert not db.exists()


@pytest.mark.faults
def test_an_import_that_fails_midway_leaves_the_cache_as_it_was(table, tmp_path):
    db = tmp_path / "target" / "costs.sqlite"
    store = CostCache(db, conditions=lambda: QUIET)
    store.put('["node", "mine"]', {"s": 5.0, "out": 0}, spread=0.05)
    with sqlite3.connect(db) as con:  # the last of the table's three entries fails to insert
        con.execute("""CREATE TRIGGER refuse BEFORE INSERT ON entries
                       WHEN NEW.key = '["node", "c"]' BEGIN SELECT RAISE(ABORT, 'disk full'); END""")
    con.close()
    before = _rows(db)
    with pytest.raises(CostTableError, match="disk full.*nothing was imported"):
        store.import_table(table)
    assert _rows(db) == before  # "a" and "b" went in before "c" failed: rolled back
    store.close()


def test_export_refuses_what_it_cannot_write_and_writes_nothing_without_a_cache(tmp_path):
    db = tmp_path / "costs.sqlite"
    out = tmp_path / "costs.jsonl"
    _refused(_cli("export", out, "--path", db), "nothing to export")
    assert not out.exists()
    CostCache(db).put('["node", "a"]', {"s": 1.0, "out": 0})
    _refused(_cli("export", tmp_path / "missing" / "costs.jsonl", "--path", db), "does not exist")
    _refused(_cli("export", db, "--path", db), "the cache itself")
    assert len(_rows(db)) == 1
