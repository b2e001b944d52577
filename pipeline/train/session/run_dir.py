"""Run directories: where one `python pipeline/run.py train` keeps its record, checkpoints and curves.

    runs/<tier>-<YYYYmmdd-HHMMSS>/run.json    # config, phases, MLflow run id, datasets, latest checkpoint, status

`run.json` is rewritten atomically (temp file, then rename) so a crash never leaves half a record;
`--resume RUN` finds a run by its directory or its name under `run.root`. Where the checkpoints are is LAYOUT
below, the one description run.py's docstring, the hints and docs/training.md share (tests check they agree).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.config import Config

RUN_FILE = "run.json"
# Where a run keeps its record and checkpoints. run.py's docstring and docs/training.md quote it; `--checkpoint`
# takes any of these directories, or the run directory itself (its latest checkpoint, as run.json records it).
LAYOUT = """\
runs/<run>/run.json                               the run's record: config, phases, status, latest checkpoint
runs/<run>/ray/phase<i>/checkpoint_<time>/        a checkpoint of a Ray Train run (phase i; with run.storage a
                                                  bucket: <run.storage>/<run>/ray/phase<i>/checkpoint_<time>/)
runs/<run>/checkpoints/phase<i>/step_<NNNNNN>/    a checkpoint of a --no-ray run (phase i, at step NNNNNN)"""
# The hint every "which checkpoint?" message ends with.
CHECKPOINT_HINT = ("pass --checkpoint a run directory (runs/<run>: its latest checkpoint), a checkpoint directory "
                   "(runs/<run>/ray/phase<i>/checkpoint_<time>, or runs/<run>/checkpoints/phase<i>/step_<NNNNNN> "
                   "from --no-ray) or a checkpoint's URI")
AUDIT_DIR = "data_audit"  # <run_dir>/data_audit/rank_<r>.jsonl: the seq_ids each rank consumed, per step


class RunDirError(ValueError):
    """A run directory that is not there or already taken; printed as one line."""


def check_run_root(root: str | Path) -> None:
    """RunDirError when run.root cannot hold run directories: it, or a folder above it, is a file (it is created
    when missing)."""
    path = Path(root)
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                what = "is a file" if place == path else f"is under {place}, which is a file"
                raise RunDirError(f"run.root={root} {what}, not a directory; pass --run.root=DIR a directory (it is "
                                  f"created when missing), or move the file away")
            return


def new_run_dir(cfg: Config) -> Path:
    name = cfg.run.name or f"{cfg.model.tier}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.run.root).resolve() / name
    if (run_dir / RUN_FILE).exists():
        raise RunDirError(f"run {run_dir} already exists; continue it with --resume {run_dir} or pick another "
                          f"--run.name")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def find_run(cfg: Config, resume: str) -> Path:
    for candidate in (Path(resume), Path(cfg.run.root) / resume):
        if (candidate / RUN_FILE).is_file():
            return candidate.resolve()
    raise RunDirError(f"--resume {resume}: no run there (no {RUN_FILE}); pass a directory under {cfg.run.root}/ "
                      f"that an earlier `python pipeline/run.py train` created")


def write_run_file(run_dir: Path, record: dict) -> None:
    """run.json replaced atomically: a temp file renamed over it. On a full disk the temp file is removed and the
    record stays as it was (pipeline/disk_space.py's one line)."""
    from pipeline.disk_space import RUN_RECORD_FIX, one_line_when_full

    tmp = run_dir / f".{RUN_FILE}.tmp"
    with one_line_when_full(run_dir / RUN_FILE, "the run's record", RUN_RECORD_FIX):
        try:
            tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
            os.replace(tmp, run_dir / RUN_FILE)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def read_run_file(run_dir: Path) -> dict:
    return json.loads((run_dir / RUN_FILE).read_text())


def run_dir_of(cfg: Config, value: str) -> Path | None:
    """`value` as a run directory (a path holding run.json, or a run's name under run.root), else None."""
    if "://" in value and not value.startswith("file://"):
        return None
    for candidate in (Path(value.removeprefix("file://")), Path(cfg.run.root) / value):
        if (candidate / RUN_FILE).is_file():
            return candidate.resolve()
    return None


def latest_of_run(run_dir: Path) -> tuple[str | None, str | None]:
    """The run's latest complete checkpoint (a local path or a URI), the one `train --resume RUN` continues from,
    whether the run finished, crashed (a full disk at its third checkpoint) or was killed: the latest complete
    checkpoint of the phase in progress (run.json's `phase`) in the run's folder of them (<run>/checkpoints/phase<i>
    for a --no-ray run, Ray Train's <ray storage>/phase<i> otherwise), as pipeline/train/checkpoints/index.py
    `latest_complete` finds it; else the one run.json records (the previous phase's last); None before the first.

    The one place a run becomes a checkpoint: `train --resume RUN`, `--checkpoint RUN` and `--resume RUN` of eval,
    generate and export, `validate RUN` and `runs`. run.json's own `checkpoint` is written when a phase ends or
    stops: a run that crashed has newer complete checkpoints than it records. Returns (that location, what was wrong
    with a newer incomplete one or None)."""
    from pipeline.config import ConfigError, from_flat
    from pipeline.storage import StorageError, join, ray_storage
    from pipeline.train.checkpoints.index import latest_complete

    record = read_run_file(run_dir)
    if record.get("phase") is not None and record.get("config"):
        phase = f"phase{record['phase']}"
        try:
            folder = (str(run_dir / "checkpoints" / phase) if record.get("no_ray")
                      else join(ray_storage(from_flat(record["config"]), run_dir), phase))
            found, problem = latest_complete(folder)
        except (ConfigError, StorageError, FileNotFoundError, NotADirectoryError):
            found = problem = None  # the folder is not there (no checkpoint yet) or cannot be listed: run.json's says
        if found is not None:
            return found, problem
    return record.get("checkpoint") or None, None
