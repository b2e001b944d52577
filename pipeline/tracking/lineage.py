"""Where a model came from, in MLflow: the dataset a run trained on (an MLflow dataset input), metrics added
to a finished run (the `eval` stage), and exported models as versions in the MLflow Model Registry.

    from pipeline.tracking.lineage import dataset_input, log_metrics_to_run, register_model_dir
    tracker.log_dataset_input(manifest, dataset_dir)             # Tracker method, built on dataset_input()
    log_metrics_to_run(uri, run_id, {"eval/loss": 2.1}, step=200)
    version = register_model_dir(uri, run_id, "hf/nano", "my-model", tags={"tier": "nano"})

Dataset inputs (a mixture: one per source, tagged with the source's name and weight): name = the corpus (Hugging Face name, files path or "builtin"), digest = the manifest's
settings hash (the identity of the packed data: source, tokenizer and packing settings; its first 16 hex digits,
as in the dataset directory's name, because MLflow caps digests at 36 characters), source = the Hugging
Face dataset or the local dataset directory, schema = the shard columns, profile = sequences, tokens,
seq_len, vocabulary. Runs on the same data share name and digest, so the MLflow UI groups them.

Registry: the exported directory is logged as the run's artifact `hf_model/`, then a model version is created
from it with run_id set (the Models page links back to the run) and the given tags. MLflow is imported inside
the functions, as in tracker.py.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from pipeline.storage import absolute
from pipeline.tracking.names import REGISTERED_TAG, dedup_param, dedup_shared_param

# `manifest` below is a pipeline.data.shards.Manifest, duck-typed: tracking does not import the data package.
Manifest = Any

REGISTERED_MODEL_ARTIFACT = "hf_model"  # the export's folder inside the training run's artifacts
DATASET_CONTEXT = "train"
DIGEST_CHARS = 16  # MLflow allows 36; 16 hex digits are what runs/datasets/<hash> is named by


def dataset_name(manifest: Manifest) -> str:
    src = manifest.source or {}
    kind = src.get("kind", "")
    if kind == "hf":
        return src.get("name", "hf") + (f"/{src['config']}" if src.get("config") else "")
    if kind == "files":
        return str(src.get("path", "files"))
    return kind or "dataset"


def dataset_profile(manifest: Manifest) -> dict[str, Any]:
    c = manifest.counts
    return {"sequences": manifest.rows("train") + manifest.rows("val"), "train_sequences": manifest.rows("train"),
            "val_sequences": manifest.rows("val"), "tokens": int(c.get("tokens_kept", 0)),
            "documents": int(c.get("documents", 0)), "seq_len": manifest.seq_len, "vocab_size": manifest.vocab_size,
            "tokenizer_sha256": manifest.tokenizer_sha256, "settings_hash": manifest.settings_hash,
            "dedup": {k: v for k, v in (getattr(manifest, "dedup", None) or {}).items()
                      if k in ("mode", "threshold", "ngram", *DEDUP_COUNTS, "shared_with")}}


DEDUP_COUNTS = ("documents_read", "removed_exact", "removed_near", "clusters_exact", "clusters_near", "kept")


def dedup_params(manifest: Manifest, source: str = "") -> dict[str, Any]:
    """The dataset's deduplication as MLflow params (names.py: `dedup/mode`, `dedup/removed_exact`, ...; a mixture's
    source: `dedup/<source>/...`, and `dedup/shared/<a>/<b>` per pair of sources it shared documents with, a before
    b): its settings and counts, from the manifest (none for a dataset made without deduplication)."""
    record = getattr(manifest, "dedup", None) or {}
    if not record:
        return {}
    out = {dedup_param(k, source or None): record[k] for k in ("mode", *DEDUP_COUNTS) if k in record}
    if record.get("mode") == "near":
        out.update({dedup_param(k, source or None): record[k] for k in ("threshold", "ngram", "bands", "rows")
                    if k in record})
    if source:
        for other, n in record.get("shared_with", {}).items():
            out[dedup_shared_param(*sorted([source, other]))] = n
    return out


def dataset_input(manifest: Manifest, dataset_dir: str | Path):
    """The MLflow dataset (mlflow.data.Dataset) describing a prepared dataset, without reading its shards."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.exceptions import MlflowException
    from mlflow.types import ColSpec, DataType, Schema
    from mlflow.types.schema import Array

    class PackedDataset(MetaDataset):
        """MetaDataset plus the packing profile (MetaDataset has none)."""

        @property
        def profile(self) -> dict[str, Any]:
            return dataset_profile(manifest)

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self.profile)}

    src = manifest.source or {}
    if src.get("kind") == "hf":
        source = HuggingFaceDatasetSource(path=src.get("name", ""), config_name=src.get("config") or None,
                                          split=src.get("split") or None)
    else:
        with warnings.catch_warnings():  # MLflow registers the local source twice and warns that it picked one
            warnings.simplefilter("ignore", UserWarning)
            try:  # a local directory, s3://, gs://, ... (MLflow's artifact dataset sources)
                source = resolve_dataset_source(absolute(dataset_dir))
            except MlflowException:  # a protocol MLflow has no source class for: the URI as it is
                source = HTTPDatasetSource(url=absolute(dataset_dir))
    schema = Schema([ColSpec(Array(DataType.integer), "tokens"), ColSpec(Array(DataType.integer), "doc_starts"),
                     ColSpec(DataType.long, "seq_id")])
    return PackedDataset(source, name=dataset_name(manifest), digest=manifest.settings_hash[:DIGEST_CHARS],
                         schema=schema)


