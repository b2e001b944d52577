"""A run's data before it trains: for a mixture, the plan of what each source supplies (an over-demanded source
refused in one line), printed, logged to MLflow and kept beside the run; for one dataset, its MLflow input.

    cfg = record_data(cfg, dataset_dir, manifest, tracker, steps=200, phase=0, run_dir=run_dir)  # train with this cfg

The session (pipeline/train/session/train_session.py) calls it for each phase, a sweep's trial (pipeline/sweep/trial.py) for
itself. What a mixture logs: params `mixture/block_rows`, `mixture/<source>/weight`, `mixture/<source>/share` (what
the run trains on), `mixture/<source>/repetitions` and `mixture/<source>/dataset_hash` (phase i > 0:
`phase<i>/mixture/...`), one MLflow dataset input per source
(context train, or eval for weight 0; tagged with the source's name, weight and the tokenizer's sha256), and
<run_dir>/mixture.json (pipeline/data/mixture.py run_manifest: sources, weights, repetitions, tokenizer; one
record per phase), also as an artifact of the run.

A phase shorter than one block of data.mixture_block_rows rows trains with blocks of its own length
(pipeline/data/mixture.py fitted_block_rows): the returned config carries that block to the workers, mixture.json
records it (block_rows, beside block_rows_asked), and a resume of the phase takes it from there, so the stream after
a resume is the one before it even when the resume changes the run's length.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.config import Config, rows_per_step
from pipeline.data.mixture import (Mixture, check_plan, describe_plan, fitted_block_rows, mixture_of, run_manifest,
                                   write_run_manifest)

MIXTURE_RUN_FILE = "mixture.json"


def recorded_block_rows(run_dir: str | Path, phase: int, asked: int) -> int | None:
    """The block a phase of this run trained with (its mixture.json), when it was chosen for the same
    data.mixture_block_rows; None when the phase has not trained yet."""
    path = Path(run_dir) / MIXTURE_RUN_FILE
    try:
        phases = json.loads(path.read_text())["phases"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for p in phases:
        if p.get("phase") == phase and p.get("block_rows_asked", p.get("block_rows")) == asked:
            return int(p["block_rows"])
    return None


def record_data(cfg: Config, dataset_dir: str | Path, manifest: Any, tracker, *, steps: int, phase: int = 0,
                run_dir: str | Path) -> Config:
    """The module docstring; returns the config to train with (for a mixture shorter than one block, with its own
    data.mixture_block_rows). MixtureError before anything is logged when a source would need more than its
    max_repetitions passes."""
    from pipeline.tracking.names import MIXTURE_SOURCE_TAG, MIXTURE_WEIGHT_TAG, TOKENIZER_TAG

    mix = mixture_of(dataset_dir, cfg, manifest)
    if mix is None:
        tracker.log_dataset_input(manifest, dataset_dir)
        return cfg
    per_step = rows_per_step(cfg)
    asked = cfg.data.mixture_block_rows
    block = recorded_block_rows(run_dir, phase, asked) or fitted_block_rows(asked, steps * per_step)
    if block != mix.block_rows:
        mix = Mixture(mix.dataset_dir, mix.manifest, mix.sources, block, mix.seed)
        cfg = cfg.replace({"data.mixture_block_rows": block})
    plan = mix.plan(steps * per_step)
    check_plan(plan, steps, per_step, mix.seq_len)
    for line in describe_plan(plan, mix.block_rows, asked):
        print(line, flush=True)
    prefix = f"phase{phase}/" if phase else ""
    params: dict[str, Any] = {f"{prefix}mixture/block_rows": mix.block_rows}
    for p in plan:
        params.update({f"{prefix}mixture/{p.name}/weight": round(p.weight, 6),
                       f"{prefix}mixture/{p.name}/share": round(p.share, 6),
                       f"{prefix}mixture/{p.name}/repetitions": round(p.repetitions, 4),
                       f"{prefix}mixture/{p.name}/dataset_hash": p.dataset_hash[:16]})
    tracker.log_params(params)
    for src, p in zip(mix.sources, plan):
        tracker.log_dataset_input(src.manifest, src.dataset_dir, context="train" if p.rows_per_block else "eval",
                                  tags={MIXTURE_SOURCE_TAG: src.name, MIXTURE_WEIGHT_TAG: f"{p.weight:.6g}",
                                        TOKENIZER_TAG: src.manifest.tokenizer_sha256})
    path = Path(run_dir) / MIXTURE_RUN_FILE
    write_run_manifest(path, run_manifest(mix, plan, phase=phase, steps=steps, rows_per_step=per_step,
                                          asked_block_rows=asked))
    tracker.log_artifact(path)
    return cfg
