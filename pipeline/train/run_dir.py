"""Run directories: where one `python pipeline/run.py train` keeps its record, checkpoints and curves.

    runs/<tier>-<YYYYmmdd-HHMMSS>/run.json    # config, phases, MLflow run id, datasets, latest checkpoint, status

`run.json` is rewritten atomically (temp file, then rename) so a crash never leaves half a record;
`--resume RUN` finds a run by its directory or its name under `run.root`.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.config import Config

RUN_FILE = "run.json"
AUDIT_DIR = "data_audit"  # <run_dir>/data_audit/rank_<r>.jsonl: the seq_ids each rank consumed, per step


class RunDirError(ValueError):
    """A run directory that is not there or already taken; printed as one line."""


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
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    os.replace(tmp, run_dir / RUN_FILE)


def read_run_file(run_dir: Path) -> dict:
    return json.loads((run_dir / RUN_FILE).read_text())
