"""The order the whole suite's files are handed out in under `-n 2 --dist loadfile` (tests/file_order.py): the
committed table names test files that exist, the longest go first with each file's tests together, files that share a
costly fixture go together, a run that records the files' seconds writes a table the next run reads, and the suite's
command runs again where that record is already there.

    .venv/bin/python -m pytest -q tests/test_file_order.py
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from tests import file_order


@dataclass
class _Item:
    nodeid: str
    fixturenames: tuple = ()


def test_the_table_names_test_files_that_exist_longest_first():
    doc = json.loads(file_order.TABLE.read_text())
    table = file_order.load_table()
    assert table and list(table) == list(doc["seconds"])
    for path, seconds in table.items():
        assert (file_order.ROOT / path).is_file() and path.startswith("tests/") and path.endswith(".py"), path
        assert seconds >= file_order.MIN_SECONDS, path
    assert list(table.values()) == sorted(table.values(), reverse=True)
    assert doc["runs"], "the table says which runs measured it"


def test_the_longest_files_go_first_and_each_file_stays_together_in_its_order():
    items = [_Item(n) for n in ("a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2", "c.py::t3", "d.py::t1",
                                "e.py::t1")]
    table = {"c.py": 300.0, "e.py": 40.0, "gone.py": 500.0}
    got = [i.nodeid for i in file_order.longest_first(items, table)]
    assert got == ["c.py::t1", "c.py::t2", "c.py::t3", "e.py::t1",  # the table's files, longest first
                   "a.py::t1", "a.py::t2", "b.py::t1", "d.py::t1"]  # the rest in their collected order
    assert [i.nodeid for i in file_order.longest_first(items, {})] == [i.nodeid for i in items]


def test_files_linked_by_a_costly_fixture_form_one_group():
    s3, mix = ("tmp_path", "s3_dataset", "s3_corpus"), ("mixture_setup",)
    items = [_Item("a.py::t1"), _Item("b.py::t1", s3), _Item("b.py::t2"), _Item("c.py::t1", mix),
             _Item("d.py::t1", s3), _Item("e.py::t1"), _Item("f.py::t1", mix), _Item("f.py::t2", ("files_dataset",)),
             _Item("g.py::t1", ("files_dataset",))]
    # b and d share s3_dataset; c, f and g are linked through f (mixture_setup with c, files_dataset with g)
    assert file_order.groups(items) == {"a.py": "a.py", "b.py": "b.py", "d.py": "b.py", "c.py": "c.py",
                                        "f.py": "c.py", "g.py": "c.py", "e.py": "e.py"}


def test_a_group_goes_together_placed_by_its_files_seconds_added_up(monkeypatch):
    monkeypatch.setattr(file_order, "_GROUP_OF", {"b.py": "b.py", "d.py": "b.py", "c.py": "c.py", "f.py": "c.py",
                                                  "g.py": "c.py"})
    items = [_Item(n) for n in ("a.py::t1", "b.py::t1", "b.py::t2", "c.py::t1", "d.py::t1", "e.py::t1", "f.py::t1",
                                "f.py::t2", "g.py::t1")]
    table = {"a.py": 300.0, "b.py": 100.0, "d.py": 250.0, "c.py": 10.0, "g.py": 20.0, "e.py": 40.0}
    got = [i.nodeid for i in file_order.longest_first(items, table)]
    # the b+d group (350 s) before a.py (300 s), its longer file first; e.py (40 s) before c+f+g (30 s)
    assert got == ["d.py::t1", "b.py::t1", "b.py::t2", "a.py::t1", "e.py::t1", "g.py::t1", "c.py::t1", "f.py::t1",
                   "f.py::t2"]


def test_the_groups_table_holds_every_link_the_collected_fixtures_make(request):
    """GROUPS (what the scheduler hands out together) against the fixtures this session's tests use: two files
    that share a costly fixture are in one group of the table. Under the whole suite this session holds every test
    but the exclusive ones; in the quick tier, the quick ones."""
    found = file_order.groups(request.session.items)
    for f, rep in found.items():
        assert file_order.group_of(f) == file_order.group_of(rep), (
            f"{f} shares a costly fixture with {rep} (tests/file_order.py SHARED_BUILDS), so their builds run once "
            f"only if GROUPS puts them in one group")
    for files in file_order.GROUPS:
        assert all((file_order.ROOT / f).is_file() for f in files), files


def test_the_scheduler_hands_out_a_group_as_one_unit():
    scope = file_order.GroupedFiles._split_scope  # what xdist calls to know which tests go to one process together
    first, *rest = file_order.GROUPS[0]
    assert scope(None, f"{rest[0]}::test_x[a-b]") == scope(None, f"{first}::t") == first
    assert scope(None, "tests/test_docs.py::test_y") == "tests/test_docs.py"


def test_a_recorded_run_updates_the_files_it_ran_and_keeps_the_others(tmp_path):
    table = tmp_path / "slow_files.json"
    kept, gone = "tests/test_docs.py", "tests/no_such_file.py"
    table.write_text(json.dumps({"about": "x", "runs": ["before"], "seconds": {
        kept: 50, gone: 400, "tests/test_layout.py": 90, "tests/test_config_help.py": 30}}))
    rec = file_order.FileSeconds(table)
    for nodeid, seconds in (("tests/test_layout.py::a", 10.0), ("tests/test_layout.py::b", 15.5),
                            ("tests/test_config_help.py::a", 2.0), ("tests/test_gpu_check.py::a", 120.0)):
        rec.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    rec.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace(invocation_params=SimpleNamespace(
        args=("-n", "2")))))
    doc = json.loads(table.read_text())
    # ran: replaced (26 s) or dropped (2 s, under MIN_SECONDS); not run: kept, unless the file is gone
    assert doc["seconds"] == {"tests/test_gpu_check.py": 120, kept: 50, "tests/test_layout.py": 26}
    assert doc["runs"][0] == "before" and doc["runs"][-1].endswith("3 file(s) of `pytest -n 2`")
    assert file_order.load_table(table) == {"tests/test_gpu_check.py": 120.0, kept: 50.0, "tests/test_layout.py": 26.0}


@pytest.mark.system
def test_the_suite_command_runs_again_where_its_record_of_file_seconds_is_already_there(tmp_path):
    """tests/suite.sh writes $TMPDIR/longtrain-file-seconds.json; a second run on the same machine finds it there. As
    `--record-file-seconds PATH` (two arguments), pytest took the existing PATH for a test path, made its folder the
    root, never read tests/conftest.py and refused the option (exit 4, 'unrecognized arguments'): a CI run did."""
    (tmp_path / "longtrain-file-seconds.json").write_text(json.dumps({"about": "x", "runs": [], "seconds": {}}))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = subprocess.run(["bash", str(file_order.ROOT / "tests" / "suite.sh"), "--collect-only", "-q"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    # both runs (the parallel one and the exclusive one) collected from the repository's tests
    assert run.stdout.count("tests/test_file_order.py: ") == 1, run.stdout[-2000:]
    assert run.stdout.count("tests/pipeline/test_busy_machine.py: ") == 1, run.stdout[-2000:]
