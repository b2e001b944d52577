"""What a Ctrl+C left behind: the one line `python pipeline/run.py` prints when it is interrupted, at any moment.

    interrupted: during prepare: no dataset was published (a rerun builds it again); run runs/nano-... has no
    checkpoint yet; continue with: python pipeline/run.py train --resume runs/nano-...

The first Ctrl+C during training is not this: the workers checkpoint and stop, and the run says where
(pipeline/train/ray_train.py fit_with_clean_stop, pipeline/train/stop_request.py StopRequest). This is for a Ctrl+C anywhere
else, or a second one during training, which aborts at once.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def _run_part(run_dir: Path, no_ray: bool, training: bool) -> str:
    """What the run directory holds now, and the command that continues it; marks a run still recorded as
    running (or failed by this very interrupt) as stopped, as a Ctrl+C during training does."""
    from pipeline.train.session.resume import resume_command
    from pipeline.train.session.run_dir import RUN_FILE, read_run_file, write_run_file

    if not (run_dir / RUN_FILE).is_file():
        return f"run directory {run_dir} holds nothing yet"
    record = read_run_file(run_dir)
    if record.get("status") in ("running", "failed"):
        write_run_file(run_dir, {**record, "status": "stopped"})
    if training:  # aborted inside a phase: its checkpoints so far are where Ray Train (or --no-ray) keeps them
        held = "keeps every checkpoint it wrote before this (--resume continues from the latest)"
    elif record.get("checkpoint"):
        held = f"keeps its checkpoint {record['checkpoint']}"
    else:
        held = "has no checkpoint yet"
    return f"run {run_dir} {held}; continue with: {resume_command(run_dir, no_ray)}"


def what_was_kept(stage: str, args: argparse.Namespace) -> str:
    """One line for a KeyboardInterrupt during `stage` (the last banner: pipeline/console.py current_stage) of the
    command `args`; pipeline/cli/train.py's stage_train sets args.run_dir once the run has one."""
    run_dir = getattr(args, "run_dir", None)
    no_ray = bool(getattr(args, "no_ray", False))
    if stage == "prepare":
        said = "during prepare: no dataset was published (the partial build is removed; a rerun builds it again)"
    elif stage == "train":
        said = ("during training, aborted without a new checkpoint (once training runs, a first Ctrl+C checkpoints "
                "and stops; a second aborts)")
    elif stage == "eval":
        said = "during eval: nothing was logged, and the checkpoint is unchanged"
    elif stage == "generate":
        said = "during generate: nothing was written"
    elif stage == "export":
        said = "during export: nothing was written (the export goes to a temporary directory first)"
    elif stage == "tune":  # a sweep is not resumed: the same command starts it over, under a new name
        space = getattr(args, "space", None)
        said = ("during the sweep: its MLflow run and those of its unfinished trials are marked KILLED, finished "
                "trials keep theirs; the sweep's table was not written; run it again with: python pipeline/run.py "
                f"tune --space {space or 'FILE'} (a new sweep)")
    else:
        said = "before any stage started"
    if run_dir is None:
        return said + ("" if stage else ": nothing was written")
    if stage in ("eval", "generate"):  # the default command, after its run trained
        return (f"{said}; run {run_dir} finished training; evaluate its checkpoint with: python pipeline/run.py "
                f"eval --checkpoint {run_dir}")
    return f"{said}; {_run_part(Path(run_dir), no_ray, training=stage == 'train')}"
