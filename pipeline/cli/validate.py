"""`python pipeline/run.py validate TARGET`: is a dataset, a checkpoint or a run's latest checkpoint whole?

    python pipeline/run.py validate runs/datasets/<hash>     # or s3://bucket/longtrain/datasets/<hash>
    python pipeline/run.py validate runs/<run>               # its latest checkpoint: every file, and that it loads,
                                                             # and the run's loss spikes (skips, rewinds, rows skipped)
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.usage_error import UsageError
from pipeline.config import Config
from pipeline.train.session.run_dir import latest_of_run, run_dir_of


def stage_validate(cfg: Config, args: argparse.Namespace, argv: list[str]) -> int:
    """validate TARGET: a dataset (its manifest), a checkpoint (its meta.json: every file against it, and that it
    loads) or a run directory (its latest checkpoint, then its loss spikes: pipeline/train/spike_record.py); 0 when
    whole, 1 with the report's reasons."""
    from pipeline.train.checkpoints.broken import is_checkpoint, offered_command
    from pipeline.train.checkpoints.validate_checkpoint import validate_checkpoint

    target, run_dir = args.target, run_dir_of(cfg, args.target)
    if run_dir is not None:
        target, problem = latest_of_run(run_dir)
        if target is None:
            raise UsageError(f"validate {args.target}: run {run_dir} has no checkpoint yet; validate a dataset "
                             f"directory or a checkpoint")
        if problem is not None:  # what `train --resume` skips with the same words
            print(f"validate: {problem}; validating {target}, the newest complete checkpoint of the run (the one "
                  f"`train --resume {args.target}` continues from)")
    elif "://" not in target and not Path(target).exists():
        raise UsageError(f"validate {target}: no such path, and no run named {target} under run.root "
                         f"({cfg.run.root}); validate takes a dataset directory, a checkpoint directory, a run "
                         f"directory or a run's name (add --run.root=DIR for a run under another root)")
    elif not is_checkpoint(target):
        from pipeline.data.stages import validate_main

        return validate_main(target)
    code = validate_checkpoint(target, lambda prev: offered_command(argv, prev, "validate", args.target))
    if run_dir is not None:
        print("\n".join(_spike_lines(run_dir)))
    return code


def _spike_lines(run_dir: Path) -> list[str]:
    """The run's loss-spike events and skipped rows, from its record in the run's storage (its directory for a --no-ray
    run)."""
    from pipeline.config import from_flat
    from pipeline.storage import run_storage
    from pipeline.train.session.run_dir import read_run_file
    from pipeline.train.spike_record import read_events, report_lines

    record = read_run_file(run_dir)
    ray_run = record.get("config") and not record.get("no_ray")
    store = run_storage(from_flat(record["config"]), run_dir) if ray_run else str(run_dir)
    return report_lines(read_events(store))
