"""The checkpoints of a plain-process (--no-ray) run: <run>/checkpoints/phase<i>/step_<NNNNNN>, the `keep` newest
kept. Which of them is the latest complete one is pipeline/train/checkpoints/index.py `latest_complete`'s answer.

    ckpts = LocalCheckpoints(run_dir / "checkpoints" / "phase0", keep=3)
    path = ckpts.save(engine, extra={"phase": 0})
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.train.engine import Engine


class LocalCheckpoints:
    """Checkpoints of a plain-process run: <dir>/step_000050, keeping the `keep` newest."""

    def __init__(self, directory: str | Path, keep: int):
        self.directory, self.keep = Path(directory), keep
        self.last_saved: Path | None = None

    def save(self, engine: Engine, extra: dict | None = None) -> Path:
        path = engine.save(self.directory / f"step_{engine.step:06d}", extra=extra)
        self.last_saved = path
        for old in self.all()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for left in self.directory.glob(".step_*.tmp-*"):  # what a crash mid-save left: never a checkpoint
            shutil.rmtree(left, ignore_errors=True)
        return path

    def all(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("step_*") if (p / "meta.json").is_file())
