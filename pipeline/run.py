#!/usr/bin/env python
"""longtrain: raw text to a trained, tracked, comparable model, one command.

    python pipeline/run.py                                   # prepare -> train -> eval -> generate, embedded defaults
    python pipeline/run.py prepare --data.source=files --data.path='corpus/*.jsonl'
    python pipeline/run.py validate runs/datasets/<hash>     # or s3://bucket/longtrain/datasets/<hash>
    python pipeline/run.py train --preset gpu --ray.num_workers=8
    python pipeline/run.py train --resume runs/<run>         # continue a run from its latest complete checkpoint
    python pipeline/run.py train --resume runs/<run> --checkpoint <one of its checkpoints>   # ... or from that one
    python pipeline/run.py train --phases phases.yaml        # a curriculum: one dataset and step count per phase
    python pipeline/run.py train --no-ray                    # the same engine in one plain process
    python pipeline/run.py eval --checkpoint runs/<run>/checkpoint
    python pipeline/run.py generate --checkpoint runs/<run>/checkpoint --prompt "Once upon a time"
    python pipeline/run.py tune --space tune_spaces/bs_tier.yaml
    python pipeline/run.py export --resume runs/<run> --out hf/<name> [--overwrite] [--register NAME]
    ray job submit --working-dir . -- python pipeline/run.py --address auto --run.storage=s3://bucket/longtrain

Every config field can be overridden by its path (--train.batch_size=8); `--preset` picks a named
preset (cpu, gpu, fineweb-32k, test) or a YAML file; the default preset is gpu when CUDA is present, else cpu.
Every path that names data or results may be a URI (s3://, gs://, ...): data.path, run.storage (one bucket for
datasets, checkpoints and artifacts), data.dataset_store, ray.storage_path, --checkpoint, validate's target.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python pipeline/run.py`: make the project importable without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import Config, ConfigError, from_flat, load_config  # noqa: E402
from pipeline.console import plain_worker_prefixes, quiet_mlflow, stage  # noqa: E402
from pipeline.train.run_dir import find_run, new_run_dir, read_run_file  # noqa: E402

STAGES = ("all", "prepare", "validate", "train", "eval", "generate", "tune", "export")
REAL_CORPUS_COMMAND = "python pipeline/run.py --preset fineweb-32k"  # printed after a run sized to the built-in corpus


class UsageError(ValueError):
    """Bad command-line usage; printed as one line."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python pipeline/run.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Config fields (override with --<field>=VALUE):\n  " + "\n  ".join(
                                    __import__("pipeline.config", fromlist=["field_types"]).field_types()))
    p.add_argument("stage", nargs="?", default="all", choices=STAGES)
    p.add_argument("target", nargs="?", help="validate: the dataset directory (a path or a URI)")
    p.add_argument("--preset", help="cpu | gpu | fineweb-32k | test | a YAML preset file (default: by hardware)")
    p.add_argument("--resume", metavar="RUN", help="a run directory (or name under run.root) to continue")
    p.add_argument("--address", help="join this Ray cluster ('auto' = the running one); same as --ray.address")
    p.add_argument("--no-ray", action="store_true", help="train in this process with the Ray-free engine")
    p.add_argument("--phases", help="YAML list of phases: [{steps: N, overrides: {data.source: ...}}, ...]")
    p.add_argument("--checkpoint", help="eval/generate/export: a checkpoint directory or URI (default: the run's "
                                        "latest); train --resume RUN: the checkpoint to continue from")
    p.add_argument("--prompt", action="append", help="generate: a prompt (repeatable)")
    p.add_argument("--prompts-file", help="generate: a file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--space", help="tune: a search space file from tune_spaces/")
    p.add_argument("--audit-data", action="store_true", help="log the seq_ids each step consumed (data_audit/)")
    p.add_argument("--out", help="export: the Hugging Face model directory to write")
    p.add_argument("--overwrite", action="store_true", help="export: replace an existing --out directory")
    p.add_argument("--register", metavar="NAME", help="export: also register it in the MLflow Model Registry")
    return p.parse_known_args(argv)


