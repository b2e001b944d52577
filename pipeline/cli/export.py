"""`python pipeline/run.py export`: a checkpoint of an attention model to the Hugging Face format (Llama; Mixtral or
Qwen2-MoE for a mixture of experts: pipeline/train/handoff/hf_export.py), optionally registered in the MLflow Model
Registry.

    python pipeline/run.py export --resume runs/<run> --out hf/<name> [--overwrite] [--register NAME]
"""
from __future__ import annotations

import argparse

from pipeline.cli.checkpoint_arg import checkpoint_of_args, run_dir_of_checkpoint, tracked_run
from pipeline.cli.usage_error import UsageError
from pipeline.config import Config
from pipeline.console import stage
from pipeline.train.session.run_dir import find_run


def stage_export(cfg: Config, args: argparse.Namespace) -> None:
    from pipeline.train.checkpoints.broken import diagnosed

    if not args.out:
        raise UsageError("export needs --out DIR: python pipeline/run.py export --resume RUN --out DIR")
    checkpoint = checkpoint_of_args(cfg, args)
    from pipeline.train.handoff.hf_export import export_checkpoint, register_export  # torch: once there is a checkpoint
    run = None
    if args.register:  # find the training run before writing anything
        run_dir = find_run(cfg, args.resume) if args.resume else run_dir_of_checkpoint(checkpoint)
        run = tracked_run(run_dir, cfg.tracking.tracking_uri)
        if run is None:
            raise UsageError(f"--register needs the MLflow run that trained {checkpoint}, and none was found (no "
                             f"run.json above it, or tracking was off); export without --register")
    stage("export", f"{checkpoint} -> {args.out} (Hugging Face transformers)")
    with diagnosed(checkpoint):  # a file that does not load: one line, the previous checkpoint offered
        result = export_checkpoint(checkpoint, args.out, overwrite=args.overwrite)
    print(f"exported {result.out_dir}: load it with transformers.AutoModelForCausalLM.from_pretrained / AutoTokenizer")
    if run is not None:
        version = register_export(result, run[0], run[1], args.register)
        print(f"registered {args.register} version {version.version} (run {run[1]}) in {run[0]}")
