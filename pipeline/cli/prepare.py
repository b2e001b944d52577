"""`python pipeline/run.py prepare`: raw text to a prepared dataset (pipeline/data/stages.py), cached by content hash.

    python pipeline/run.py prepare --data.source=files --data.path='corpus/*.jsonl'
    python pipeline/run.py prepare --data.mixture=mixes/web_code.yaml
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import Config


def stage_prepare(cfg: Config) -> Path:
    """The prepared dataset's directory (a Path, or a URI on object storage)."""
    from pipeline.data.stages import prepare_main
    from pipeline.train.session.sizing import size_to_data

    if cfg.data.min_rows > 0 and not cfg.data.mixture:  # the rows the train stage would size the data to (sizing.py)
        return size_to_data(cfg, prepare_main, steps=False).dataset
    return prepare_main(cfg)


def prepare_command(cfg: Config) -> int:
    print(f"dataset: {stage_prepare(cfg)}")
    return 0
