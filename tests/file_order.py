"""The longest test files first, for the whole suite on 2 pytest processes (`-n 2 --dist loadfile`).

pytest-xdist hands out whole files, in the order its workers collected them (`--no-loadscope-reorder`, in
pyproject.toml's addopts; by default it sorts files by their number of tests, which put the three-host elastic run,
one file of 5 tests, near the end). Handed out alphabetically, the run ended with one process running the last long
files alone while the other had nothing left. So each worker sorts its collection by the table below, the longest
file first (the longest-processing-time rule), and the files the table does not name after them, in their own
order: every worker sorts the same collection with the same table, so each collects the same order (xdist stops the
run with "Different tests collected" otherwise). A run on one process keeps pytest's own order.

The table, tests/slow_files.json, holds each file's seconds (its tests' set-up, call and teardown, its module
fixtures included; a session fixture counts where it first ran) in a whole-suite run on 2 processes, for the files
over MIN_SECONDS. Refresh it from such a run (a partial run updates the files it ran and keeps the others):

    .venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not exclusive" --record-file-seconds=tests/slow_files.json
"""
from __future__ import annotations

import datetime
import json
import subprocess
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).resolve().with_name("slow_files.json")
ROOT = TABLE.parents[1]
MIN_SECONDS = 20.0  # files under it are left out of the table: their order hardly matters


def load_table(path: Path = TABLE) -> dict[str, float]:
    """{file path from the repository root: seconds} ({} when there is no table)."""
    if not path.is_file():
        return {}
    return {k: float(v) for k, v in json.loads(path.read_text())["seconds"].items()}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(items: list, table: dict[str, float]) -> list:
    """items with the table's files first, longest first, each file's tests together and in their own order; the
    other files after them, in their collected order."""
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(file_of(item.nodeid), i)

    def key(pair: tuple[int, object]) -> tuple[float, int, int]:
        i, item = pair
        f = file_of(item.nodeid)
        return -table.get(f, 0.0), first_seen[f], i

    return [item for _, item in sorted(enumerate(items), key=key)]


class FileSeconds:
    """A plugin summing each test file's report durations (set-up, call, teardown); under xdist the controller sees
    every worker's reports. At the session's end it writes the table to `path`: the files this run ran replace
    their entries (those under MIN_SECONDS are dropped), files no longer in the repository are dropped, the others
    are kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        if not self.seconds:
            return
        old = json.loads(self.path.read_text()) if self.path.is_file() else {}
        table = {f: s for f, s in old.get("seconds", {}).items() if f not in self.seconds and (ROOT / f).is_file()}
        table.update({f: round(s) for f, s in self.seconds.items() if s >= MIN_SECONDS})
        run = (f"{datetime.date.today()} at {_commit()}: {len(self.seconds)} file(s) of `pytest "
               f"{' '.join(session.config.invocation_params.args)}`")
        doc = {"about": ABOUT, "runs": [*old.get("runs", [])[-4:], run],
               "seconds": dict(sorted(table.items(), key=lambda kv: (-kv[1], kv[0])))}
        self.path.write_text(json.dumps(doc, indent=1) + "\n")


ABOUT = (f"Seconds of each test file over {MIN_SECONDS:.0f} s in the whole suite on 2 pytest processes (the last "
         "runs that wrote it under `runs`); the longest are handed out first. tests/file_order.py says how to refresh.")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip() or "?"
    except OSError:
        return "?"
