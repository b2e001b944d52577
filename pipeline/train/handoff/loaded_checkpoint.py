"""A checkpoint loaded once for evaluation: its weights in an Engine on one process (whole rows, any layout: a
sharded FSDP checkpoint is consolidated on load, one trained with context parallelism runs at degree 1), its
meta.json, the config it trained with and its dataset's manifest, each read once. What `eval` (pipeline/cli/eval.py)
and the downstream tasks scored beside training (pipeline/train/task_scoring.py) hand to pipeline/eval/.

    loaded = load_for_eval("runs/<run>/checkpoints/phase0/step_000200")
    loaded.engine.module.decoder, loaded.step, loaded.manifest
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import Config, from_dict

if TYPE_CHECKING:  # the engine (torch) and the shards (pyarrow) load with a checkpoint
    from pipeline.data.shards import Manifest
    from pipeline.train.engine import Engine


@dataclass
class LoadedCheckpoint:
    """A checkpoint's weights in an Engine, with what was read to build it, for every measure of one command."""
    engine: Engine
    meta: dict[str, Any]  # the checkpoint's meta.json
    cfg: Config  # the config it trained with
    dataset_dir: str | Path  # the dataset it is evaluated on
    manifest: Manifest  # that dataset's manifest.json

    @property
    def step(self) -> int:
        return self.meta.get("counters", {}).get("step", 0)


def load_for_eval(checkpoint: str | Path, dataset_dir: str | Path | None = None) -> LoadedCheckpoint:
    """The checkpoint's weights in an Engine (compile off; the training state is not read) beside the dataset it
    trained on (or `dataset_dir`), checked compatible with it; meta.json and manifest.json are read once here."""
    from pipeline.data.shards import check_compatible, load_manifest
    from pipeline.storage import local_copy
    from pipeline.train.engine import CheckpointError, Engine, read_checkpoint_meta

    with local_copy(checkpoint) as local:  # a checkpoint on object storage: a temporary local copy
        meta = read_checkpoint_meta(local, weights_only=True)
        cfg = from_dict(meta["config"])
        dataset_dir = dataset_dir or meta.get("dataset_dir")
        if not dataset_dir:
            raise CheckpointError(f"checkpoint {checkpoint} does not name its dataset; pass the dataset directory")
        manifest = load_manifest(dataset_dir)
        check_compatible(manifest, vocab_size=meta["vocab_size"], seq_len=meta["seq_len"])
        engine = Engine(cfg.replace({"model.compile": "off"}), manifest.vocab_size, context=1,
                        experts=1)  # whole rows and every expert, one process
        engine.load(local, weights_only_model=True, meta=meta)
    return LoadedCheckpoint(engine, meta, cfg, dataset_dir, manifest)
