"""`python pipeline/run.py train` (and the default `all`: prepare, train, then eval and generate on the last
checkpoint): every phase of a run, on Ray Train or with --no-ray in this process (pipeline/train/session/).

    python pipeline/run.py                                   # prepare -> train -> eval -> generate
    python pipeline/run.py train --preset gpu --ray.num_workers=8
    python pipeline/run.py train --resume runs/<run>         # continue a run from its latest complete checkpoint
    python pipeline/run.py train --phases phases.yaml        # a curriculum: one dataset and step count per phase
"""
from __future__ import annotations

import argparse

from pipeline.cli.usage_error import UsageError
from pipeline.config import Config, from_flat, load_config
from pipeline.train.session.run_dir import find_run, new_run_dir, read_run_file

REAL_CORPUS_COMMAND = "python pipeline/run.py --preset fineweb-32k"  # printed after a run sized to the built-in corpus


def stage_train(cfg: Config, args: argparse.Namespace):
    """Prepare (cached), then train every phase; returns (run_dir, SessionResult)."""
    from pipeline.train.session.resume import plan_resume
    from pipeline.train.session.train_session import TrainSession, check_one_process, load_phases

    if args.checkpoint and not args.resume:
        raise UsageError("train --checkpoint continues a run from one of its checkpoints: add --resume RUN (a new "
                         "run from another run's weights is a phase: --phases)")
    start_step, extended, reopened = None, "", None
    if args.resume:
        run_dir = find_run(cfg, args.resume)
        args.run_dir = run_dir  # what a Ctrl+C from here on leaves behind is this run (pipeline/cli/interrupted.py)
        record = read_run_file(run_dir)
        saved = from_flat(record["config"])
        typed = getattr(args, "typed_fields", {})
        # the run's own config, with the fields this command line set on top
        preset = load_config(args.preset).flat()
        cfg = saved.replace({k: v for k, v in cfg.flat().items() if k in typed or v != preset[k]})
        plan = plan_resume(run_dir, record, cfg, typed, phases_file=args.phases, no_ray=args.no_ray,
                           checkpoint=args.checkpoint)
        if plan.finished:
            print(plan.finished)
            return run_dir, None
        phases, start_step, extended = plan.phases, plan.start_step, plan.extended
        if args.no_ray:
            check_one_process(phases, cfg, f"--phases {args.phases}" if args.phases else f"run {run_dir}")
        # a finished phase that grew is open again: the session records it once its up-front checks pass
        reopened = plan.phases_done if plan.phases_done != record.get("phases_done", 0) else None
    else:
        # the phases are checked before the run's directory is made: a refused file leaves nothing behind
        # a preset may bring its own (long-32k); with --no-ray none may split rows over workers
        phases = load_phases(args.phases, cfg, preset=args.preset, one_process=args.no_ray)
        run_dir = new_run_dir(cfg)
        args.run_dir = run_dir
    audit = args.audit_data or (bool(args.resume) and read_run_file(run_dir).get("audit_data", False))
    session = TrainSession(cfg, run_dir, phases, use_ray=not args.no_ray, audit_data=audit, start_step=start_step,
                           extended=extended, resume_from=args.checkpoint, phases_done=reopened)
    return run_dir, session.run(resume=bool(args.resume))


def train_command(cfg: Config, args: argparse.Namespace, prompts: list[str] | None = None) -> int:
    """train, or all (then eval and generate `prompts` on the last checkpoint); prints where everything is."""
    run_dir, result = stage_train(cfg, args)
    if result is None:  # a finished run with nothing more asked of it: stage_train said so
        return 0
    if result.stopped:
        from pipeline.train.session.resume import resume_command

        print(f"\nstopped after a checkpoint: {result.checkpoint}\n"
              f"continue with: {resume_command(run_dir, args.no_ray)}")
        return 0
    if args.stage == "all" and result.checkpoint is not None:
        from pipeline.cli.eval import stage_eval
        from pipeline.cli.generate import stage_generate

        stage_eval(result.cfg, result.checkpoint, run_dir=run_dir)
        stage_generate(result.checkpoint, args, prompts)
    ui = (f"compare runs in the MLflow UI:\n  {result.ui_command}" if result.ui_command else
          "MLflow: not tracked (tracking.enabled=false)")
    print(f"\noutputs:    {run_dir}\ncheckpoint: {result.checkpoint}\n"
          f"datasets:   {', '.join(result.dataset_dirs)}\n{ui}")
    if result.epochs is not None and result.cfg.data.source == "builtin":
        print(f"\nthe built-in corpus is small: this run passed over it {result.epochs:.1f} times. Train a real "
              f"corpus at 32k (FineWeb-Edu streamed from the Hugging Face Hub, 2,000 steps; preset fineweb-32k):\n"
              f"  {REAL_CORPUS_COMMAND}")
    return 0