def build_config(args: argparse.Namespace, rest: list[str]) -> Config:
    overrides = list(rest)
    if args.address:
        overrides.append(f"--ray.address={args.address}")
    return load_config(args.preset, overrides)


# ------------------------------------------------------------------------------------------ stages
def stage_prepare(cfg: Config) -> Path:
    from pipeline.data.stages import prepare_main
    from pipeline.train.sizing import size_to_data

    if cfg.data.min_rows > 0:  # the rows the train stage would size the data to (pipeline/train/sizing.py)
        return size_to_data(cfg, prepare_main, steps=False).dataset
    return prepare_main(cfg)


def stage_train(cfg: Config, args: argparse.Namespace):
    """Prepare (cached), then train every phase; returns (run_dir, SessionResult)."""
    from pipeline.train.session import Phase, TrainSession, load_phases

    if args.checkpoint and not args.resume:
        raise UsageError("train --checkpoint continues a run from one of its checkpoints: add --resume RUN (a new "
                         "run from another run's weights is a phase: --phases)")
    if args.resume:
        run_dir = find_run(cfg, args.resume)
        record = read_run_file(run_dir)
        saved = from_flat(record["config"])
        cli = {k: v for k, v in cfg.flat().items() if v != load_config(args.preset).flat()[k]}
        cfg = saved.replace(cli)  # the run's own config, with what this command line changed on top
        phases = [Phase(**p) for p in record["phases"]] if record.get("phases") else load_phases(None, cfg)
    else:
        run_dir = new_run_dir(cfg)
        phases = load_phases(args.phases, cfg)
    audit = args.audit_data or (bool(args.resume) and read_run_file(run_dir).get("audit_data", False))
    session = TrainSession(cfg, run_dir, phases, use_ray=not args.no_ray, audit_data=audit,
                           resume_from=args.checkpoint)
    return run_dir, session.run(resume=bool(args.resume))


def latest_checkpoint(cfg: Config, args: argparse.Namespace) -> Path | str:
    """--checkpoint, else the --resume run's latest: a local directory (Path) or a URI on object storage."""
    from pipeline.storage import native
    from pipeline.train.engine import CheckpointError

    if args.checkpoint:
        return native(args.checkpoint)
    if args.resume:
        run_dir = find_run(cfg, args.resume)
        ckpt = read_run_file(run_dir).get("checkpoint")
        if ckpt:
            return native(ckpt)
    raise CheckpointError("no checkpoint given; pass --checkpoint DIR or --resume RUN (a finished run)")


