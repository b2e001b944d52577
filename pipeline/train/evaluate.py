"""Evaluate a checkpoint on its dataset's whole validation split, Ray-free.

    python pipeline/run.py eval --checkpoint runs/<run>/checkpoints/phase0/step_000200
    python pipeline/run.py eval --resume runs/<run>          # the run's latest checkpoint
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import from_dict
from pipeline.train.engine import CheckpointError, Engine, read_checkpoint_meta


def evaluate_checkpoint(checkpoint: str | Path, dataset_dir: str | Path | None = None,
                        max_batches: int | None = None) -> dict[str, float]:
    """{eval/loss, eval/ppl, eval/accuracy} over the validation split the checkpoint was trained with
    (or `dataset_dir`), in batches of the run's train.batch_size."""
    from pipeline.data.shards import ShardReader, check_compatible, load_manifest

    meta = read_checkpoint_meta(checkpoint)
    cfg = from_dict(meta["config"])
    dataset_dir = dataset_dir or meta.get("dataset_dir")
    if not dataset_dir:
        raise CheckpointError(f"checkpoint {checkpoint} does not name its dataset; pass the dataset directory")
    manifest = load_manifest(dataset_dir)
    check_compatible(manifest, vocab_size=meta["vocab_size"], seq_len=meta["seq_len"])
    engine = Engine(cfg.replace({"model.compile": "off"}), manifest.vocab_size)
    engine.load(checkpoint, weights_only_model=True)
    batch = min(cfg.train.batch_size, max(1, manifest.rows("val")))
    reader = ShardReader(dataset_dir, "val", batch, seed=0, epoch=0, start=0)
    m = engine.evaluate(reader, max_batches=max_batches)
    return {"eval/loss": m["val/loss"], "eval/ppl": m["val/ppl"], "eval/accuracy": m["val/accuracy"]}
