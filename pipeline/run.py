#!/usr/bin/env python
"""longtrain: raw text to a trained, tracked, comparable model, one command.

    python pipeline/run.py                                   # prepare -> train -> eval -> generate, embedded defaults
    python pipeline/run.py prepare --data.source=files --data.path='corpus/*.jsonl'
    python pipeline/run.py validate runs/datasets/<hash>     # or s3://bucket/longtrain/datasets/<hash>
    python pipeline/run.py validate runs/<run>               # its latest checkpoint: every file, and that it loads
    python pipeline/run.py train --preset gpu --ray.num_workers=8
    python pipeline/run.py train --resume runs/<run>         # continue a run from its latest complete checkpoint
    python pipeline/run.py train --resume runs/<run> --checkpoint <one of its checkpoints>   # ... or from that one
    python pipeline/run.py train --phases phases.yaml        # a curriculum: one dataset and step count per phase
    python pipeline/run.py train --data.mixture=mixes/web_code.yaml   # several sources blended by token share
    python pipeline/run.py train --no-ray                    # the same engine in one plain process
    python pipeline/run.py train --resume runs/<run> --train.max_steps=800   # a finished run, trained on to 800
    python pipeline/run.py eval --checkpoint runs/<run>       # a run's latest checkpoint, or a checkpoint directory
    python pipeline/run.py generate --checkpoint runs/<run> --prompt "Once upon a time"
    python pipeline/run.py eval --resume runs/<run> --by-position --seq-len 2x --passkey   # long context
    python pipeline/run.py eval runs/<run> --tasks builtin_cloze,hellaswag --limit 100   # lm-evaluation-harness tasks
    python pipeline/run.py tune --space tune_spaces/bs_tier.yaml
    python pipeline/run.py export --resume runs/<run> --out hf/<name> [--overwrite] [--register NAME]
    python pipeline/run.py runs                              # every run: status, steps, val loss, last checkpoint
    ray job submit --working-dir . -- python pipeline/run.py --address auto --run.storage=s3://bucket/longtrain

Every config field can be overridden by its path (--train.batch_size=8; `--help` lists them with type, default and
meaning); `--preset` picks a named preset (cpu, gpu, fineweb-32k, long-32k, long-131k, test) or a YAML file; the
default preset is gpu when CUDA is present, else cpu. A flag or field the stage would not use is refused, not ignored.
Every path that names data or results may be a URI (s3://, gs://, ...): data.path, run.storage (one bucket for
datasets, checkpoints and artifacts), data.dataset_store, ray.storage_path, --checkpoint, validate's target.
This file parses the command line and dispatches: each subcommand is one module of pipeline/cli/ (prepare.py,
train.py for train and the default all, eval.py, generate.py, export.py, validate.py, runs_list.py, tune.py).

Where a run keeps things (pipeline/train/session/run_dir.py LAYOUT):

    runs/<run>/run.json                               the run's record: config, phases, status, latest checkpoint
    runs/<run>/ray/phase<i>/checkpoint_<time>/        a checkpoint of a Ray Train run (phase i; with run.storage a
                                                      bucket: <run.storage>/<run>/ray/phase<i>/checkpoint_<time>/)
    runs/<run>/checkpoints/phase<i>/step_<NNNNNN>/    a checkpoint of a --no-ray run (phase i, at step NNNNNN)
"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python pipeline/run.py`: make the project importable without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.cli.usage_error import UsageError, user_error  # noqa: E402
from pipeline.config import Config, ConfigError, load_config, parse_overrides  # noqa: E402
from pipeline.console import current_stage, plain_worker_prefixes, quiet_mlflow, reset_stage  # noqa: E402
from pipeline.train.session.run_dir import check_run_root  # noqa: E402

STAGES = ("all", "prepare", "validate", "train", "eval", "generate", "tune", "export", "runs")


def _fields_epilog(argv: list[str]) -> str:
    """--help's list of config fields (pipeline/cli/config_help.py), with --preset's values as defaults when given."""
    from pipeline.config import preset
    from pipeline.cli.config_help import fields_help, tiers_help

    name = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--preset"), None)
    name = name or next((a.split("=", 1)[1] for a in argv if a.startswith("--preset=")), None)
    try:
        return (fields_help(preset(name), name) if name else fields_help()) + "\n\n" + tiers_help()
    except ConfigError as exc:
        return f"{fields_help()}\n\n(--preset {name}: {exc})\n\n{tiers_help()}"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    wants_help = any(a in ("-h", "--help") for a in argv)
    p = argparse.ArgumentParser(prog="python pipeline/run.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=_fields_epilog(argv) if wants_help else None)
    p.add_argument("stage", nargs="?", default="all", choices=STAGES,
                   help="all (the default: prepare, train, eval, generate) | prepare | validate DIR | train | eval | "
                        "generate | tune | export | runs (list the runs under run.root)")
    p.add_argument("target", nargs="?", help="validate: a dataset directory, a checkpoint directory or a run "
                                            "directory (its latest checkpoint); a path or a URI. eval: the "
                                            "checkpoint, run directory, bucket path or models:/NAME/VERSION to score")
    p.add_argument("--preset", help="cpu | gpu | fineweb-32k | long-32k | long-131k | test | a YAML preset file "
                                    "(default: by hardware)")
    p.add_argument("--resume", metavar="RUN", help="a run directory (or its name under run.root): train continues "
                                                   "it (a larger --train.max_steps or more --phases extend a finished "
                                                   "one); eval, generate and export use its latest checkpoint")
    p.add_argument("--address", help="join this Ray cluster ('auto' = the running one); same as --ray.address")
    p.add_argument("--no-ray", action="store_true", help="train: in this process with the Ray-free engine (prepare "
                                                          "still runs on Ray Data)")
    p.add_argument("--phases", help="YAML list of phases: [{steps: N, overrides: {data.source: ...}}, ...]")
    p.add_argument("--checkpoint", help="eval/generate/export: a run directory (its latest checkpoint), a checkpoint "
                                        "directory or a URI (default: the --resume run's latest); train --resume RUN: "
                                        "the checkpoint of the run to continue from")
    p.add_argument("--prompt", action="append", help="generate: a prompt (repeatable)")
    p.add_argument("--prompts-file", help="generate: a file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generate: tokens generated per prompt (64)")
    p.add_argument("--temperature", type=float, default=0.8, help="generate: sampling temperature, 0 = greedy (0.8)")
    p.add_argument("--top-k", type=int, default=0, help="generate: sample from the k likeliest tokens, 0 = all (0)")
    p.add_argument("--top-p", type=float, default=0.95, help="generate: nucleus sampling mass (0.95)")
    p.add_argument("--min-p", type=float, default=0.0, help="generate: drop tokens below this fraction of the "
                                                            "likeliest one's probability, 0 = off (0)")
    p.add_argument("--space", help="tune: a search space file from tune_spaces/")
    p.add_argument("--audit-data", action="store_true", help="train: log the seq_ids each step consumed "
                                                                 "(data_audit/)")
    p.add_argument("--by-position", action="store_true", help="eval: also the loss by position in the document")
    p.add_argument("--seq-len", metavar="Kx", help="eval: also rows K times the trained length: 2x, 4x or 2x,4x")
    p.add_argument("--passkey", action="store_true", help="eval: also the passkey retrieval grid (length x depth)")
    p.add_argument("--passkey-lengths", help="eval --passkey: prompt lengths in tokens, e.g. 1024,4096 (default: "
                                             "doubling up to the trained length, and twice it)")
    p.add_argument("--passkey-trials", type=int, default=5, help="eval --passkey: random keys per grid cell")
    p.add_argument("--tasks", help="eval: lm-evaluation-harness tasks to score, comma-separated: registry names "
                                   "(hellaswag), task YAML paths, builtin_cloze, builtin_docs (= --eval.tasks)")
    p.add_argument("--num-fewshot", type=int, help="eval --tasks: few-shot examples per prompt (= --eval.num_fewshot; "
                                                   "default: each task's own)")
    p.add_argument("--limit", type=float, help="eval --tasks: examples per task, a count or a share below 1 "
                                               "(= --eval.limit; default: all)")
    p.add_argument("--out", help="export: the Hugging Face model directory to write")
    p.add_argument("--overwrite", action="store_true", help="export: replace an existing --out directory")
    p.add_argument("--register", metavar="NAME", help="export: also register it in the MLflow Model Registry")
    # `--<field>=VALUE` config overrides bypass argparse, which would take one whose value holds a space (an inline
    # data.mixture list) for a positional argument
    from pipeline.config import field_types

    fields = field_types()
    is_override = [a.startswith("--") and "=" in a and a[2:].split("=", 1)[0] in fields for a in argv]
    args, rest = p.parse_known_args([a for a, o in zip(argv, is_override) if not o])
    return args, rest + [a for a, o in zip(argv, is_override) if o]


def build_config(args: argparse.Namespace, rest: list[str]) -> Config:
    """The config the command line asks for. Nothing typed is ignored (pipeline/cli/unused_settings.py): a flag or field
    the stage would not use is refused in one line, and data.path without data.source reads files (said so). The
    fields the user typed are kept in args.typed_fields (--resume applies them to the run's own config)."""
    from pipeline.cli.unused_settings import IgnoredSettingError, check_flags, settle_fields, typed_fields

    check_flags(args, parse_args([])[0])
    if args.stage == "validate":  # it reads no config: nothing to load (the default preset would import torch)
        # run.root only: where a run named by its name is found
        roots = [a for a in rest if a.startswith("--run.root=")]
        others = [a for a in rest if a not in roots]
        if others:
            raise IgnoredSettingError(f"{others[0]} is not used by `validate`: validate reads only the dataset "
                                      f"directory, checkpoint or run it is given (and --run.root, where a run's "
                                      f"name is looked up); drop it")
        return Config().replace(parse_overrides(roots)) if roots else Config()
    overrides = parse_overrides(list(rest))
    if args.address:
        overrides["ray.address"] = args.address
    for flag, key in (("tasks", "eval.tasks"), ("num_fewshot", "eval.num_fewshot"), ("limit", "eval.limit")):
        if getattr(args, flag) is not None:  # eval's flags for the eval section's fields
            overrides[key] = getattr(args, flag)
    cfg = load_config(args.preset, overrides, one_process=args.no_ray and args.stage in ("all", "train"))
    args.typed_fields = typed_fields(args.preset, overrides)
    cfg, notes = settle_fields(args.stage, args.typed_fields, cfg, no_ray=args.no_ray, space=args.space)
    for note in notes:
        print(f"note: {note}", flush=True)
    return cfg


def main(argv: list[str] | None = None) -> int:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # A job a shell script starts in the background (`cmd &`) begins with SIGINT ignored. Ray Train's stop
        # handler and the --no-ray loop install their own once training starts, so a Ctrl+C (kill -INT) sent
        # earlier -- while Ray starts, during prepare -- was lost and the run trained to its end. Take it from the
        # first second, as whoever sends it means it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    reset_stage()
    ray_before = _ray_connected()  # a Ray this command did not join (a test's, in-process) is left alone
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parse_args(argv)
    quiet_mlflow()
    plain_worker_prefixes()
    try:
        from pipeline.cli.eval import long_context_options

        long_context_options(args)  # eval's options: checked before any stage runs
        prompts = None
        if args.stage in ("all", "generate"):  # generate's flags and prompts file too
            from pipeline.train.handoff.generation_flags import generate_prompts

            prompts = generate_prompts(args)
        if args.stage == "validate":
            from pipeline.cli.validate import stage_validate

            if not args.target:
                raise UsageError("validate needs a dataset directory, a checkpoint or a run: python pipeline/run.py "
                                 "validate DIR")
            cfg = build_config(args, rest)
            check_run_root(cfg.run.root)
            return stage_validate(cfg, args, argv)
        cfg = build_config(args, rest)
        check_run_root(cfg.run.root)  # a file there: one line, before any stage writes under it
        # one subcommand, one module
        if args.stage == "runs":
            from pipeline.cli.runs_list import runs_main

            return runs_main(cfg.run.root)
        if args.stage == "prepare":
            from pipeline.cli.prepare import prepare_command

            return prepare_command(cfg)
        if args.stage == "tune":
            from pipeline.cli.tune import tune_main

            return tune_main(cfg, args.space)
        if args.stage == "eval":
            from pipeline.cli.eval import eval_command

            return eval_command(cfg, args)
        if args.stage == "generate":
            from pipeline.cli.generate import generate_command

            return generate_command(cfg, args, prompts)
        if args.stage == "export":
            from pipeline.cli.export import stage_export

            stage_export(cfg, args)
            return 0
        from pipeline.cli.train import train_command  # train, and all: prepare, train, eval, generate

        return train_command(cfg, args, prompts)
    except KeyboardInterrupt:
        from pipeline.cli.interrupted import what_was_kept

        _flush_worker_lines(ray_before)
        print(f"\ninterrupted: {what_was_kept(current_stage(), args)}", file=sys.stderr, flush=True)
        return 130
    except (ConfigError, UsageError, FileNotFoundError) as exc:
        _flush_worker_lines(ray_before)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001
        # The project's own user-facing errors (DatasetError, CheckpointError, StorageError, TrackingError, ...)
        # carry one clear line naming the problem and the fix, also when Ray hands them back wrapped (RayTaskError,
        # Ray Train's TrainingFailedError): that line is printed. Anything else is a bug and keeps its traceback.
        found = user_error(exc)
        if found is None:
            raise
        from pipeline.train.checkpoints.broken import BrokenCheckpoint, offered_command

        if isinstance(found, BrokenCheckpoint) and found.previous is not None:  # the exact command to run instead
            line = found.line(offered_command(argv, found.previous, args.stage, args.target))
        else:
            line = str(found).strip().splitlines()[0]
        _flush_worker_lines(ray_before)
        print(f"error: {line}", file=sys.stderr)
        return 2


def _ray_connected() -> bool:
    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized()


def _flush_worker_lines(ray_before: bool) -> None:
    """Before the command's last line: Ray forwards its workers' output to this console from a thread of its own,
    and a worker's traceback of the very error being reported can arrive after that line. Leaving Ray (when this
    command joined it) prints what was already received and stops the forwarding, so the one line is the last."""
    if ray_before or not _ray_connected():
        return
    import ray

    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 -- the process is ending anyway; the line matters more
        pass


if __name__ == "__main__":
    sys.exit(main())