def stage_eval(cfg: Config, checkpoint: Path | str, dataset_dir: Path | str | None = None,
               run_dir: Path | None = None) -> dict[str, float]:
    from pipeline.storage import local_copy
    from pipeline.tracking.tracker import TrackingError
    from pipeline.train.evaluate import evaluate_checkpoint, log_eval_to_run, run_dir_of_checkpoint

    stage("eval", f"{checkpoint} on the validation split")
    run_dir = run_dir or run_dir_of_checkpoint(checkpoint)
    with local_copy(checkpoint) as local:  # on object storage: one temporary copy for the eval and the log
        metrics = evaluate_checkpoint(local, dataset_dir)
        print("eval: " + "  ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        try:
            logged = log_eval_to_run(local, metrics, run_dir, cfg.tracking.tracking_uri)
            print(f"eval: logged to MLflow run {logged[1]}" if logged else "eval: not logged (no tracked run for it)")
        except TrackingError as exc:  # the numbers are printed above; a store that is down does not undo them
            print(f"eval: not logged: {exc}")
    return metrics


def stage_export(cfg: Config, args: argparse.Namespace) -> None:
    from pipeline.train.evaluate import run_dir_of_checkpoint, tracked_run
    from pipeline.train.export import export_checkpoint, register_export

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
    result = export_checkpoint(checkpoint, args.out, overwrite=args.overwrite)
    print(f"exported {result.out_dir}: load it with transformers.AutoModelForCausalLM.from_pretrained / AutoTokenizer")
    if run is not None:
        version = register_export(result, run[0], run[1], args.register)
        print(f"registered {args.register} version {version.version} (run {run[1]}) in {run[0]}")


def stage_generate(checkpoint: Path | str, args: argparse.Namespace, prompts: list[str] | None = None) -> list[str]:
    from pipeline.train.generate import generate_from_checkpoint

    prompts = prompts or list(args.prompt or [])
    if args.prompts_file:
        prompts += [ln for ln in Path(args.prompts_file).read_text().splitlines() if ln.strip()]
    if not prompts:
        prompts = ["The ", "def ", "In this module"]
    stage("generate", f"{len(prompts)} prompt(s), {args.max_new_tokens} new tokens, top-p {args.top_p}")
    out = generate_from_checkpoint(checkpoint, prompts, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    for p, text in zip(prompts, out.texts):
        print(f"--- {p!r}\n{text}")
    t = out.timings
    print(f"generate: batch {len(prompts)}, {out.new_tokens} new tokens; prefill {t.prefill_tokens_per_s:,.0f} "
          f"tokens/s ({t.prefill_tokens} prompt tokens), decode {t.decode_tokens_per_s:,.0f} tokens/s "
          f"({t.decode_tokens} tokens{', CUDA graph' if t.cuda_graph else ''}); first-step warm-up "
          f"{t.warmup_s:.2f} s apart ({t.warmup_tokens} tokens: sampler compile, warm-up steps, graph capture)")
    return out.texts


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    quiet_mlflow()
    plain_worker_prefixes()
    try:
        if args.stage == "validate":
            from pipeline.data.stages import validate_main

            if not args.target:
                raise UsageError("validate needs a dataset directory: python pipeline/run.py validate DIR")
            return validate_main(args.target)
        cfg = build_config(args, rest)
        if args.stage == "prepare":
            print(f"dataset: {stage_prepare(cfg)}")
            return 0
        if args.stage == "tune":
            from pipeline.sweep.tune import tune_main

            return tune_main(cfg, args.space)
        if args.stage == "eval":
            stage_eval(cfg, latest_checkpoint(cfg, args), run_dir=find_run(cfg, args.resume) if args.resume else None)
            return 0
        if args.stage == "generate":
            stage_generate(latest_checkpoint(cfg, args), args)
            return 0
        if args.stage == "export":
            stage_export(cfg, args)
            return 0
        run_dir, result = stage_train(cfg, args)
        if result.stopped:
            print(f"\nstopped after a checkpoint: {result.checkpoint}\n"
                  f"continue with: python pipeline/run.py train --resume {run_dir}")
            return 0
        if args.stage == "all" and result.checkpoint is not None:
            stage_eval(result.cfg, result.checkpoint, run_dir=run_dir)
            stage_generate(result.checkpoint, args)
        print(f"\noutputs:    {run_dir}\ncheckpoint: {result.checkpoint}\ndatasets:   {', '.join(result.dataset_dirs)}\n"
              f"compare runs in the MLflow UI:\n  {result.ui_command}")
        if result.epochs is not None and result.cfg.data.source == "builtin":
            print(f"\nthe built-in corpus is small: this run passed over it {result.epochs:.1f} times. Train a real "
                  f"corpus at 32k (FineWeb-Edu streamed from the Hugging Face Hub, 2,000 steps; preset fineweb-32k):\n"
                  f"  {REAL_CORPUS_COMMAND}")
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ConfigError, UsageError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001
        # The project's own user-facing errors (DatasetError, CheckpointError, StorageError, TrackingError, ...)
        # carry one clear line naming the problem and the fix, also when Ray hands them back wrapped (RayTaskError,
        # Ray Train's TrainingFailedError): that line is printed. Anything else is a bug and keeps its traceback.
        found = user_error(exc)
        if found is None:
            raise
        print(f"error: {str(found).strip().splitlines()[0]}", file=sys.stderr)
        return 2


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
