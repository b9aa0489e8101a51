"""The measurement cache can never stop a run: a read-only file, a lock held by another
process, another schema, records of an unexpected shape and a corrupt file each give one
warning and a plan. Only a file memlayout created is ever moved aside (corrupt, or of another
schema version) and rebuilt; another application's file, or bytes that are no database, are
left exactly as they are. Entries carry the machine's fingerprint and conditions;
``memlayout cache`` shows (moving nothing), prunes and clears them, and refuses a file that is
not a memlayout cache."""

from __future__ import annotations

import json
import sqlite3
import warnings

import pytest
from typer.testing import CliRunner

import memlayout
from memlayout.cli import app
from memlayout.machine import Conditions
from memlayout.plan.capture.regions import capture
from memlayout.plan.costs import cache as cache_module
from memlayout.plan.costs.cache import CacheWarning, CostCache
from memlayout.plan.costs.measure import measure_costs
from tests.support.machine import AVX2, AVX512, as_cpu
from tests.support.models import Branchy, Features
from tests.support.models import batch as _x

QUIET = Conditions(0.5, 2, 2, "PASSIVE", "2026-12-01T10:00:00+00:00")
BUSY = Conditions(9.0, 2, 2, "PASSIVE", "2026-12-01T10:00:00+00:00")


@pytest.fixture
def db(tmp_path):
    return tmp_path / "costs.sqlite"


