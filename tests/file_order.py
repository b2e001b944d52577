"""The longest test files first, for the whole suite on 2 pytest processes (`-n 2 --dist loadfile`, a unit per file
but for the files that share a costly fixture: GROUPS).

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

from xdist.scheduler import LoadFileScheduling

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


# Session and package fixtures that build something costly for several files: a dataset prepared on the session's
# S3 server, three named mixtures, a files dataset, the mixer sweep (~3 min) and the sweeps' shared run root. Each
# pytest process builds its own, so the files that use one are handed to one process together (GROUPS): the build
# runs once in the run instead of once per process.
SHARED_BUILDS = ("s3_dataset", "mixture_setup", "files_dataset", "mixer_sweep", "sweep_files")

# The files linked through SHARED_BUILDS, a group each, named after its first file. A table rather than what the
# collection shows, because xdist's scheduler runs in the controller, which collects nothing: test_file_order.py
# checks it against the fixtures the collected tests use (`groups`).
GROUPS = (
    ("tests/pipeline/test_object_storage.py", "tests/pipeline/test_storage_faults_train.py",
     "tests/pipeline/test_ray_cluster.py", "tests/pipeline/test_storage_denied_train.py",
     "tests/pipeline/test_checkpoint_upload_train.py"),  # s3_dataset
    ("tests/pipeline/sweep/test_tune.py", "tests/pipeline/sweep/test_mixer_sweep.py",
     "tests/pipeline/sweep/test_mlflow_ui.py", "tests/pipeline/sweep/test_tune_ctrl_c.py"),  # sweep_files, mixer_sweep
    ("tests/pipeline/sweep/test_mixture_sweep.py", "tests/pipeline/data/test_mixture.py",
     "tests/pipeline/train/test_mixture_train.py"),  # mixture_setup
    ("tests/pipeline/test_full_disk.py", "tests/pipeline/data/test_shards.py", "tests/pipeline/cli/test_train_reads.py",
     "tests/pipeline/train/test_resume_record.py", "tests/pipeline/train/test_resume_extend.py"),  # files_dataset
)
_GROUP_OF = {f: files[0] for files in GROUPS for f in files}


def group_of(path: str) -> str:
    """The group a test file is handed out in: its GROUPS entry's first file, or the file itself."""
    return _GROUP_OF.get(path, path)


def groups(items: list) -> dict[str, str]:
    """{file: a file standing for its group} as the collected items' fixtures link them: files using one
    SHARED_BUILDS fixture (directly, or through another file) share one; every other file stands for itself. An
    item's `fixturenames` holds every fixture it uses, those its fixtures use included."""
    parent: dict[str, str] = {}

    def root(f: str) -> str:
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    first_user: dict[str, str] = {}
    for item in items:
        f = file_of(item.nodeid)
        parent.setdefault(f, f)
        for name in SHARED_BUILDS:
            if name in getattr(item, "fixturenames", ()):
                a, b = sorted((root(f), root(first_user.setdefault(name, f))))
                parent[b] = a
    return {f: root(f) for f in parent}


def longest_first(items: list, table: dict[str, float]) -> list:
    """items with the table's files first, longest first, each file's tests together and in their own order; the
    other files after them, in their collected order. The files of a group (GROUPS) go together, the group placed
    by its files' seconds added up, its files longest first."""
    group_seconds: dict[str, float] = defaultdict(float)
    group_first: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        f = file_of(item.nodeid)
        if f not in first_seen:
            first_seen[f] = i
            group_first.setdefault(group_of(f), i)
            group_seconds[group_of(f)] += table.get(f, 0.0)

    def key(pair: tuple[int, object]) -> tuple[float, int, float, int, int]:
        i, item = pair
        f = file_of(item.nodeid)
        g = group_of(f)
        return -group_seconds[g], group_first[g], -table.get(f, 0.0), first_seen[f], i

    return [item for _, item in sorted(enumerate(items), key=key)]


class GroupedFiles(LoadFileScheduling):
    """xdist's file scheduler (`--dist loadfile`) with GROUPS's files as one unit each: what tests/conftest.py's
    pytest_xdist_make_scheduler hands xdist. (xdist's own `--dist loadgroup` renames the tests it groups, which
    pytest 9's nodeids no longer take: it grouped nothing.)"""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(file_of(nodeid))


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
