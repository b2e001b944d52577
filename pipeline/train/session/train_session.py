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
spans all phases (one warmup, one cosine); later phases reuse the first phase's tokenizer. A phase may blend
sources (`data.mixture` in its overrides, a file or the list itself): its data cursor starts at 0, and what each
source supplies to the phase is decided before it trains (pipeline/train/session/mixture_run.py).

Context extension (docs/long-context.md) is a phase that raises data.seq_len and changes the RoPE settings:

    - steps: 150
    - steps: 60
      lr_warmup_steps: 10          # optional: the learning rate ramps up again inside the one schedule
      reset_optimizer: false       # optional: true starts AdamW's moments from zero (the weights carry over)
      overrides: {data.seq_len: 1024, model.rope_scaling: yarn, model.rope_factor: 4, model.rope_original_max_len: 256}

A phase that changes data.seq_len keeps the tokens per optimizer step of the phase before it: train.batch_size x
train.grad_accum are adjusted (never more tokens per micro-batch) unless the phase sets either itself; the phase
line says which.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import storage_faults as faults
from pipeline.config import Config, ConfigError
from pipeline.console import stage
from pipeline.storage import check, is_uri, join, native, storage_root
from pipeline.storage import pin as pin_storage
from pipeline.tracking.names import EXTENDED_TAG, MAX_STEPS_TAG
from pipeline.train.session.run_dir import RUN_FILE, write_run_file

# Fields that fix the model's shape or the token ids: they cannot change between phases.
FIXED_ACROSS_PHASES = ("model.tier", "model.mixer", "model.tie_embeddings", "data.vocab_size", "data.tokenizer")


_PHASE_KEYS = ("steps", "overrides", "name", "lr_warmup_steps", "reset_optimizer")


@dataclass
class Phase:
    steps: int
    overrides: dict[str, Any] = field(default_factory=dict)
    lr_warmup_steps: int = 0  # > 0: a re-warmup over this many steps at the phase start, inside the one schedule
    reset_optimizer: bool = False  # AdamW's moments start from zero at the phase start

    def to_dict(self) -> dict[str, Any]:
        """What run.json records: steps and overrides, and the optional keys only where set."""
        out = {"steps": self.steps, "overrides": self.overrides}
        if self.lr_warmup_steps:
            out["lr_warmup_steps"] = self.lr_warmup_steps
        if self.reset_optimizer:
            out["reset_optimizer"] = True
        return out


def run_params(cfg: Config, manifest: Any) -> dict[str, Any]:
    """The params an MLflow run logs beside its config, a single run's and each sweep trial's alike: the model's
    exact parameter count (computed from its tier, model/flops.py param_count) and the count one token uses
    (active_param_count: a mixture of experts runs k of its E experts; the total for a dense model), world size,
    and the dataset's tokenizer and settings hashes (`manifest`: pipeline/data/shards.py's Manifest)."""
    from model.flops import active_param_count, param_count
    from pipeline.config import model_tier
    from pipeline.tracking.names import (PARAM_MANIFEST_HASH, PARAM_MODEL_ACTIVE_PARAMS, PARAM_MODEL_PARAMS,
                                         PARAM_TOKENIZER_SHA256, PARAM_WORLD_SIZE)

    tier = model_tier(cfg)
    return {PARAM_MODEL_PARAMS: param_count(tier, manifest.vocab_size, cfg.model.tie_embeddings),
            PARAM_MODEL_ACTIVE_PARAMS: active_param_count(tier, manifest.vocab_size, cfg.model.tie_embeddings),
            PARAM_WORLD_SIZE: cfg.ray.num_workers, PARAM_TOKENIZER_SHA256: manifest.tokenizer_sha256,
            PARAM_MANIFEST_HASH: manifest.settings_hash}


def _phase_of(checkpoint: str) -> int:
    """The phase a checkpoint was written in (meta.json's counters); the checkpoint must be complete."""
    from pipeline.train.checkpoints.broken import diagnosed
    from pipeline.train.checkpoints.state import read_checkpoint_meta

    with diagnosed(checkpoint):  # broken: one line offering the previous complete checkpoint
        return int(read_checkpoint_meta(checkpoint)["counters"].get("phase", 0))


