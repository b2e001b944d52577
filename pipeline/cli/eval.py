"""`python pipeline/run.py eval`: a checkpoint on its dataset's whole validation split, Ray-free, and on request the
long-context measures (pipeline/eval/); the results logged to the MLflow run that trained it.

    python pipeline/run.py eval --checkpoint runs/<run>/checkpoints/phase0/step_000200
    python pipeline/run.py eval --resume runs/<run>          # the run's latest checkpoint
    python pipeline/run.py eval --checkpoint s3://bucket/longtrain/<run>/ray/phase0/checkpoint_... --resume <run>
    python pipeline/run.py eval --resume runs/<run> --by-position --seq-len 2x --passkey   # long context
    python pipeline/run.py eval runs/<run> --tasks builtin_cloze,hellaswag --limit 200     # harness tasks instead
    python pipeline/run.py eval models:/my-model/3 --tasks my_tasks/qa.yaml               # a registered model

    loaded = load_for_eval(checkpoint)                 # meta.json and the dataset's manifest.json, each read once
    metrics = evaluate_checkpoint(checkpoint, loaded=loaded)
    report = evaluate_long_context(checkpoint, by_position=True, factors=[2], passkey=True, loaded=loaded)

For a mixture it evaluates every source's validation split (eval/<source>/loss, ppl, bpb, accuracy; a table
with one row per source) and eval/loss is the aggregate weighted by the run's mixture.

The metrics (eval/loss, eval/ppl, eval/accuracy) are also logged, at the checkpoint's step, to the MLflow run
that trained the checkpoint (found through the run directory's run.json), without changing its status.

One command loads the checkpoint once (one local copy of a checkpoint on object storage), reads its meta.json and
its dataset's manifest.json once, and hands them down to the measures (bench/eval_command_reads.py counts the
storage requests).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

from pipeline.cli.checkpoint_arg import checkpoint_of_args, run_dir_of_args, run_dir_of_checkpoint, tracked_run
from pipeline.cli.usage_error import UsageError
from pipeline.config import Config
from pipeline.console import stage
from pipeline.tracking.names import EVAL, EVAL_ACCURACY, EVAL_LOSS, EVAL_PPL, VAL_ACCURACY, VAL_LOSS, VAL_PPL
from pipeline.train.handoff.loaded_checkpoint import LoadedCheckpoint, load_for_eval  # noqa: F401 (callers use it here)

# ------------------------------------------------------------------------------------------ the mean loss
def evaluate_checkpoint(checkpoint: str | Path, dataset_dir: str | Path | None = None,
                        max_batches: int | None = None, loaded: LoadedCheckpoint | None = None) -> dict[str, float]:
    """{eval/loss, eval/ppl, eval/accuracy} over every row of the validation split the checkpoint was trained with
    (or `dataset_dir`), in batches of the run's train.batch_size. `loaded`: load_for_eval's, when the caller has it."""
    from pipeline.data.mixture import mixture_of
    from pipeline.data.shards import eval_reader
    from pipeline.eval.sources import SourceValidation

    loaded = loaded or load_for_eval(checkpoint, dataset_dir)
    engine, cfg, dataset_dir = loaded.engine, loaded.cfg, loaded.dataset_dir
    mix = mixture_of(dataset_dir, cfg, manifest=loaded.manifest)
    if mix is not None:  # a mixture: every source's split, and the aggregate weighted by the run's mixture
        return SourceValidation(mix, cfg.train.batch_size, prefix=EVAL)(engine, max_batches)
    m = engine.evaluate(eval_reader(dataset_dir, cfg.train.batch_size, manifest=loaded.manifest),
                        max_batches=max_batches)
    return {EVAL_LOSS: m[VAL_LOSS], EVAL_PPL: m[VAL_PPL], EVAL_ACCURACY: m[VAL_ACCURACY]}


def eval_report(checkpoint: str | Path, metrics: dict[str, float], meta: dict[str, Any] | None = None) -> str:
    """What the `eval` stage prints: the eval/* line and, for a mixture, a table with one row per source. `meta`:
    the checkpoint's meta.json, when the caller has read it."""
    from pipeline.mixture_spec import normalized, parse_mixture
    from pipeline.eval.sources import source_names, source_table

    line = "eval: " + "  ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.count("/") == 1)
    if not source_names(metrics, "eval"):
        return line
    if meta is None:
        from pipeline.storage import local_copy
        from pipeline.train.engine import read_checkpoint_meta

        with local_copy(checkpoint) as local:
            meta = read_checkpoint_meta(local, weights_only=True)
    specs = parse_mixture(meta["config"]["data"]["mixture"])
    return line + "\n" + source_table(metrics, {s.name: w for s, w in zip(specs, normalized(specs))}, "eval")


def log_eval_to_run(checkpoint: str | Path, metrics: dict[str, float], run_dir: Path | None = None,
                    tracking_uri: str = "", meta: dict[str, Any] | None = None) -> tuple[str, str] | None:
    """Log eval/* at the checkpoint's step to the MLflow run that trained it (found through run.json);
    returns (tracking URI, run id), or None when that run was not tracked or cannot be found. `meta`: the
    checkpoint's meta.json, when the caller has read it."""
    from pipeline.tracking.lineage import log_metrics_to_run
    from pipeline.tracking.tracker import check_tracking_uri

    run = tracked_run(run_dir or run_dir_of_checkpoint(checkpoint), tracking_uri)
    if run is None:
        return None
    check_tracking_uri(run[0])
    if meta is None:
        from pipeline.storage import local_copy
        from pipeline.train.engine import read_checkpoint_meta

        with local_copy(checkpoint) as local:
            meta = read_checkpoint_meta(local, weights_only=True)
    step = meta.get("counters", {}).get("step", 0)
    log_metrics_to_run(run[0], run[1], metrics, step)
    return run


def mean_loss_stage(cfg: Config, checkpoint: Path | str, loaded: LoadedCheckpoint,
                    run_dir: Path | None = None) -> dict[str, float]:
    """The mean loss of `loaded` (the checkpoint `checkpoint`), printed and logged to the run that trained it."""
    from pipeline.tracking.tracker import TrackingError

    run_dir = run_dir or run_dir_of_checkpoint(checkpoint)
    metrics = evaluate_checkpoint(checkpoint, loaded=loaded)
    print(eval_report(checkpoint, metrics, loaded.meta))  # a mixture: a table with one row per source
    try:
        logged = log_eval_to_run(checkpoint, metrics, run_dir, cfg.tracking.tracking_uri, meta=loaded.meta)
        print(f"eval: logged to MLflow run {logged[1]}" if logged else "eval: not logged (no tracked run for it)")
    except TrackingError as exc:  # the numbers are printed above; a store that is down does not undo them
        print(f"eval: not logged: {exc}")
    return metrics


def stage_eval(cfg: Config, checkpoint: Path | str, dataset_dir: Path | str | None = None,
               run_dir: Path | None = None) -> dict[str, float]:
    """The mean-loss eval of `checkpoint` (the `all` command's, after training)."""
    from pipeline.storage import local_copy

    stage("eval", f"{checkpoint} on the validation split")
    with local_copy(checkpoint) as local:  # on object storage: one temporary copy for the eval and the log
        return mean_loss_stage(cfg, checkpoint, load_for_eval(local, dataset_dir), run_dir)


# ------------------------------------------------------------------------------------------ long context
def long_context_options(args: argparse.Namespace) -> tuple[list[int], list[int] | None] | None:
    """(--seq-len factors, --passkey-lengths) when the eval stage is asked for a long-context measure, else None;
    bad values are one-line errors here, before any model loads."""
    if not (args.by_position or args.seq_len or args.passkey or args.passkey_lengths):
        return None  # before the imports below: they load torch, which a refused command line should not wait for
    from pipeline.eval.passkey import parse_lengths
    from pipeline.eval.long_context import parse_factors

    if args.stage != "eval":
        raise UsageError("--by-position, --seq-len and --passkey are options of the eval stage: "
                         "python pipeline/run.py eval --resume RUN --by-position")
    if args.passkey_lengths and not args.passkey:
        raise UsageError("--passkey-lengths sets the passkey grid: add --passkey")
    if args.passkey_trials < 1:
        raise UsageError(f"--passkey-trials {args.passkey_trials}: give at least 1 key per grid cell")
    return (parse_factors(args.seq_len) if args.seq_len else [],
            parse_lengths(args.passkey_lengths) if args.passkey_lengths else None)


def evaluate_long_context(checkpoint: str | Path, dataset_dir: str | Path | None = None, *, by_position: bool = False,
                          factors: list[int] = (), passkey: bool = False, passkey_lengths: list[int] | None = None,
                          passkey_trials: int = 5, echo: Callable[[str], None] = print, show_progress: bool = True,
                          loaded: LoadedCheckpoint | None = None):
    """The asked long-context measures (pipeline/eval/long_context.py measure_long_context) on `checkpoint` over
    its dataset's validation split (or `dataset_dir`); `loaded`: load_for_eval's, when the caller has it. Returns
    the LongContextReport."""
    from pipeline.eval.long_context import measure_long_context
    from pipeline.data.shards import dataset_tokenizer

    loaded = loaded or load_for_eval(checkpoint, dataset_dir)
    return measure_long_context(loaded.engine, loaded.dataset_dir, loaded.manifest.seq_len, loaded.cfg.train.batch_size,
                                step=loaded.step, seed=loaded.cfg.train.seed, manifest=loaded.manifest,
                                tokenizer=dataset_tokenizer(loaded.dataset_dir) if passkey else None,
                                by_position=by_position, factors=factors, passkey=passkey,
                                passkey_lengths=passkey_lengths, passkey_trials=passkey_trials, echo=echo,
                                show_progress=show_progress)


def stage_long_context(cfg: Config, checkpoint: Path | str, args: argparse.Namespace, run_dir: Path | None,
                       loaded: LoadedCheckpoint):
    """eval --by-position / --seq-len Kx / --passkey on `loaded` (the checkpoint `checkpoint`), logged to the run
    that trained the checkpoint; returns the LongContextReport."""
    from pipeline.eval.long_context import log_long_context
    from pipeline.tracking.tracker import TrackingError, check_tracking_uri

    factors, lengths = long_context_options(args)
    asked = ["by position"] * args.by_position + [f"rows {k}x as long" for k in factors] + ["passkey"] * args.passkey
    stage("eval", f"long context: {', '.join(asked)}")
    report = evaluate_long_context(checkpoint, by_position=args.by_position, factors=factors, passkey=args.passkey,
                                   passkey_lengths=lengths, passkey_trials=args.passkey_trials, loaded=loaded)
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


# ------------------------------------------------------------------------------------------ downstream tasks
def tasks_asked(args: argparse.Namespace) -> bool:
    """Whether the command line asked for lm-evaluation-harness tasks (--tasks or --eval.tasks typed; a preset's
    eval.tasks is for training)."""
    return bool(str(getattr(args, "typed_fields", {}).get("eval.tasks", "")).strip())


def stage_tasks(cfg: Config, checkpoint: Path | str, run_dir: Path | None, loaded: LoadedCheckpoint):
    """eval --tasks on `loaded`: the harness's table, the scores logged to the run that trained the checkpoint at
    its step (eval/<task>/<metric>, the FAILED tags, eval_tasks.png). Returns the TaskReport."""
    from pipeline.data.shards import dataset_tokenizer
    from pipeline.eval.harness_model import LongtrainLM
    from pipeline.eval.harness_tasks import resolve_tasks, score_tasks

    e = cfg.eval
    stage("eval", f"tasks {e.tasks} at step {loaded.step} (lm-evaluation-harness, offline)")
    tokenizer = dataset_tokenizer(loaded.dataset_dir, checkpoint, manifest=loaded.manifest)
    specs = resolve_tasks(e.tasks, loaded.dataset_dir, loaded.manifest, tokenizer)
    lm = LongtrainLM(loaded.engine.module.decoder, tokenizer, loaded.cfg.data.seq_len)
    report = score_tasks(lm, specs, num_fewshot=e.num_fewshot, limit=e.limit, step=loaded.step)
    print(report.table())
    _log_tasks(cfg, report, tracked_run(run_dir or run_dir_of_checkpoint(checkpoint), cfg.tracking.tracking_uri),
               run_dir.name if run_dir else None)
    return report


def _log_tasks(cfg: Config, report, run: tuple[str, str] | None, title: str | None) -> None:
    from pipeline.eval.harness_tasks import log_task_report
    from pipeline.tracking.tracker import TrackingError, check_tracking_uri

    if run is None:
        print("eval: task scores not logged (no tracked run for this model)")
        return
    try:
        check_tracking_uri(run[0])
        log_task_report(report, run[0], run[1], title=f"{title + ': ' if title else ''}downstream tasks")
        print(f"eval: task scores logged to MLflow run {run[1]} at step {report.step}")
    except TrackingError as exc:  # the table is printed above
        print(f"eval: task scores not logged: {exc}")


def registered_model_tasks(cfg: Config, uri: str):
    """eval models:/NAME/VERSION --tasks ...: a registered model is a Hugging Face export (pipeline/train/handoff/
    hf_export.py), so it is scored by the harness's own Hugging Face backend (the `hf` extra and accelerate), with
    the same tokenization as a checkpoint (no BOS; EOS as the empty context), and logged to the run that trained it
    at the step its version records."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from pipeline.eval.harness_tasks import offline, resolve_tasks, score_tasks
    from pipeline.tracking.tracker import resolve_tracking_uri

    offline()
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as exc:
        raise UsageError(f"scoring a registered model needs the harness's Hugging Face backend ({exc.name} is "
                         f"missing): pip install -e '.[hf,eval]' accelerate") from None
    parts = uri[len("models:/"):].strip("/").split("/")
    if len(parts) != 2 or not parts[1].isdigit():
        raise UsageError(f"{uri}: name a registered model's version as models:/NAME/VERSION")
    tracking_uri = resolve_tracking_uri(cfg)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    version = client.get_model_version(parts[0], parts[1])
    step = int(version.tags.get("step", 0) or 0)
    stage("eval", f"tasks {cfg.eval.tasks} on {uri} (step {step}; the harness's Hugging Face backend)")
    mlflow.set_tracking_uri(tracking_uri)
    local = mlflow.artifacts.download_artifacts(artifact_uri=uri)
    import transformers

    eos = transformers.AutoTokenizer.from_pretrained(local).eos_token_id
    lm = HFLM(pretrained=local, backend="causal", add_bos_token=False, prefix_token_id=eos, device="cpu",
              batch_size=8)
    report = score_tasks(lm, resolve_tasks(cfg.eval.tasks), num_fewshot=cfg.eval.num_fewshot, limit=cfg.eval.limit,
                         step=step)
    print(report.table())
    _log_tasks(cfg, report, (tracking_uri, version.run_id) if version.run_id else None, f"{parts[0]} v{parts[1]}")
    return report


# ------------------------------------------------------------------------------------------ the command
def eval_command(cfg: Config, args: argparse.Namespace) -> int:
    """eval: the checkpoint (the positional target, --checkpoint, or the --resume run's latest) loaded once; its mean
    loss, or with --tasks the lm-evaluation-harness tasks; then the long-context measures asked for, each logged to
    the run that trained it. A registered model (models:/NAME/VERSION) is scored on --tasks only."""
    from pipeline.storage import local_copy
    from pipeline.train.checkpoints.broken import diagnosed

    if getattr(args, "target", None):
        args.checkpoint = args.target
    long_context = long_context_options(args) is not None
    tasks = tasks_asked(args)
    if tasks:
        from pipeline.eval.harness_tasks import HarnessMissing, require_harness

        try:
            require_harness()
        except HarnessMissing as exc:
            raise UsageError(str(exc)) from None
    if args.checkpoint and str(args.checkpoint).startswith("models:/"):
        if not tasks or long_context:
            raise UsageError("a registered model is a Hugging Face export without its dataset: score it on "
                             "lm-evaluation-harness tasks, e.g. --tasks hellaswag (or a task YAML)")
        registered_model_tasks(cfg, args.checkpoint)
        return 0
    checkpoint = checkpoint_of_args(cfg, args)
    run_dir = run_dir_of_args(cfg, args)  # the run to log to, also for a bucket's checkpoint
    with diagnosed(checkpoint):  # a file that does not load: one line, the previous checkpoint offered
        if not tasks:
            stage("eval", f"{checkpoint} on the validation split")
        with local_copy(checkpoint) as local:  # on object storage: one temporary copy for every measure and log
            loaded = load_for_eval(local)
            if tasks:
                stage_tasks(cfg, checkpoint, run_dir, loaded)
            else:
                mean_loss_stage(cfg, checkpoint, loaded, run_dir)
            if long_context:
                stage_long_context(cfg, checkpoint, args, run_dir, loaded)
    return 0