def _plan(model, db, **kwargs):
    """Plan ``model`` with the cache at ``db``; the cache warnings it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = memlayout.optimize(model, _x(), cache=db, rounds=1, guard_rounds=2, **kwargs)
    assert opt.plan.verification.ok
    return opt, [w for w in seen if issubclass(w.category, CacheWarning)]


def _aside(db, what: str) -> list:
    return sorted(db.parent.glob(f"{db.name}.{what}-*"))


@pytest.mark.faults
def test_a_read_only_cache_serves_what_it_has_and_plans_the_rest(db, monkeypatch) -> None:
    _plan(Features().eval(), db)
    real = sqlite3.connect
    # a file this process may read but not write (root ignores file modes: open it read-only)
    monkeypatch.setattr(sqlite3, "connect", lambda path, **kw: real(
        f"file:{path}?mode=ro", uri=True, **{k: v for k, v in kw.items() if k != "uri"}))
    opt, warned = _plan(Branchy().eval(), db)  # new entries needed: writing fails
    assert len(warned) == 1 and "read-only for this run" in str(warned[0].message)
    assert opt.plan.measured > 0


@pytest.mark.faults
def test_a_lock_held_mid_run_turns_the_cache_off_with_one_warning(db) -> None:
    gm = capture(Branchy().eval(), (_x(),)).regions[0].gm
    store = CostCache(db, timeout=0.05)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process holds the file
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            table = measure_costs(gm, (_x(),), cache=store, rounds=1)
    finally:
        other.execute("ROLLBACK")
        other.close()
    warned = [w for w in seen if issubclass(w.category, CacheWarning)]
    assert len(warned) == 1 and "locked" in str(warned[0].message)
    assert table.measured > 0 and not store.usable
    store.close()


def _memlayouts(db, entries: int = 200) -> bytes:
    """A cache memlayout wrote, with pages enough to corrupt; its bytes."""
    store = CostCache(db, conditions=lambda: QUIET)
    for i in range(entries):
        store.put(json.dumps(["node", i]), {"s": 1.0, "out": 0, "pad": "x" * 40})
    store.close()
    return db.read_bytes()


@pytest.mark.faults
@pytest.mark.parametrize("create", [
    "CREATE TABLE costs (key TEXT PRIMARY KEY, val TEXT)",  # another program's table
    "CREATE TABLE entries (key TEXT PRIMARY KEY, value TEXT)",  # our name, other columns
])
def test_another_applications_database_is_never_moved_and_planning_goes_on(db, create) -> None:
    with sqlite3.connect(db) as con:
        con.execute(create)
        con.execute("INSERT INTO " + create.split()[2] + " VALUES ('k', 'v')")
    con.close()
    before = db.read_bytes()
    for _ in range(2):  # every run leaves it alone and says so
        opt, warned = _plan(Branchy().eval(), db)
        assert len(warned) == 1 and "not a memlayout measurement cache" in str(warned[0].message)
        assert "left as it is" in str(warned[0].message) and opt.plan.measured > 0
    assert db.read_bytes() == before and sorted(db.parent.iterdir()) == [db]


@pytest.mark.faults
def test_memlayouts_cache_of_another_schema_is_moved_aside_and_rebuilt(db) -> None:
    _memlayouts(db, entries=3)
    with sqlite3.connect(db) as con:
        con.execute("PRAGMA user_version = 1")  # as an older memlayout wrote it
    con.close()
    first, warned = _plan(Branchy().eval(), db)
    assert len(warned) == 1 and "another schema" in str(warned[0].message)
    assert len(_aside(db, "foreign")) == 1 and first.plan.measured > 0
    again, warned = _plan(Branchy().eval(), db)  # repaired: read, no warning
    assert not warned and again.plan.measured == 0


def test_a_cache_written_before_the_application_id_is_read_and_marked(db) -> None:
    _memlayouts(db, entries=3)
    with sqlite3.connect(db) as con:
        con.execute("PRAGMA application_id = 0")  # as memlayout wrote it before setting one
    con.close()
    store = CostCache(db, conditions=lambda: QUIET)
    assert store.get(json.dumps(["node", 0])) is not None and store.problem is None
    store.close()
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA application_id").fetchone()[0] == cache_module.APPLICATION_ID
    con.close()


@pytest.mark.faults
def test_bytes_that_are_no_database_are_left_alone(db) -> None:
    db.write_bytes(b"\x00not a database\xff" * 300)
    before = db.read_bytes()
    first, warned = _plan(Branchy().eval(), db)
    assert len(warned) == 1 and "not an SQLite database" in str(warned[0].message)
    assert db.read_bytes() == before and sorted(db.parent.iterdir()) == [db]
    assert first.plan.measured > 0


@pytest.mark.faults
def test_memlayouts_corrupt_cache_is_moved_aside_once_and_rebuilt(db) -> None:
    data = bytearray(_memlayouts(db))
    data[100:4096] = b"\xff" * (4096 - 100)  # the header (memlayout's id) kept, its pages gone
    db.write_bytes(bytes(data))
    with pytest.raises(sqlite3.DatabaseError):  # what SQLite makes of it
        sqlite3.connect(db).execute("PRAGMA quick_check").fetchall()
    first, warned = _plan(Branchy().eval(), db)
    assert len(warned) == 1 and "not a readable SQLite database" in str(warned[0].message)
    assert _aside(db, "corrupt")[0].read_bytes() == bytes(data)
    again, warned = _plan(Branchy().eval(), db)
    assert not warned and again.plan.measured == 0 and again.plan.guard.source == "cache"


@pytest.mark.parametrize("bad", ["{oops", "[1, 2]", '{"s": "fast", "out": 0}', '{"x": 1}',
                                 "null", '{"ratios": 3, "rounds": "many"}'])
@pytest.mark.faults
def test_records_of_an_unexpected_shape_are_measured_again(db, bad) -> None:
    model = Branchy().eval()
    _plan(model, db)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE entries SET value = ?", (bad,))
    con.close()
    again, warned = _plan(model, db)
    assert len(warned) == 1 and "unexpected shape" in str(warned[0].message)
    assert again.plan.measured > 0 and again.plan.cached == 0
    third, warned = _plan(model, db)  # the bad records were overwritten
    assert not warned and third.plan.measured == 0


def test_another_machine_fingerprint_is_never_read(db, monkeypatch) -> None:
    first = CostCache(db, conditions=lambda: QUIET)
    first.put('["node", "conv"]', {"s": 1.0, "out": 0})
    first.close()
    monkeypatch.setattr(cache_module, "fingerprint", lambda: "another CPU|threads=1|torch=x|omp=default")
    other = CostCache(db, conditions=lambda: QUIET)
    assert other.get('["node", "conv"]') is None  # e.g. another thread count's numbers
    other.put('["node", "conv"]', {"s": 2.0, "out": 0})
    assert other.get('["node", "conv"]') == {"s": 2.0, "out": 0}
    groups = other.summary().groups
    assert len(groups) == 2 and "another CPU|threads=1|torch=x|omp=default" in {
        g.fingerprint for g in groups}  # both kept, each for its own machine


def test_timings_under_one_instruction_set_are_never_read_under_another(db, monkeypatch) -> None:
    # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU runs other kernels: its costs are its own
    as_cpu(monkeypatch, AVX512)
    wide = CostCache(db, conditions=lambda: QUIET)
    wide.put('["node", "conv"]', {"s": 1.0, "out": 0})
    wide.close()
    as_cpu(monkeypatch, AVX2)
    narrow = CostCache(db, conditions=lambda: QUIET)
    assert narrow.fingerprint != wide.fingerprint
    assert narrow.get('["node", "conv"]') is None
    as_cpu(monkeypatch, AVX512)
    assert CostCache(db, conditions=lambda: QUIET).get('["node", "conv"]') == {"s": 1.0, "out": 0}


def test_each_entry_records_its_conditions_and_noise(db) -> None:
    store = CostCache(db, conditions=lambda: QUIET)
    store.put('["node", "a"]', {"s": 1.0, "out": 0}, spread=0.05)
    store.put('["node", "b"]', {"s": 1.0, "out": 0}, spread=0.05, conditions=BUSY)
    store.put('["guard", "c"]', {"ratios": {}, "rounds": 3}, spread=25.0)
    a, b, c = (store.entry(k) for k in ('["node", "a"]', '["node", "b"]', '["guard", "c"]'))
    assert (a.noisy, b.noisy, c.noisy) == (False, True, True)  # written this run: read back
    assert (a.load_average, b.load_average, a.cpu_count, a.spread) == (0.5, 9.0, 2, 0.05)
    assert a.taken_at == QUIET.taken_at
    later = CostCache(db, conditions=lambda: QUIET)
    assert later.get('["node", "a"]') is not None and later.get('["node", "b"]') is None
    assert later.entry('["guard", "c"]').noisy  # taken quiet, spread anyway: reused, said noisy
    busy_later = CostCache(db, conditions=lambda: BUSY)  # busy now: reused, said noisy
    assert busy_later.entry('["node", "b"]').noisy


def test_cache_verb_shows_prunes_and_clears(db) -> None:
    store = CostCache(db, conditions=lambda: QUIET)
    for i in range(40):
        store.put(json.dumps(["node", i]), {"s": 1.0, "out": 0}, spread=0.05)
    for i in range(7):
        store.put(json.dumps(["convert", i]), {"s": 1.0}, spread=0.05, conditions=BUSY)
    store.put(json.dumps(["guard", 0]), {"ratios": {}, "rounds": 1},
              conditions=Conditions(0.5, 2, 2, "PASSIVE", "2020-01-01T00:00:00+00:00"))
    store.close()
    runner = CliRunner()
    shown = runner.invoke(app, ["cache", "show", "--path", str(db)])
    assert shown.exit_code == 0, shown.output
    assert str(db) in shown.output and "48 entries" in shown.output
    assert len(shown.output.splitlines()) < 20  # grouped, not one line per entry
    assert "7 noisy entries" in shown.output
    noisy = runner.invoke(app, ["cache", "prune", "--noisy", "--path", str(db)])
    assert noisy.exit_code == 0 and "pruned 7 entries" in noisy.output and "41 left" in noisy.output
    old = runner.invoke(app, ["cache", "prune", "--older-than", "30", "--path", str(db)])
    assert "pruned 1 entries" in old.output and "40 left" in old.output
    bare = runner.invoke(app, ["cache", "prune", "--path", str(db)])
    assert bare.exit_code == 2 and "--older-than" in bare.output
    cleared = runner.invoke(app, ["cache", "clear", "--path", str(db)])
    assert "cleared 40 entries" in cleared.output
    assert CostCache(db).summary().count == 0


@pytest.mark.faults
@pytest.mark.parametrize("verb", [["show"], ["prune", "--noisy"], ["clear"]])
def test_cache_verbs_refuse_another_applications_file_and_never_touch_it(tmp_path, verb) -> None:
    app_db = tmp_path / "app.db"
    with sqlite3.connect(app_db) as con:
        con.execute("CREATE TABLE users (id INTEGER, name TEXT)")
        con.execute("INSERT INTO users VALUES (1, 'a')")
    con.close()
    before = app_db.read_bytes()
    res = CliRunner().invoke(app, ["cache", *verb, "--path", str(app_db)])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert text.startswith("error:") and str(app_db) in text and "Traceback" not in text
    assert "not a memlayout measurement cache" in text and "users" in text
    assert app_db.read_bytes() == before and sorted(tmp_path.iterdir()) == [app_db]


@pytest.mark.faults
def test_cache_show_reports_a_corrupt_cache_and_moves_nothing(db) -> None:
    data = bytearray(_memlayouts(db))
    data[100:4096] = b"\xff" * (4096 - 100)
    db.write_bytes(bytes(data))
    res = CliRunner().invoke(app, ["cache", "show", "--path", str(db)])
    assert res.exit_code == 0, res.output
    assert "not a readable SQLite database" in " ".join(res.output.split())
    assert db.read_bytes() == bytes(data) and sorted(db.parent.iterdir()) == [db]


def test_cache_verb_on_a_missing_file_creates_nothing(tmp_path) -> None:
    db = tmp_path / "none.sqlite"
    shown = CliRunner().invoke(app, ["cache", "show", "--path", str(db)])
    assert shown.exit_code == 0 and "no cache at" in shown.output and not db.exists()


def test_optimize_states_the_conditions_before_it_measures(tmp_path, monkeypatch) -> None:
    model = tmp_path / "tiny.py"
    model.write_text("import torch\nfrom torch import nn\n\n"
                     "def net():\n    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), "
                     "nn.Conv2d(8, 4, 3))\n")
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("os.getloadavg", lambda: (9.0, 9.0, 9.0))
    result = CliRunner().invoke(app, ["optimize", f"{model}:net", "--batch", "1",
                                      "--image-size", "16", "--rounds", "0"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "conditions: load 9.0 on" in out and "OMP_WAIT_POLICY=" in out
    assert out.index("costs measured now are marked noisy") < out.index("layout nodes")
    assert "costs noisy" in out  # and the plan says what came of it