def load_phases(path: str | None, cfg: Config, preset: str | None = None, *, one_process: bool = False) -> list[Phase]:
    """Phases from a YAML file, each validated against cfg; without a file, the phases of a preset that has them
    (pipeline/config.py PRESET_PHASES, e.g. long-32k), else one phase of train.max_steps. `one_process` (train
    --no-ray): a phase that splits rows over workers is refused too (check_one_process)."""
    from pipeline.config import preset_phases

    if not path:
        items = preset_phases(preset) if preset else None
        return (parse_phases(items, cfg, f"preset {preset}", one_process=one_process) if items
                else [Phase(cfg.train.max_steps)])
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--phases {path}: no such file")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"--phases {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return parse_phases(doc, cfg, f"--phases {path}", one_process=one_process)


def parse_phases(doc: Any, cfg: Config, where: str, *, one_process: bool = False) -> list[Phase]:
    """A list of phase mappings ({steps, overrides, name, lr_warmup_steps, reset_optimizer}), each validated
    against cfg with one-line errors that name `where` and the phase."""
    from pipeline.config import unused_by_mixer, unused_by_source

    if not isinstance(doc, list) or not doc:
        raise ConfigError(f"{where}: expected a YAML list of phases like [{{steps: 100, overrides: {{...}}}}]")
    phases = []
    for i, item in enumerate(doc):
        if not isinstance(item, dict) or set(item) - set(_PHASE_KEYS) or "steps" not in item:
            raise ConfigError(f"{where}: phase {i} must be a mapping with steps (and optional overrides, name, "
                              f"lr_warmup_steps, reset_optimizer)")
        steps, overrides = item["steps"], dict(item.get("overrides") or {})
        if not isinstance(steps, int) or steps <= 0:
            raise ConfigError(f"{where}: phase {i} steps={steps!r}; it must be a positive integer")
        fixed = [k for k in overrides if k in FIXED_ACROSS_PHASES]
        if fixed:
            raise ConfigError(f"{where}: phase {i} changes {fixed}; the model and tokenizer stay the same "
                              f"across phases, set them on the command line instead")
        warmup, reset = item.get("lr_warmup_steps", 0), item.get("reset_optimizer", False)
        if not isinstance(warmup, int) or isinstance(warmup, bool) or not 0 <= warmup <= steps:
            raise ConfigError(f"{where}: phase {i} lr_warmup_steps={warmup!r}; it must be an integer from 0 to the "
                              f"phase's steps ({steps})")
        if not isinstance(reset, bool):
            raise ConfigError(f"{where}: phase {i} reset_optimizer={reset!r}; it must be true or false")
        if i == 0 and (warmup or reset):
            raise ConfigError(f"{where}: phase 0 sets {'lr_warmup_steps' if warmup else 'reset_optimizer'}, which "
                              f"applies where a phase continues another; the first phase warms up with "
                              f"train.warmup_steps")
        if one_process:  # before the worker count the degree would need, which --no-ray has no say in
            check_one_process([Phase(steps, overrides)], cfg, where, first=i)
        try:  # unknown keys and bad values fail here, before anything runs, naming the file and the phase
            phase_cfg = cfg.replace(overrides)
        except ConfigError as exc:
            raise ConfigError(f"{where}: phase {i} overrides: {exc}") from None
        unused_by_source(phase_cfg.data.source, overrides, where=f"{where}: phase {i} overrides: ")
        unused_by_mixer(phase_cfg.model.mixer, overrides, where=f"{where}: phase {i} overrides: ")
        phases.append(Phase(steps, overrides, warmup, reset))
    return phases


def check_one_process(phases: list[Phase], cfg: Config, where: str, first: int = 0) -> None:
    """train --no-ray: every phase runs in this one process, so a phase that sets train.context_parallel_degree > 1
    (or train.expert_parallel_degree > 1) is refused before the first step of the first phase (and before a new
    run's directory is made), not when it comes. `first`: the index of phases[0] in the run."""
    from pipeline.config import one_process_refusal

    for i, phase in enumerate(phases, start=first):
        for key, what in (("train.context_parallel_degree", "context"), ("train.expert_parallel_degree", "experts")):
            degree = int(phase.overrides.get(key, getattr(cfg.train, key.split(".")[1])))
            if degree > 1:
                raise ConfigError(f"{where}: phase {i} overrides: {one_process_refusal(degree, what)}")


def keep_tokens_per_step(before: Config, pcfg: Config, overrides: dict[str, Any]) -> tuple[Config, str]:
    """The phase config `pcfg` with the tokens per optimizer step of the phase `before` it kept (across a change of
    data.seq_len, or where pcfg's batch shape comes from the base config and not from the phase before), and a note
    saying so for the phase line.

    The rows per step become before's tokens per step / the new seq_len (rounded, at least 1), split into the
    largest micro-batch that divides them without holding more tokens than before's micro-batch (so a longer
    context never needs more memory per forward than the math requires) times grad_accum. A phase that sets
    train.batch_size or train.grad_accum itself is taken as it is."""
    b, p = before.train, pcfg.train
    # per data rank, whose count a change of train.context_parallel_degree on the same workers divides or multiplies
    tokens_before = (b.batch_size * b.grad_accum * before.data.seq_len * p.context_parallel_degree
                     // b.context_parallel_degree)
    if "train.batch_size" in overrides or "train.grad_accum" in overrides:
        return pcfg, (f"{p.batch_size} x {p.grad_accum} rows of {pcfg.data.seq_len:,} = "
                      f"{p.batch_size * p.grad_accum * pcfg.data.seq_len:,} tokens per step (set explicitly by the "
                      f"phase)")
    rows = max(1, round(tokens_before / pcfg.data.seq_len))
    most = max(1, tokens_before // b.grad_accum // pcfg.data.seq_len)  # rows per micro-batch, no more tokens
    batch = max(d for d in range(1, min(rows, most) + 1) if rows % d == 0)
    shape = f"{batch} x {rows // batch} rows of {pcfg.data.seq_len:,} = {rows * pcfg.data.seq_len:,} tokens per step"
    if (batch, rows // batch) == (b.batch_size, b.grad_accum):
        return pcfg.replace({"train.batch_size": batch, "train.grad_accum": b.grad_accum}), shape
    pcfg = pcfg.replace({"train.batch_size": batch, "train.grad_accum": rows // batch})
    kept = ("kept" if rows * pcfg.data.seq_len == tokens_before
            else f"{tokens_before:,} before: the nearest whole number of rows")
    return pcfg, f"{shape} ({kept}; train.batch_size x train.grad_accum adjusted from {b.batch_size} x {b.grad_accum})"


def phase_line(i: int, phase: Phase, pcfg: Config, batch_note: str) -> str:
    """`phase 1: seq_len 1,024, RoPE theta 10,000, yarn x4 from 256; 2 x 1 rows ...; re-warmup 10 steps`."""
    from pipeline.train.engine import model_rope

    rope = model_rope(pcfg, say=False)
    parts = [f"seq_len {pcfg.data.seq_len:,}", f"RoPE {rope.describe()}" if rope is not None else "no RoPE",
             batch_note]
    if phase.lr_warmup_steps:
        parts.append(f"learning rate re-warmed up over {phase.lr_warmup_steps} steps")
    if phase.reset_optimizer:
        parts.append("AdamW moments reset")
    if i > 0:
        parts.append("from the previous phase's weights")
    return f"phase {i}: " + "; ".join(parts)


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
                 audit_data: bool = False, start_step: int | None = None, extended: str = "",
                 resume_from: str | None = None, phases_done: int | None = None):
        """`start_step`: where a resumed run's first phase continues (its header shows it); `extended`: how a resume
        stretched the run's schedule (pipeline/train/session/resume.py), said in the header and as MLflow tags;
        `resume_from`: `--resume RUN --checkpoint PATH`, the checkpoint the phase in progress starts from;
        `phases_done`: a resume's count of finished phases when it differs from run.json's (a finished phase that
        grew is open again), recorded once the up-front checks pass."""
        from pipeline.tracking.tracker import pin_tracking_uri

        # Workers may run in another directory or on another node: pin paths, the storage root and the tracking
        # store (the driver's environment, $LONGTRAIN_STORAGE and MLFLOW_TRACKING_URI, goes nowhere else).
        from pipeline.data.mixture import inline_mixture

        cfg = pin_storage(inline_mixture(cfg.replace({"run.root": str(Path(cfg.run.root).resolve())})))
        self.cfg = pin_tracking_uri(cfg) if cfg.tracking.enabled else cfg
        self.run_dir, self.phases = Path(run_dir).resolve(), phases
        self.use_ray, self.audit_data = use_ray, audit_data
        self.start_step, self.extended = start_step, extended
        self.resume_from = resume_from  # `--resume RUN --checkpoint PATH`: the phase in progress starts there
        self.phases_done = phases_done

    def _record_now(self) -> dict[str, Any]:
        path = self.run_dir / RUN_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def _record(self, **changes: Any) -> dict[str, Any]:
        record = self._record_now()
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
        from pipeline.data.mixture import inline_mixture
        from pipeline.data.shards import load_manifest
        from pipeline.data.stages import prepared
        from pipeline.tracking.tracker import (check_artifact_location, check_tracking_uri, open_tracker,
                                               resolve_tracking_uri)
        from pipeline.train.engine import PhaseSchedule
        from pipeline.train.session.mixture_run import record_data

        cfg, total = self.cfg, sum(p.steps for p in self.phases)
        # Everything that can refuse the command is checked before run.json or the MLflow run is touched: a refused
        # command (a resume's included) leaves the run's record and its MLflow run as they were.
        if is_uri(storage_root(cfg)):  # the bucket: endpoint, existence, credentials, before anything else
            check(storage_root(cfg), what="run.storage", write=True)
        if cfg.tracking.enabled:
            check_tracking_uri(resolve_tracking_uri(cfg))  # fail fast, before any data or worker work
            check_artifact_location(cfg)
        if cfg.tracking.register_model:  # and not after hours of training
            from pipeline.train.handoff.hf_export import check_exportable, require_tokenizers

            check_exportable({"config": cfg.to_dict()}, "tracking.register_model: this run")
            require_tokenizers()
        before_run = self._record_now() or None  # a resumed run's record as it was
        reopened = {} if self.phases_done is None else {"phases_done": self.phases_done}
        if self.resume_from:  # `--checkpoint`: the phase that checkpoint belongs to is the one to continue
            previous = (before_run or {}).get("phases_done", 0) if self.phases_done is None else self.phases_done
            reopened = {"phases_done": min(previous, _phase_of(self.resume_from))}
        record = self._record(config=cfg.flat(), phases=[p.to_dict() for p in self.phases], status="running",
                              audit_data=self.audit_data, no_ray=not self.use_ray, **reopened)
        # From here on every storage call of this process rides out an outage, a stall or a 5xx answer for
        # run.storage_retry_s (the checks above answered at once, with one line).
        faults.set_retry_window(cfg.run.storage_retry_s)
        try:
            sized = self._size(cfg, record)  # before the MLflow run opens: its params are the sized config
        except BaseException:
            if before_run is not None:  # a resumed run: its data refused, the run itself is as it was
                write_run_file(self.run_dir, before_run)
            else:
                self._record(status="failed")
            raise
        if sized is not None:
            cfg, total = sized.cfg, sized.cfg.train.max_steps
            record = self._record(config=cfg.flat(), phases=[p.to_dict() for p in self.phases])
        tracker = open_tracker(cfg, run_id=record.get("mlflow_run_id"), run_name=self.run_dir.name)
        self._record(mlflow_run_id=tracker.run_id)
        if self.extended:
            tracker.set_tags({EXTENDED_TAG: self.extended, MAX_STEPS_TAG: total})
        if cfg.tracking.system_metrics:
            tracker.start_system_metrics(cfg.tracking.system_metrics_interval_s)
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
                before = pcfg
                pcfg = inline_mixture(cfg.replace({**phase.overrides, "train.max_steps": total,
                                                   **({"data.tokenizer": tokenizer} if tokenizer and i > 0 else {})}))
                pcfg, batch_note = keep_tokens_per_step(pcfg if i == 0 else before, pcfg, phase.overrides)
                if i < record.get("phases_done", 0):
                    continue
                # the dataset's manifest read once for the phase, and handed on to the record, MLflow and training
                if sized is not None and i == 0:
                    dataset, manifest = sized.dataset, load_manifest(sized.dataset)
                else:
                    dataset, manifest = prepared(pcfg)
                tokenizer = tokenizer or join(str(dataset), manifest.tokenizer_file)
                datasets = (datasets + [str(dataset)])[: i + 1]
                record = self._record(datasets=datasets, tokenizer=tokenizer, phase=i)
                # a mixture: each source's rows and passes for this phase (refused when one would run out), logged
                # (and a phase shorter than one block trains with blocks of its own length: pcfg carries it)
                pcfg = record_data(pcfg, dataset, manifest, tracker, steps=phase.steps, phase=i, run_dir=self.run_dir)
                if i == 0:  # a resume that extended the run says its new train.max_steps in MAX_STEPS_TAG
                    tracker.log_config(run_params(pcfg, manifest), keep_logged=("train.max_steps",))
                    tracker.log_dict(manifest.to_dict(), "manifest.json")
                    tracker.log_dict(pcfg.to_dict(), "config.json")
                init_from = checkpoint if i > 0 else None
                resume_from, self.resume_from = self.resume_from, None  # the phase in progress only
                count = (f"{pcfg.ray.min_workers}-{pcfg.ray.num_workers} (elastic)" if pcfg.ray.min_workers
                         else pcfg.ray.num_workers)
                where = f"{count} Ray Train worker(s)" if self.use_ray else "one process, no Ray"
                start, resumed = end_step - phase.steps, ""
                if self.start_step is not None and start < self.start_step < end_step:  # the real start, not 0
                    start, resumed = self.start_step, f"resumed at step {self.start_step}"
                said = "; ".join(x for x in (resumed, self.extended) if x)
                self.extended = ""  # said once, for the first phase that trains
                stage("train", f"tier {pcfg.model.tier}, steps {start}..{end_step}"
                               f"{f' (phase {i})' if len(self.phases) > 1 else ''}{f' ({said})' if said else ''}, "
                               f"{where}; run {self.run_dir}")
                self.start_step = None
                if len(self.phases) > 1:
                    print(phase_line(i, phase, pcfg, batch_note), flush=True)
                schedule = PhaseSchedule(end_step - phase.steps, phase.lr_warmup_steps, phase.reset_optimizer)
                if self.use_ray:
                    from pipeline.train.ray_train import run_training

                    out = run_training(pcfg, dataset, self.run_dir, mlflow_run_id=tracker.run_id, init_from=init_from,
                                       max_steps=end_step, phase=i, audit_data=self.audit_data, schedule=schedule,
                                       resume_from=resume_from, manifest=manifest)
                    checkpoint, stopped = out.checkpoint, out.stopped
                else:
                    from pipeline.train.local import train_local

                    checkpoint, stopped = train_local(pcfg, dataset, self.run_dir, tracker, init_from=init_from,
                                                      max_steps=end_step, phase=i, audit_data=self.audit_data,
                                                      schedule=schedule, resume_from=resume_from,
                                                      manifest=manifest)
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
        (pipeline/train/session/sizing.py); None for other runs."""
        from pipeline.data.stages import prepare_main
        from pipeline.train.session.sizing import size_to_data, sizes

        if len(self.phases) != 1 or self.phases[0].overrides or record.get("phases_done", 0) or not sizes(cfg):
            return None
        if cfg.data.mixture:  # each source's max_repetitions bounds its passes instead (pipeline/data/mixture.py)
            print("size: data.min_rows and train.max_epochs do not size a mixture; each source's max_repetitions "
                  "bounds the passes over it", flush=True)
            return None
        sized = size_to_data(cfg, prepare_main)
        self.cfg, self.phases = sized.cfg, [Phase(sized.cfg.train.max_steps)]
        return sized

    def _spike_events(self) -> list[dict[str, Any]]:
        """The run's loss-spike events (pipeline/train/spike_record.py: in the run's storage, or its directory for a
        --no-ray run); [] when there are none or they cannot be read now (the run's outcome stands without them)."""
        from pipeline.storage import StorageError, run_storage
        from pipeline.train.spike_record import read_events

        try:
            with faults.retry_window_of(0):
                return read_events(run_storage(self.cfg, self.run_dir) if self.use_ray else str(self.run_dir))
        except (StorageError, OSError, ValueError):
            return []

    @staticmethod
    def _spike_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
        """run.json's `spikes` (counts and every skipped range of rows), when the run had any."""
        from pipeline.train.spike_record import summary

        return {"spikes": summary(events)} if events else {}

    def _register(self, tracker, checkpoint: Path | str, name: str) -> None:
        """Export the final checkpoint to <run_dir>/hf_model and register it as a version of `name`."""
        from pipeline.train.handoff.hf_export import export_checkpoint, register_export

        result = export_checkpoint(checkpoint, self.run_dir / "hf_model", overwrite=True)
        version = register_export(result, tracker.tracking_uri, tracker.run_id, name)
        print(f"registered {name} version {version.version}: {result.out_dir}")

    def _finish(self, tracker, status: str) -> None:
        """Curves from the MLflow history, the run record, and the run's final status. The curves and run.json are
        logged from the tracker's background thread (they can wait for storage, up to run.storage_retry_s; one that
        is not logged is a warning: the run's outcome stands). When the run failed, nothing here may take the place
        of the error that ended it: what fails here is dropped, and nothing waits for storage."""
        from pipeline.tracking.curves import plot_training_curves
        from pipeline.tracking.names import METRICS
        from pipeline.train.spike_record import curve_markers

        events = self._spike_events()
        try:
            self._record(status={"FINISHED": "finished", "KILLED": "stopped", "FAILED": "failed"}[status],
                         **self._spike_summary(events))
        except Exception:  # noqa: BLE001 -- a run that failed (a full disk, say) keeps its own error, not this one
            if status != "FAILED":
                raise
        if tracker.run_id is None:
            return
        try:
            by_step: dict[int, dict[str, float]] = {}
            for name in METRICS:
                for m in tracker.client.get_metric_history(tracker.run_id, name):
                    by_step.setdefault(m.step, {"step": m.step})[name] = m.value
            history = [by_step[s] for s in sorted(by_step)]
            png = plot_training_curves(history, self.run_dir / "training_curves.png", title=self.run_dir.name,
                                       spikes=curve_markers(events))
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