def log_dataset_input(client, run_id: str, manifest: Manifest, dataset_dir: str | Path,
                      context: str = DATASET_CONTEXT, tags: Mapping[str, Any] | None = None) -> None:
    """`tags`: more input tags, e.g. a mixture source's MIXTURE_SOURCE_TAG, MIXTURE_WEIGHT_TAG (names.py)."""
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    from mlflow.exceptions import MlflowException

    entity = dataset_input(manifest, dataset_dir)._to_mlflow_entity()
    extra = [InputTag(str(k), str(v)) for k, v in (tags or {}).items()]
    inputs = [DatasetInput(entity, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context), *extra])]
    for attempt in range(_INPUT_ATTEMPTS):
        try:
            client.log_inputs(run_id, datasets=inputs)
            return
        except MlflowException as exc:
            # An MLflow server creates a dataset row on first use with a check-then-insert: runs that log the same
            # new dataset at the same moment (a sweep's trials) race, and the loser gets the store's unique-key
            # error. The dataset exists by then, so the same call again links it.
            if attempt + 1 == _INPUT_ATTEMPTS or not any(m in str(exc) for m in _UNIQUE_KEY_ERRORS):
                raise
            time.sleep(0.2 * (attempt + 1))


_INPUT_ATTEMPTS = 4
_UNIQUE_KEY_ERRORS = ("UNIQUE constraint failed", "duplicate key value", "Duplicate entry", "IntegrityError")


def log_metrics_to_run(tracking_uri: str, run_id: str, metrics: Mapping[str, float], step: int) -> None:
    """Add metrics to an existing (usually finished) run without changing its status or end time."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, int(step)) for k, v in metrics.items() if v is not None]
    MlflowClient(tracking_uri=tracking_uri).log_batch(run_id, metrics=items)


def register_model_dir(tracking_uri: str, run_id: str, local_dir: str | Path, name: str,
                       tags: Mapping[str, Any] | None = None, description: str | None = None):
    """Log `local_dir` as the run's `hf_model/` artifacts and register it as a new version of model `name`
    (created when new). Returns the ModelVersion; tags the run with `longtrain.registered_model`."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    client.log_artifacts(run_id, str(local_dir), REGISTERED_MODEL_ARTIFACT)
    try:
        client.create_registered_model(name, description="Exported with `python pipeline/run.py export`; "
                                                         "loads with transformers.AutoModelForCausalLM")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + REGISTERED_MODEL_ARTIFACT
    version = client.create_model_version(name, source, run_id=run_id,
                                          tags={str(k): str(v) for k, v in (tags or {}).items()},
                                          description=description)
    client.set_tag(run_id, REGISTERED_TAG, f"{name}/{version.version}")
    return version
