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
    python pipeline/run.py tune --space tune_spaces/bs_tier.yaml
    python pipeline/run.py export --resume runs/<run> --out hf/<name> [--overwrite] [--register NAME]
    python pipeline/run.py runs                              # every run: status, steps, val loss, last checkpoint
    ray job submit --working-dir . -- python pipeline/run.py --address auto --run.storage=s3://bucket/longtrain

Every config field can be overridden by its path (--train.batch_size=8; `--help` lists them with type, default and
meaning); `--preset` picks a named preset (cpu, gpu, fineweb-32k, long-32k, test) or a YAML file; the default preset
is gpu when CUDA is present, else cpu. A flag or field the stage would not use is refused, not ignored.
Every path that names data or results may be a URI (s3://, gs://, ...): data.path, run.storage (one bucket for
datasets, checkpoints and artifacts), data.dataset_store, ray.storage_path, --checkpoint, validate's target.

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

from pipeline.config import Config, ConfigError, from_flat, load_config, parse_overrides  # noqa: E402
from pipeline.console import current_stage, plain_worker_prefixes, quiet_mlflow, reset_stage, stage  # noqa: E402
from pipeline.train.session.run_dir import (CHECKPOINT_HINT, check_run_root, find_run, new_run_dir,  # noqa: E402
                                    read_run_file, recorded_checkpoint, run_dir_of)

STAGES = ("all", "prepare", "validate", "train", "eval", "generate", "tune", "export", "runs")
REAL_CORPUS_COMMAND = "python pipeline/run.py --preset fineweb-32k"  # printed after a run sized to the built-in corpus


class UsageError(ValueError):
    """Bad command-line usage; printed as one line."""


