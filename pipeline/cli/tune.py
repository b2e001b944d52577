"""`python pipeline/run.py tune --space FILE`: a Ray Tune sweep (pipeline/sweep/tune.py), then its table and the
best trial's preset.

    python pipeline/run.py tune --space tune_spaces/bs_tier.yaml --preset gpu
    python pipeline/run.py tune --space tune_spaces/lr.yaml --preset cpu --train.max_steps=300
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import Config
from pipeline.console import stage
from pipeline.sweep.report import markdown_table
from pipeline.sweep.space import SpaceError, load_space


def tune_main(cfg: Config, space_path: str | None) -> int:
    """`python pipeline/run.py tune --space FILE`: run the sweep, print the table; 0 if any trial finished."""
    if not space_path:
        found = sorted(str(p) for p in Path("tune_spaces").glob("*.yaml")) if Path("tune_spaces").is_dir() else []
        raise SpaceError("tune needs --space FILE" + (f"; for example: {', '.join(found)}" if found else ""))
    space = load_space(space_path, cfg)  # the space file's mistakes in one line, before Ray and torch load
    from pipeline.sweep.tune import run_sweep  # Ray, torch

    stage("tune", f"sweep {space_path}")
    result = run_sweep(cfg, space_path, command=True)
    stage("tune", "results")
    print(markdown_table(result.rows, space.metric))
    print(f"table: {result.table_md}\nchart: {result.table_png}")
    if result.best is None:
        print("no trial finished; nothing to recommend")
        return 1
    print(f"best: trial {result.best.trial_id} {result.best.params} -> {result.best.metric_value:.4f}\n"
          f"preset: {result.best_preset}\ntrain with it: python pipeline/run.py train --preset {result.best_preset}")
    return 0
