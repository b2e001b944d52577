"""Evaluate a checkpoint on its dataset's whole validation split, Ray-free.

    python pipeline/run.py eval --checkpoint runs/<run>/checkpoints/phase0/step_000200
    python pipeline/run.py eval --resume runs/<run>          # the run's latest checkpoint
    python pipeline/run.py eval --checkpoint s3://bucket/longtrain/<run>/ray/phase0/checkpoint_... --resume <run>

For a mixture it evaluates every source's validation split (eval/<source>/loss, ppl, bpb, accuracy; a table
with one row per source) and eval/loss is the aggregate weighted by the run's mixture.

The metrics (eval/loss, eval/ppl, eval/accuracy) are also logged, at the checkpoint's step, to the MLflow run
that trained the checkpoint (found through the run directory's run.json), without changing its status.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import from_dict
from pipeline.storage import is_uri, local_copy
from pipeline.train.engine import CheckpointError, Engine, read_checkpoint_meta


def load_for_eval(checkpoint: str | Path, dataset_dir: str | Path | None = None):
    """(engine, meta, cfg, dataset_dir, manifest): the checkpoint's weights in an Engine (compile off; the training
    state is not read) beside the dataset it trained on (or `dataset_dir`), checked compatible with it."""
    from pipeline.data.shards import check_compatible, load_manifest

    with local_copy(checkpoint) as local:  # a checkpoint on object storage: a temporary local copy
        meta = read_checkpoint_meta(local, weights_only=True)
        cfg = from_dict(meta["config"])
        dataset_dir = dataset_dir or meta.get("dataset_dir")
        if not dataset_dir:
            raise CheckpointError(f"checkpoint {checkpoint} does not name its dataset; pass the dataset directory")
        manifest = load_manifest(dataset_dir)
        check_compatible(manifest, vocab_size=meta["vocab_size"], seq_len=meta["seq_len"])
        engine = Engine(cfg.replace({"model.compile": "off"}), manifest.vocab_size)
        engine.load(local, weights_only_model=True, meta=meta)
    return engine, meta, cfg, dataset_dir, manifest


def evaluate_checkpoint(checkpoint: str | Path, dataset_dir: str | Path | None = None,
                        max_batches: int | None = None) -> dict[str, float]:
    """{eval/loss, eval/ppl, eval/accuracy} over every row of the validation split the checkpoint was trained with
    (or `dataset_dir`), in batches of the run's train.batch_size."""
    from pipeline.data.mixture import mixture_of
    from pipeline.data.shards import eval_reader
    from pipeline.eval.sources import SourceValidation

    engine, meta, cfg, dataset_dir, _ = load_for_eval(checkpoint, dataset_dir)
    mix = mixture_of(dataset_dir, cfg)
    if mix is not None:  # a mixture: every source's split, and the aggregate weighted by the run's mixture
        return SourceValidation(mix, cfg.train.batch_size, prefix="eval")(engine, max_batches)
    m = engine.evaluate(eval_reader(dataset_dir, cfg.train.batch_size), max_batches=max_batches)
    return {"eval/loss": m["val/loss"], "eval/ppl": m["val/ppl"], "eval/accuracy": m["val/accuracy"]}


def eval_report(checkpoint: str | Path, metrics: dict[str, float]) -> str:
    """What the `eval` stage prints: the eval/* line and, for a mixture, a table with one row per source."""
    from pipeline.data.mixture_spec import normalized, parse_mixture
    from pipeline.eval.sources import source_names, source_table

    line = "eval: " + "  ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.count("/") == 1)
    if not source_names(metrics, "eval"):
        return line
    with local_copy(checkpoint) as local:
        mixture = read_checkpoint_meta(local, weights_only=True)["config"]["data"]["mixture"]
    specs = parse_mixture(mixture)
    return line + "\n" + source_table(metrics, {s.name: w for s, w in zip(specs, normalized(specs))}, "eval")


def run_dir_of_checkpoint(checkpoint: str | Path) -> Path | None:
    """The run directory (the nearest parent holding run.json) of a local checkpoint under it, else None (a
    checkpoint on object storage: pass the run with --resume)."""
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
    from pipeline.train.session.run_dir import read_run_file

    if run_dir is None:
        return None
    record = read_run_file(run_dir)
    if not record.get("mlflow_run_id"):
        return None
    return tracking_uri or resolve_tracking_uri(from_flat(record["config"])), record["mlflow_run_id"]


def log_eval_to_run(checkpoint: str | Path, metrics: dict[str, float], run_dir: Path | None = None,
                    tracking_uri: str = "") -> tuple[str, str] | None:
    """Log eval/* at the checkpoint's step to the MLflow run that trained it (found through run.json);
    returns (tracking URI, run id), or None when that run was not tracked or cannot be found."""
    from pipeline.tracking.lineage import log_metrics_to_run
    from pipeline.tracking.tracker import check_tracking_uri

    run = tracked_run(run_dir or run_dir_of_checkpoint(checkpoint), tracking_uri)
    if run is None:
        return None
    check_tracking_uri(run[0])
    with local_copy(checkpoint) as local:
        step = read_checkpoint_meta(local, weights_only=True).get("counters", {}).get("step", 0)
    log_metrics_to_run(run[0], run[1], metrics, step)
    return run
