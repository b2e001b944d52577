"""One training run from the driver's side: phases, datasets, the MLflow run, Ray or local training,
and the artifacts at the end. `python pipeline/run.py train` builds one of these.

A run directory holds run.json (config, phases, MLflow run id, datasets, latest checkpoint, phases
done), the Ray Train storage (ray/) or local checkpoints (checkpoints/), training_curves.png and the
data audit when asked for. With run.storage a bucket (s3://...), Ray Train's storage and the data audit are
under <run.storage>/<run name>/ instead, the datasets under <run.storage>/datasets/, and run.json records
their URIs. Rerunning with --resume continues from what run.json and the checkpoints say.

Phases (a curriculum such as TinyStories then FineWeb-Edu) come from a YAML list:

    - steps: 200
      overrides: {data.source: hf, data.hf_name: roneneldan/TinyStories}
    - steps: 800
      overrides: {data.source: hf, data.hf_name: HuggingFaceFW/fineweb-edu, data.hf_config: sample-10BT}

Model, optimizer and scheduler state carry from one phase to the next; the learning-rate schedule
spans all phases (one warmup, one cosine); later phases reuse the first phase's tokenizer.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline import storage_faults as faults
from pipeline.config import Config, ConfigError
from pipeline.console import stage
from pipeline.storage import check, is_uri, join, native, storage_root
from pipeline.storage import pin as pin_storage
from pipeline.train.run_dir import RUN_FILE, write_run_file

# Fields that fix the model's shape or the token ids: they cannot change between phases.
_FIXED_ACROSS_PHASES = ("model.tier", "model.mixer", "model.tie_embeddings", "data.vocab_size", "data.tokenizer")


@dataclass
class Phase:
    steps: int
    overrides: dict[str, Any] = field(default_factory=dict)


def run_params(cfg: Config, manifest: Any) -> dict[str, Any]:
    """The params an MLflow run logs beside its config, a single run's and each sweep trial's alike: the model's
    exact parameter count (computed from its tier, model/flops.py param_count), world size, and the dataset's
    tokenizer and settings hashes (`manifest`: pipeline/data/shards.py's Manifest)."""
    from model.flops import param_count
    from model.tiers import get_mixer_tier
    from pipeline.tracking.tracker import (PARAM_MANIFEST_HASH, PARAM_MODEL_PARAMS, PARAM_TOKENIZER_SHA256,
                                           PARAM_WORLD_SIZE)

    tier = get_mixer_tier(cfg.model.tier, cfg.model.mixer)
    return {PARAM_MODEL_PARAMS: param_count(tier, manifest.vocab_size, cfg.model.tie_embeddings),
            PARAM_WORLD_SIZE: cfg.ray.num_workers, PARAM_TOKENIZER_SHA256: manifest.tokenizer_sha256,
            PARAM_MANIFEST_HASH: manifest.settings_hash}


def _phase_of(checkpoint: str) -> int:
    """The phase a checkpoint was written in (meta.json's counters); the checkpoint must be complete."""
    from pipeline.train.checkpoint import read_checkpoint_meta

    return int(read_checkpoint_meta(checkpoint)["counters"].get("phase", 0))


def load_phases(path: str | None, cfg: Config) -> list[Phase]:
    """Phases from a YAML file, each validated against cfg; no file means one phase of train.max_steps."""
    if not path:
        return [Phase(cfg.train.max_steps)]
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--phases {path}: no such file")
    doc = yaml.safe_load(p.read_text())
    if not isinstance(doc, list) or not doc:
        raise ConfigError(f"--phases {path}: expected a YAML list of phases like [{{steps: 100, overrides: {{...}}}}]")
    phases = []
    for i, item in enumerate(doc):
        if not isinstance(item, dict) or set(item) - {"steps", "overrides", "name"} or "steps" not in item:
            raise ConfigError(f"--phases {path}: phase {i} must be a mapping with steps (and optional overrides)")
        steps, overrides = item["steps"], dict(item.get("overrides") or {})
        if not isinstance(steps, int) or steps <= 0:
            raise ConfigError(f"--phases {path}: phase {i} steps={steps!r}; it must be a positive integer")
        fixed = [k for k in overrides if k in _FIXED_ACROSS_PHASES]
        if fixed:
            raise ConfigError(f"--phases {path}: phase {i} changes {fixed}; the model and tokenizer stay the same "
                              f"across phases, set them on the command line instead")
        cfg.replace(overrides)  # unknown keys and bad values fail here, before anything runs
        phases.append(Phase(steps, overrides))
    return phases


@dataclass
class SessionResult:
    checkpoint: Path | str | None  # a local directory, or a URI on object storage
    cfg: Config
    ui_command: str
    dataset_dirs: list[str]
    stopped: bool = False  # Ctrl+C: checkpointed before the end; continue with --resume
    epochs: float | None = None  # passes over the training split, when train.max_epochs capped the run's steps


class TrainSession:
    def __init__(self, cfg: Config, run_dir: Path, phases: list[Phase], *, use_ray: bool = True,
                 audit_data: bool = False, resume_from: str | None = None):
        from pipeline.tracking.tracker import pin_tracking_uri

        # Workers may run in another directory or on another node: pin paths, the storage root and the tracking
        # store (the driver's environment, $LONGTRAIN_STORAGE and MLFLOW_TRACKING_URI, goes nowhere else).
        cfg = pin_storage(cfg.replace({"run.root": str(Path(cfg.run.root).resolve())}))
        self.cfg = pin_tracking_uri(cfg) if cfg.tracking.enabled else cfg
        self.run_dir, self.phases = Path(run_dir).resolve(), phases
        self.use_ray, self.audit_data = use_ray, audit_data
        self.resume_from = resume_from  # `--resume RUN --checkpoint PATH`: the phase in progress starts there

    def _record(self, **changes: Any) -> dict[str, Any]:
        path = self.run_dir / RUN_FILE
        record = json.loads(path.read_text()) if path.exists() else {}
        record.update(changes)
        write_run_file(self.run_dir, record)
        return record

    def run(self, resume: bool = False) -> SessionResult:
        before = faults.set_retry_window(0)  # set after the up-front checks; put back as it was afterwards
        try:
            return self._run()
        finally:
            faults.set_retry_window(before)

    def _run(self) -> SessionResult:
        from pipeline.data.stages import prepare_main
        from pipeline.data.shards import load_manifest
        from pipeline.tracking.tracker import (check_artifact_location, check_tracking_uri, open_tracker,
                                               resolve_tracking_uri)

        cfg, total = self.cfg, sum(p.steps for p in self.phases)
        record = self._record(config=cfg.flat(), phases=[asdict(p) for p in self.phases], status="running",
                              audit_data=self.audit_data)
        if is_uri(storage_root(cfg)):  # the bucket: endpoint, existence, credentials, before anything else
            check(storage_root(cfg), what="run.storage", write=True)
        if cfg.tracking.enabled:
            check_tracking_uri(resolve_tracking_uri(cfg))  # fail fast, before any data or worker work
            check_artifact_location(cfg)
        if cfg.tracking.register_model:  # and not after hours of training
            from pipeline.train.export import check_exportable, require_tokenizers

            check_exportable({"config": cfg.to_dict()}, "tracking.register_model: this run")
            require_tokenizers()
        # From here on every storage call of this process rides out an outage, a stall or a 5xx answer for
        # run.storage_retry_s (the checks above answered at once, with one line).
        faults.set_retry_window(cfg.run.storage_retry_s)
        try:
            sized = self._size(cfg, record)  # before the MLflow run opens: its params are the sized config
        except BaseException:
            self._record(status="failed")
            raise
        if sized is not None:
            cfg, total = sized.cfg, sized.cfg.train.max_steps
            record = self._record(config=cfg.flat(), phases=[asdict(p) for p in self.phases])
        tracker = open_tracker(cfg, run_id=record.get("mlflow_run_id"), run_name=self.run_dir.name)
        self._record(mlflow_run_id=tracker.run_id)
        if cfg.tracking.system_metrics:
            tracker.start_system_metrics(cfg.tracking.system_metrics_interval_s)
        if self.resume_from:  # `--checkpoint`: the phase that checkpoint belongs to is the one to continue
            record = self._record(phases_done=min(record.get("phases_done", 0), _phase_of(self.resume_from)))
        datasets: list[str] = list(record.get("datasets", []))
        checkpoint = native(record["checkpoint"]) if record.get("checkpoint") else None
        tokenizer = record.get("tokenizer") or cfg.data.tokenizer
        end_step, pcfg = 0, cfg
        status = "FAILED"
        try:
            for i, phase in enumerate(self.phases):
                end_step += phase.steps
                # Phases after the first reuse its tokenizer. The first phase keeps its own data.tokenizer, also on
                # --resume: the recorded tokenizer file would change its dataset's cache key and rebuild the dataset.
                pcfg = cfg.replace({**phase.overrides, "train.max_steps": total,
                                    **({"data.tokenizer": tokenizer} if tokenizer and i > 0 else {})})
                if i < record.get("phases_done", 0):
                    continue
                dataset = sized.dataset if sized is not None and i == 0 else prepare_main(pcfg)
                manifest = load_manifest(dataset)
                tokenizer = tokenizer or join(str(dataset), manifest.tokenizer_file)
                datasets = (datasets + [str(dataset)])[: i + 1]
                record = self._record(datasets=datasets, tokenizer=tokenizer, phase=i)
                tracker.log_dataset_input(manifest, dataset)
                if i == 0:
                    tracker.log_config(run_params(pcfg, manifest))
                    tracker.log_dict(manifest.to_dict(), "manifest.json")
                    tracker.log_dict(pcfg.to_dict(), "config.json")
                init_from = checkpoint if i > 0 else None
                resume_from, self.resume_from = self.resume_from, None  # the phase in progress only
                where = (f"{pcfg.ray.num_workers} Ray Train worker(s)" if self.use_ray else "one process, no Ray")
                stage("train", f"tier {pcfg.model.tier}, steps {end_step - phase.steps}..{end_step}"
                               f"{f' (phase {i})' if len(self.phases) > 1 else ''}, {where}; run {self.run_dir}")
                if self.use_ray:
                    from pipeline.train.ray_train import run_training

                    out = run_training(pcfg, dataset, self.run_dir, mlflow_run_id=tracker.run_id, init_from=init_from,
                                       max_steps=end_step, phase=i, audit_data=self.audit_data, resume_from=resume_from)
                    checkpoint, stopped = out.checkpoint, out.stopped
                else:
                    from pipeline.train.local import train_local

                    checkpoint, stopped = train_local(pcfg, dataset, self.run_dir, tracker, init_from=init_from,
                                                      max_steps=end_step, phase=i, audit_data=self.audit_data,
                                                      resume_from=resume_from)
                if stopped:  # Ctrl+C: a checkpoint was written; `--resume` continues this phase
                    record = self._record(checkpoint=str(checkpoint) if checkpoint else None)
                    status = "KILLED"
                    break
                record = self._record(checkpoint=str(checkpoint) if checkpoint else None, phases_done=i + 1)
            else:
                status = "FINISHED"
                if cfg.tracking.register_model and checkpoint is not None:
                    self._register(tracker, checkpoint, cfg.tracking.register_model)
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            self._finish(tracker, status)
        return SessionResult(checkpoint, pcfg, tracker.ui_command(), datasets, stopped=status == "KILLED",
                             epochs=sized.epochs if sized is not None else None)

    def _size(self, cfg: Config, record: dict[str, Any]):
        """A run of one phase with data.min_rows or train.max_epochs set: prepare its data and size the run to it
        (pipeline/train/sizing.py); None for other runs."""
        from pipeline.data.stages import prepare_main
        from pipeline.train.sizing import size_to_data, sizes

        if len(self.phases) != 1 or self.phases[0].overrides or record.get("phases_done", 0) or not sizes(cfg):
            return None
        sized = size_to_data(cfg, prepare_main)
        self.cfg, self.phases = sized.cfg, [Phase(sized.cfg.train.max_steps)]
        return sized

    def _register(self, tracker, checkpoint: Path | str, name: str) -> None:
        """Export the final checkpoint to <run_dir>/hf_model and register it as a version of `name`."""
        from pipeline.train.export import export_checkpoint, register_export

        result = export_checkpoint(checkpoint, self.run_dir / "hf_model", overwrite=True)
        version = register_export(result, tracker.tracking_uri, tracker.run_id, name)
        print(f"registered {name} version {version.version}: {result.out_dir}")

    def _finish(self, tracker, status: str) -> None:
        """Curves from the MLflow history, the run record, and the run's final status. The curves and run.json are
        logged from the tracker's background thread (they can wait for storage, up to run.storage_retry_s; one that
        is not logged is a warning: the run's outcome stands). When the run failed, nothing here may take the place
        of the error that ended it: what fails here is dropped, and nothing waits for storage."""
        from pipeline.tracking.curves import plot_training_curves
        from pipeline.tracking.tracker import METRICS

        self._record(status={"FINISHED": "finished", "KILLED": "stopped", "FAILED": "failed"}[status])
        if tracker.run_id is None:
            return
        try:
            by_step: dict[int, dict[str, float]] = {}
            for name in METRICS:
                for m in tracker.client.get_metric_history(tracker.run_id, name):
                    by_step.setdefault(m.step, {"step": m.step})[name] = m.value
            history = [by_step[s] for s in sorted(by_step)]
            png = plot_training_curves(history, self.run_dir / "training_curves.png", title=self.run_dir.name)
            if status != "FAILED":
                tracker.log_later(png.name, path=png)
                tracker.log_later(RUN_FILE, path=self.run_dir / RUN_FILE)
        except Exception:  # noqa: BLE001 -- the curves never replace the run's own error
            if status != "FAILED":
                raise
        finally:
            try:
                tracker.finish(status)  # waits for the queued artifacts (a finished or stopped run)
            except Exception:  # noqa: BLE001
                if status != "FAILED":
                    raise
