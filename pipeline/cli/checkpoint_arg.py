"""Which checkpoint a command is about (--checkpoint, else the --resume run's latest) and which run trained it (the
MLflow run its results are logged to): what eval, generate and export share.

    checkpoint = checkpoint_of_args(cfg, args)        # a local directory (Path) or a URI on object storage
    run = tracked_run(run_dir_of_checkpoint(checkpoint), cfg.tracking.tracking_uri)   # (tracking URI, run id)
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.config import Config
from pipeline.train.session.run_dir import CHECKPOINT_HINT, find_run, latest_of_run, read_run_file, run_dir_of


def checkpoint_of_args(cfg: Config, args: argparse.Namespace) -> Path | str:
    """--checkpoint, else the --resume run's latest: a local directory (Path) or a URI on object storage."""
    from pipeline.storage import native
    from pipeline.train.checkpoints.checkpoint_error import CheckpointError

    if args.checkpoint:
        run_dir = run_dir_of(cfg, args.checkpoint)  # a run directory: its latest checkpoint
        if run_dir is None:
            return native(args.checkpoint)
        ckpt = latest_of_run(run_dir)[0]
        if ckpt is None:
            raise CheckpointError(f"--checkpoint {args.checkpoint}: run {run_dir} has no checkpoint yet (status "
                                  f"{read_run_file(run_dir).get('status', '?')}); {CHECKPOINT_HINT}")
        return native(ckpt)
    if args.resume:
        run_dir = find_run(cfg, args.resume)
        ckpt = latest_of_run(run_dir)[0]
        if ckpt:
            return native(ckpt)
        raise CheckpointError(f"--resume {args.resume}: run {run_dir} has no checkpoint yet; {CHECKPOINT_HINT}")
    raise CheckpointError(f"no checkpoint given; {CHECKPOINT_HINT}, or --resume RUN")


def run_dir_of_args(cfg: Config, args: argparse.Namespace) -> Path | None:
    """The run a command's results are logged to: the --resume run, else a run directory given as --checkpoint,
    else None (run_dir_of_checkpoint then looks above a local checkpoint); also for a checkpoint in a bucket."""
    return (find_run(cfg, args.resume) if args.resume else
            run_dir_of(cfg, args.checkpoint) if args.checkpoint else None)


def run_dir_of_checkpoint(checkpoint: str | Path) -> Path | None:
    """The run directory (the nearest parent holding run.json) of a local checkpoint under it, else None (a
    checkpoint on object storage: pass the run with --resume)."""
    from pipeline.storage import is_uri
    from pipeline.train.session.run_dir import RUN_FILE

    if is_uri(checkpoint):
        return None
    for parent in Path(checkpoint).resolve().parents:
        if (parent / RUN_FILE).is_file():
            return parent
    return None


def tracked_run(run_dir: Path | None, tracking_uri: str = "") -> tuple[str, str] | None:
    """(tracking URI, MLflow run id) recorded for a run directory, or None when it was not tracked.
    A non-empty `tracking_uri` (from the command line) replaces the one the run recorded."""
    from pipeline.config import from_flat
    from pipeline.tracking.tracker import resolve_tracking_uri

    if run_dir is None:
        return None
    record = read_run_file(run_dir)
    if not record.get("mlflow_run_id"):
        return None
    return tracking_uri or resolve_tracking_uri(from_flat(record["config"])), record["mlflow_run_id"]