def _fields_epilog(argv: list[str]) -> str:
    """--help's list of config fields (pipeline/cli/config_help.py), with --preset's values as defaults when given."""
    from pipeline.config import preset
    from pipeline.cli.config_help import fields_help

    name = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--preset"), None)
    name = name or next((a.split("=", 1)[1] for a in argv if a.startswith("--preset=")), None)
    try:
        return fields_help(preset(name), name) if name else fields_help()
    except ConfigError as exc:
        return f"{fields_help()}\n\n(--preset {name}: {exc})"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    wants_help = any(a in ("-h", "--help") for a in argv)
    p = argparse.ArgumentParser(prog="python pipeline/run.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=_fields_epilog(argv) if wants_help else None)
    p.add_argument("stage", nargs="?", default="all", choices=STAGES,
                   help="all (the default: prepare, train, eval, generate) | prepare | validate DIR | train | eval | "
                        "generate | tune | export | runs (list the runs under run.root)")
    p.add_argument("target", nargs="?", help="validate: a dataset directory, a checkpoint directory or a run "
                                            "directory (its latest checkpoint); a path or a URI")
    p.add_argument("--preset", help="cpu | gpu | fineweb-32k | long-32k | test | a YAML preset file (default: by "
                                    "hardware)")
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
    cfg = load_config(args.preset, overrides)
    args.typed_fields = typed_fields(args.preset, overrides)
    cfg, notes = settle_fields(args.stage, args.typed_fields, cfg, no_ray=args.no_ray, space=args.space)
    for note in notes:
        print(f"note: {note}", flush=True)
    return cfg


# ------------------------------------------------------------------------------------------ stages
def stage_prepare(cfg: Config) -> Path:
    from pipeline.data.stages import prepare_main
    from pipeline.train.session.sizing import size_to_data

    if cfg.data.min_rows > 0 and not cfg.data.mixture:  # the rows the train stage would size the data to (sizing.py)
        return size_to_data(cfg, prepare_main, steps=False).dataset
    return prepare_main(cfg)


def stage_train(cfg: Config, args: argparse.Namespace):
    """Prepare (cached), then train every phase; returns (run_dir, SessionResult)."""
    from pipeline.train.session.resume import plan_resume
    from pipeline.train.session.train_session import TrainSession, load_phases

    if args.checkpoint and not args.resume:
        raise UsageError("train --checkpoint continues a run from one of its checkpoints: add --resume RUN (a new "
                         "run from another run's weights is a phase: --phases)")
    start_step, extended, reopened = None, "", None
    if args.resume:
        run_dir = find_run(cfg, args.resume)
        args.run_dir = run_dir  # what a Ctrl+C from here on leaves behind is this run (main)
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
        # a finished phase that grew is open again: the session records it once its up-front checks pass
        reopened = plan.phases_done if plan.phases_done != record.get("phases_done", 0) else None
    else:
        # the phases are checked before the run's directory is made: a refused file leaves nothing behind
        phases = load_phases(args.phases, cfg, preset=args.preset)  # a preset may bring its own (long-32k)
        run_dir = new_run_dir(cfg)
        args.run_dir = run_dir
    audit = args.audit_data or (bool(args.resume) and read_run_file(run_dir).get("audit_data", False))
    session = TrainSession(cfg, run_dir, phases, use_ray=not args.no_ray, audit_data=audit, start_step=start_step,
                           extended=extended, resume_from=args.checkpoint, phases_done=reopened)
    return run_dir, session.run(resume=bool(args.resume))


def latest_checkpoint(cfg: Config, args: argparse.Namespace) -> Path | str:
    """--checkpoint, else the --resume run's latest: a local directory (Path) or a URI on object storage."""
    from pipeline.storage import native
    from pipeline.train.engine import CheckpointError

    if args.checkpoint:
        run_dir = run_dir_of(cfg, args.checkpoint)  # a run directory: its latest checkpoint
        if run_dir is None:
            return native(args.checkpoint)
        ckpt = recorded_checkpoint(run_dir)
        if ckpt is None:
            raise CheckpointError(f"--checkpoint {args.checkpoint}: run {run_dir} has no checkpoint yet (status "
                                  f"{read_run_file(run_dir).get('status', '?')}); {CHECKPOINT_HINT}")
        return native(ckpt)
    if args.resume:
        run_dir = find_run(cfg, args.resume)
        ckpt = recorded_checkpoint(run_dir)
        if ckpt:
            return native(ckpt)
        raise CheckpointError(f"--resume {args.resume}: run {run_dir} has no checkpoint yet; {CHECKPOINT_HINT}")
    raise CheckpointError(f"no checkpoint given; {CHECKPOINT_HINT}, or --resume RUN")


def stage_eval(cfg: Config, checkpoint: Path | str, dataset_dir: Path | str | None = None,
               run_dir: Path | None = None) -> dict[str, float]:
    from pipeline.storage import local_copy
    from pipeline.tracking.tracker import TrackingError
    from pipeline.cli.eval import eval_report, evaluate_checkpoint, log_eval_to_run, run_dir_of_checkpoint

    stage("eval", f"{checkpoint} on the validation split")
    run_dir = run_dir or run_dir_of_checkpoint(checkpoint)
    with local_copy(checkpoint) as local:  # on object storage: one temporary copy for the eval and the log
        metrics = evaluate_checkpoint(local, dataset_dir)
        print(eval_report(local, metrics))  # a mixture: a table with one row per source
        try:
            logged = log_eval_to_run(local, metrics, run_dir, cfg.tracking.tracking_uri)
            print(f"eval: logged to MLflow run {logged[1]}" if logged else "eval: not logged (no tracked run for it)")
        except TrackingError as exc:  # the numbers are printed above; a store that is down does not undo them
            print(f"eval: not logged: {exc}")
    return metrics


def long_context_options(args: argparse.Namespace) -> tuple[list[int], list[int] | None] | None:
    """(--seq-len factors, --passkey-lengths) when the eval stage is asked for a long-context measure, else None;
    bad values are one-line errors here, before any model loads."""
    from pipeline.eval.passkey import parse_lengths
    from pipeline.eval.long_context import parse_factors

    if not (args.by_position or args.seq_len or args.passkey or args.passkey_lengths):
        return None
    if args.stage != "eval":
        raise UsageError("--by-position, --seq-len and --passkey are options of the eval stage: "
                         "python pipeline/run.py eval --resume RUN --by-position")
    if args.passkey_lengths and not args.passkey:
        raise UsageError("--passkey-lengths sets the passkey grid: add --passkey")
    if args.passkey_trials < 1:
        raise UsageError(f"--passkey-trials {args.passkey_trials}: give at least 1 key per grid cell")
    return (parse_factors(args.seq_len) if args.seq_len else [],
            parse_lengths(args.passkey_lengths) if args.passkey_lengths else None)


def stage_long_context(cfg: Config, checkpoint: Path | str, args: argparse.Namespace, run_dir: Path | None = None):
    """eval --by-position / --seq-len Kx / --passkey (pipeline/eval/long_context.py), logged to the run that trained the
    checkpoint; returns the LongContextReport."""
    from pipeline.eval.long_context import evaluate_long_context, log_long_context
    from pipeline.storage import local_copy
    from pipeline.tracking.tracker import TrackingError, check_tracking_uri
    from pipeline.cli.eval import run_dir_of_checkpoint, tracked_run

    factors, lengths = long_context_options(args)
    asked = ["by position"] * args.by_position + [f"rows {k}x as long" for k in factors] + ["passkey"] * args.passkey
    stage("eval", f"long context: {', '.join(asked)}")
    with local_copy(checkpoint) as local:
        report = evaluate_long_context(local, by_position=args.by_position, factors=factors, passkey=args.passkey,
                                       passkey_lengths=lengths, passkey_trials=args.passkey_trials)
    run_dir = run_dir or run_dir_of_checkpoint(checkpoint)
    try:
        run = tracked_run(run_dir, cfg.tracking.tracking_uri)
        if run is None:
            print("eval: long-context results not logged (no tracked run for this checkpoint)")
        else:
            check_tracking_uri(run[0])
            files = log_long_context(report, run[0], run[1], title=run_dir.name if run_dir else None)
            print(f"eval: long-context metrics and pictures logged to MLflow run {run[1]}")
            for f in files:  # where to open them without the MLflow UI
                print(f"eval: {f}")
    except TrackingError as exc:  # the numbers are printed above
        print(f"eval: long-context results not logged: {exc}")
    return report


def stage_validate(cfg: Config, args: argparse.Namespace, argv: list[str]) -> int:
    """validate TARGET: a dataset (its manifest), a checkpoint (its meta.json: every file against it, and that it
    loads) or a run directory (its latest checkpoint); 0 when whole, 1 with the report's reasons."""
    from pipeline.train.checkpoints.broken import is_checkpoint, offered_command
    from pipeline.train.checkpoints.validate import validate_checkpoint

    target, run_dir = args.target, run_dir_of(cfg, args.target)
    if run_dir is not None:
        target = recorded_checkpoint(run_dir)
        if target is None:
            raise UsageError(f"validate {args.target}: run {run_dir} has no checkpoint yet; validate a dataset "
                             f"directory or a checkpoint")
    elif "://" not in target and not Path(target).exists():
        raise UsageError(f"validate {target}: no such path, and no run named {target} under run.root "
                         f"({cfg.run.root}); validate takes a dataset directory, a checkpoint directory, a run "
                         f"directory or a run's name (add --run.root=DIR for a run under another root)")
    elif not is_checkpoint(target):
        from pipeline.data.stages import validate_main

        return validate_main(target)
    return validate_checkpoint(target, lambda prev: offered_command(argv, prev, "validate", args.target))


def stage_export(cfg: Config, args: argparse.Namespace) -> None:
    from pipeline.cli.eval import run_dir_of_checkpoint, tracked_run
    from pipeline.train.checkpoints.broken import diagnosed
    from pipeline.train.serve.export import export_checkpoint, register_export

    if not args.out:
        raise UsageError("export needs --out DIR: python pipeline/run.py export --resume RUN --out DIR")
    checkpoint = latest_checkpoint(cfg, args)
    run = None
    if args.register:  # find the training run before writing anything
        run_dir = find_run(cfg, args.resume) if args.resume else run_dir_of_checkpoint(checkpoint)
        run = tracked_run(run_dir, cfg.tracking.tracking_uri)
        if run is None:
            raise UsageError(f"--register needs the MLflow run that trained {checkpoint}, and none was found (no "
                             f"run.json above it, or tracking was off); export without --register")
    stage("export", f"{checkpoint} -> {args.out} (Hugging Face LlamaForCausalLM)")
    with diagnosed(checkpoint):  # a file that does not load: one line, the previous checkpoint offered
        result = export_checkpoint(checkpoint, args.out, overwrite=args.overwrite)
    print(f"exported {result.out_dir}: load it with transformers.AutoModelForCausalLM.from_pretrained / AutoTokenizer")
    if run is not None:
        version = register_export(result, run[0], run[1], args.register)
        print(f"registered {args.register} version {version.version} (run {run[1]}) in {run[0]}")


def stage_generate(checkpoint: Path | str, args: argparse.Namespace, prompts: list[str]) -> list[str]:
    """`prompts`: pipeline/train/serve/options.py generate_prompts (the flags checked before anything loads)."""
    from pipeline.train.checkpoints.broken import diagnosed
    from pipeline.train.serve.generate import generate_texts, load_for_generation

    stage("generate", f"{len(prompts)} prompt(s), {args.max_new_tokens} new tokens, top-p {args.top_p}")
    with diagnosed(checkpoint):  # the checkpoint's own files only: a file that does not load, the previous offered
        decoder, tokenizer = load_for_generation(checkpoint)
    out = generate_texts(decoder, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    for p, text in zip(prompts, out.texts):
        print(f"--- {p!r}\n{text}")
    t = out.timings
    print(f"generate: batch {len(prompts)}, {out.new_tokens} new tokens; prefill {t.prefill_tokens_per_s:,.0f} "
          f"tokens/s ({t.prefill_tokens} prompt tokens), decode {t.decode_tokens_per_s:,.0f} tokens/s "
          f"({t.decode_tokens} tokens{', CUDA graph' if t.cuda_graph else ''}); first-step warm-up "
          f"{t.warmup_s:.2f} s apart ({t.warmup_tokens} tokens: sampler compile, warm-up steps, graph capture)")
    return out.texts


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
        long_context = long_context_options(args) is not None  # eval's options: checked before any stage runs
        if args.stage in ("all", "generate"):  # generate's flags and prompts file too
            from pipeline.train.serve.options import generate_prompts

            prompts = generate_prompts(args)
        if args.stage == "validate":
            if not args.target:
                raise UsageError("validate needs a dataset directory, a checkpoint or a run: python pipeline/run.py "
                                 "validate DIR")
            cfg = build_config(args, rest)
            check_run_root(cfg.run.root)
            return stage_validate(cfg, args, argv)
        cfg = build_config(args, rest)
        check_run_root(cfg.run.root)  # a file there: one line, before any stage writes under it
        if args.stage == "runs":
            from pipeline.cli.runs_list import runs_main

            return runs_main(cfg.run.root)
        if args.stage == "prepare":
            print(f"dataset: {stage_prepare(cfg)}")
            return 0
        if args.stage == "tune":
            from pipeline.sweep.tune import tune_main

            return tune_main(cfg, args.space)
        if args.stage in ("eval", "generate"):
            from pipeline.train.checkpoints.broken import diagnosed
        if args.stage == "eval":
            checkpoint = latest_checkpoint(cfg, args)
            run_dir = (find_run(cfg, args.resume) if args.resume else  # the run to log to, also for a bucket's checkpoint
                       run_dir_of(cfg, args.checkpoint) if args.checkpoint else None)
            with diagnosed(checkpoint):  # a file that does not load: one line, the previous checkpoint offered
                stage_eval(cfg, checkpoint, run_dir=run_dir)
                if long_context:
                    stage_long_context(cfg, checkpoint, args, run_dir)
            return 0
        if args.stage == "generate":
            stage_generate(latest_checkpoint(cfg, args), args, prompts)
            return 0
        if args.stage == "export":
            stage_export(cfg, args)
            return 0
        run_dir, result = stage_train(cfg, args)
        if result is None:  # a finished run with nothing more asked of it: stage_train said so
            return 0
        if result.stopped:
            from pipeline.train.session.resume import resume_command

            print(f"\nstopped after a checkpoint: {result.checkpoint}\n"
                  f"continue with: {resume_command(run_dir, args.no_ray)}")
            return 0
        if args.stage == "all" and result.checkpoint is not None:
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


def user_error(exc: BaseException) -> BaseException | None:
    """The first of the project's own ValueError/RuntimeError subclasses in `exc`'s chain (Ray's wrappers
    followed: pipeline/ray_runtime.py find_cause), or None."""
    def ours(e: BaseException) -> bool:
        return (isinstance(e, (ValueError, RuntimeError))
                and type(e).__module__.split(".")[0] in ("pipeline", "model", "cuda_ops"))

    if ours(exc):
        return exc
    from pipeline.ray_runtime import find_cause

    return find_cause(exc, ours)


if __name__ == "__main__":
    sys.exit(main())
