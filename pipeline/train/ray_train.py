"""Ray Train over the shards: a TorchTrainer whose workers run pipeline/train/loop.py's `fit` around the one
Engine, with exact resume, fault tolerance and MLflow tracking from rank 0.

    python pipeline/run.py train --ray.num_workers=2            # through the CLI
    ray job submit --working-dir . -- python pipeline/run.py    # on a running cluster

Exact resume. Ray Data's streaming_split is not resumable (after a restart a worker's iterator starts
over, so data is silently repeated or skipped). Instead every worker builds its own Ray Dataset for
its rank from the (epoch, cursor) stored in the checkpoint (pipeline/data/shards.py `ray_batches`): the
global order is a seeded permutation of the split, so after any restart each worker continues at the
exact next sequence. The checkpoint is the engine's full state (weights, optimizer, scheduler, RNG,
counters) reported through `ray.train.report`; Ray keeps the newest K by validation loss plus the
latest, and FailureConfig restarts the worker group from the latest after a worker dies.

Parallelism (train.parallel; pipeline/train/distributed/parallel.py): the engine shares the model across the workers by DDP or
FSDP2 and rank 0 prints which and why. With train.context_parallel_degree = d the workers form a (data x context)
mesh (pipeline/train/distributed/context_parallel.py): the d workers of a context group read the same rows (their data
rank's) and split each row, and rank 0 prints a `context:` line saying how. Under FSDP every worker writes its own shards of the checkpoint into its
own directory and reports it; Ray Train merges the reported directories into one checkpoint directory in storage
and registers it only once every worker has reported (pipeline/train/checkpoints/state.py, sharded layout). A run resumed
with another ray.num_workers reads that checkpoint resharded.

Where things are. A worker is handed locations, never a path that exists only on the driver's machine when
the workers may run elsewhere: the dataset (a URI in the dataset store), Ray Train's storage (checkpoints;
`ray.storage_path`, by default <run.storage>/<run>/ray) and the run's storage (<run.storage>/<run>: the stop
request, the data audit). With run.storage a bucket, a cluster needs no shared filesystem; with bare local
paths on a cluster whose workers run on other nodes, the run is refused before any worker starts
(pipeline/ray_runtime.py require_shared). Storage problems (endpoint, bucket, credentials) are one line,
also before any worker starts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import Config, from_flat, worker_group
from pipeline.console import INTERACTIVE_ENV, interactive, quiet_ray_data, quiet_ray_train_worker, worker_print
from pipeline.ray_runtime import ensure_ray, require_shared, use_gpu, worker_cpus, workers_may_be_elsewhere
from pipeline import storage_faults as faults
from pipeline.storage import (StorageError, absolute, check, delete, exists, explain, join, local_copy, location_of,
                              native, ray_storage, ray_storage_args, run_storage, storage_error_in, write_bytes)

# Light on purpose: Ray Train's controller and Tune's trial processes import this module (to unpickle
# train_loop_per_worker). The engine, the model and numba load only in the training workers, inside
# train_loop_per_worker (torch itself still loads there: Ray's TorchTrainer imports it).
from pipeline.tracking.names import VAL_LOSS
from pipeline.train.session.run_dir import AUDIT_DIR

STOP_FILE = "STOP"  # <run storage>/STOP: the driver's Ctrl+C, seen by every worker
# Every report carries the worker group's placement group, so whoever ends the run early (a sweep's scheduler
# stopping a trial) can give its resources back: pipeline/sweep/placement_groups.py's ReleaseTrialResources.
PLACEMENT_GROUP_KEY = "ray/placement_group"
# Ray Train's own setting: seconds one attempt waits for its workers' resources (Ray's default: 60).
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
DEFAULT_START_TIMEOUT_S = 60.0


class MissingMetricError(RuntimeError):
    """A sweep trial's report lacks the sweep's metric: raised in the workers, so the trial fails alone."""


class TrainStartError(RuntimeError):
    """Ray Train could not place its workers: the message names what was asked, what the cluster has and the fix."""


@dataclass
class TrainOutcome:
    run_dir: Path
    checkpoint: Path | str | None  # the latest checkpoint: a local directory, a URI on object storage, or None
    metrics: dict[str, Any]
    mlflow_run_id: str | None
    stopped: bool = False  # a Ctrl+C stopped it (after a checkpoint) before max_steps


@functools.cache  # one class per base, as trainer_class
def _without_dataset_manager(base: type) -> type:
    """`base` (a TorchTrainer class) that starts no DatasetManager actor when it is given no datasets.

    Ray Train starts that actor for every run (its DatasetsCallback), to split the trainer's `datasets` among the
    workers. These workers read their own rows (`ray_batches`, for exact resume) and the trainer gets no datasets,
    so the actor only cost a process: a 4-step run went from 9 processes and 30.5-30.8 CPU-s to 8 and 29.2-30.1 on
    2 cores, its wall time within run-to-run noise (bench/command_cpu.py, side by side). The callback's other work,
    handing the driver's Ray Data settings (DataContext) to the workers, is done by the workers themselves
    (quiet_ray_data)."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    def _create_default_callbacks(self):
        callbacks = base._create_default_callbacks(self)
        return callbacks if self.datasets else [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    return type(base.__name__, (base,), {"_create_default_callbacks": _create_default_callbacks,
                                         "__module__": __name__})


# ------------------------------------------------------------------------------------------ worker
def train_loop_per_worker(lc: dict[str, Any]) -> None:
    """Runs in every Ray Train worker. `lc` is built by `run_training`; see its keys there."""
    import ray.data
    import ray.train
    import ray.train.torch

    from pipeline.train.distributed import elastic
    from pipeline.train.engine import Engine, PhaseSchedule, announce_kernels
    from pipeline.train.distributed.failure_policy import quiet_repeating_tracebacks
    from pipeline.train.handoff.text_generation import eval_samples_hook
    from pipeline.train.audit_log import AuditLog
    from pipeline.train.loop import evaluate_timed, fit, standard_hooks
    from pipeline.train.task_scoring import ScoringSchedule
    from pipeline.train.stop_request import StopRequest
    from pipeline.data.mixture import mixture_of
    from pipeline.data.mixture import train_batches as mixed_train_batches
    from pipeline.data.shards import EvalSplit, Manifest, ray_batches
    from pipeline.eval.sources import SourceValidation
    from pipeline.tracking.tracker import open_tracker
    from pipeline.train.spike_record import RECORD_FILE, SpikeRecord, read_events, rewinds_of
    from pipeline.train.spike_rewind import Rewinder, reconcile
    from pipeline.train.checkpoints.ray_upload import (CheckpointUploads, load_chosen, load_restored, wait_for_storage,
                                                written_by)

    cfg: Config = from_flat(lc["config"])
    os.environ[INTERACTIVE_ENV] = "1" if lc.get("interactive") else "0"  # the driver's console, not this pipe
    faults.set_retry_window(cfg.run.storage_retry_s)  # every storage call here rides out an outage that long
    quiet_ray_data(progress=False)  # the rank-0 progress line is the one to watch
    quiet_ray_train_worker()  # "Reporting training result N: ..." per checkpoint
    quiet_repeating_tracebacks()  # an error that ends the run without a retry: the driver prints its one line
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = elastic.at_world_size(cfg, world)  # an elastic attempt's worker count: the same global batch
    device = ray.train.torch.get_device()
    if device.type == "cuda":  # Ray Train's TorchConfig sets it too: FSDP's device mesh and NCCL need it per worker
        import torch

        torch.cuda.set_device(device)
    engine = Engine(cfg, lc["vocab_size"], device, rank=rank, world_size=world)
    # The rows this worker reads: its data rank's, shared with the rest of its context group (context parallelism)
    data_rank, data_world = engine.mesh.data_rank, engine.data_world_size
    # A restart after a storage failure waits here for the store to answer (up to run.storage_retry_s) instead of
    # failing at its first read and spending another attempt (Ray Train restarts at once, without backoff).
    try:
        wait_for_storage(lc["run_storage"], cfg.run.storage_retry_s, rank)
    except StorageError as exc:  # one line, without the frames of the wait
        raise StorageError(str(exc)) from None
    restored = ray.train.get_checkpoint()
    meta, resumed = None, True  # resumed: inside the phase (its optimizer state is the checkpoint's)
    chosen = lc.get("resume_from")  # `train --resume RUN --checkpoint PATH`: until this fit reports its own
    from_chosen = bool(chosen) and (restored is None or not written_by(restored, lc))
    if from_chosen:
        meta = load_chosen(engine, chosen)
    elif restored is not None:
        meta = load_restored(engine, restored, lc["ray_storage"])
    else:
        resumed = False
    if not resumed and lc.get("init_from"):  # the first attempt of a new phase: previous phase's state, new data
        meta = engine.load(lc["init_from"])  # on object storage: sharded read in place, full copied first
        engine.epoch, engine.cursor, engine.phase = 0, 0, lc.get("phase", 0)
    run_storage = lc["run_storage"]
    # Loss spikes: a rewind goes back to this phase's checkpoints in Ray's storage; the run's record (spikes.json in
    # its storage) holds the rewinds a checkpoint written before them does not know of (a restart after a rewind)
    mixed = (lc["manifest"].get("source") or {}).get("kind") == "mixture"
    rewinder = Rewinder(join(lc["ray_storage"], f"phase{lc.get('phase', 0)}"),
                        epoch_rows=None if mixed else Manifest.from_dict(lc["manifest"]).rows("train"))
    reconcile(engine, rewinds_of(read_events(run_storage)), rewinder, worker_print, chosen=from_chosen)
    engine.start_phase(PhaseSchedule(**lc.get("schedule", {})), fresh=not resumed)
    tracker = open_tracker(cfg, rank=rank, run_id=lc.get("mlflow_run_id")) if lc.get("mlflow_run_id") else None
    resumes = elastic.ResumeReport(run_storage, lc.get("phase", 0)) if rank == 0 else None
    if resumes is not None:
        _announce_parallel(engine, meta, tracker)
        announce_kernels(engine, tracker, say=worker_print)
        if engine.mesh.degree > 1:
            from pipeline.train.distributed.context_parallel import describe_context

            worker_print(f"context: {describe_context(engine)}")
        if engine.experts is not None:  # how the experts are split (pipeline/train/distributed/expert_parallel.py)
            worker_print(f"experts: {engine.experts.describe()}")
        elastic.announce(resumes.start(engine, meta), tracker)
    t = cfg.train
    dataset_dir = lc["dataset_dir"]
    # the driver's read of the dataset's manifest, handed on to every reader here: none reads manifest.json again
    manifest = Manifest.from_dict(lc["manifest"])

    def train_batches(epoch: int, start: int):
        ds = ray_batches(dataset_dir, "train", t.batch_size, t.seed, epoch, start, data_rank, data_world,
                         retry_s=cfg.run.storage_retry_s, manifest=manifest)
        return ds.iter_torch_batches(batch_size=t.batch_size, prefetch_batches=2, drop_last=True)

    # Read in this process: an eval takes train.eval_batches batches of the small val split, and a Ray Data pipeline
    # per eval (a streaming executor, read tasks on other workers) cost more than the reads. Every row counts, a
    # short last batch included (padded to the batch's shape on every rank). One reader for the whole run: its
    # manifest, open files and row groups are reused by every evaluation (pipeline/data/shards.py EvalSplit).
    val_batches = EvalSplit(dataset_dir, t.batch_size, data_rank, data_world, manifest=manifest)

    evaluate = None
    if (mix := mixture_of(dataset_dir, cfg, manifest)) is not None:  # several sources: one mixed stream, a loss each
        train_batches = mixed_train_batches(dataset_dir, cfg, data_rank, data_world, use_ray=True, manifest=manifest)
        evaluate = SourceValidation(mix, t.batch_size, data_rank, data_world)

    audit = None
    if lc.get("audit_data") and engine.mesh.context_rank == 0:  # a context group's rows, recorded once
        import torch

        node = ray.get_runtime_context().get_node_id()  # threads: Ray's OMP_NUM_THREADS = the worker's CPUs
        audit = AuditLog(join(run_storage, AUDIT_DIR, f"rank_{rank}.jsonl"),
                         extra={"node": node, "threads": torch.get_num_threads(), "world_size": world})
    extra = {"dataset_dir": dataset_dir, "phase": lc.get("phase", 0)}
    required = lc.get("required_metric")
    # ray.checkpoint_upload: sync (the default) waits for each upload; async uploads in Ray Train's background thread
    uploads = CheckpointUploads(lc["ray_storage"], cfg.ray.checkpoint_upload, rank)
    rewinder.settle = uploads.settle  # a rewind looks for its checkpoint once this worker's upload in flight is done
    scoring = ScoringSchedule(cfg) if lc.get("score_tasks") else None  # eval.tasks: pipeline/train/task_scoring.py

    def on_checkpoint(e, metrics) -> None:
        # Every worker reports (Ray Train synchronises on it). Rank 0 attaches the one copy of a full checkpoint;
        # under FSDP every worker attaches its own shards, which Ray merges into one directory.
        if VAL_LOSS not in metrics:  # Ray ranks checkpoints by val/loss: every one needs it
            metrics = {**metrics, **(evaluate(e, t.eval_batches) if evaluate is not None
                                     else evaluate_timed(e, val_batches(), t.eval_batches))}
        if required and required not in metrics:  # a sweep's trial: Tune cannot rank a report without it
            raise MissingMetricError(f"the report at step {e.step} has no {required} (it has: "
                                     f"{', '.join(sorted(metrics))}); a sweep's metric must be in every checkpoint's "
                                     f"report: pick one of those, or log at every checkpoint (train.log_every)")
        if audit is not None:  # the steps up to this checkpoint are recorded wherever the log lives
            audit.flush()
        report = {"step": e.step, "epoch": e.epoch, "cursor": e.cursor, "phase": e.phase, **metrics,
                  PLACEMENT_GROUP_KEY: ray.get_runtime_context().get_placement_group_id() or ""}

        def save(directory):
            return e.save(directory, extra={**extra, "metrics": metrics, "fit_id": lc.get("fit_id")})

        # Uploaded and verified by the project's storage layer before Ray registers it (publish_for_ray); in the
        # background unless ray.checkpoint_upload=sync (pipeline/train/checkpoints/ray_upload.py CheckpointUploads)
        attach = rank == 0 or e.sharded
        scored = scoring is not None and scoring.next(e.step >= (lc.get("max_steps") or t.max_steps))
        uploads.report(report, save if attach else None, validation=scored and attach)

    samples = (eval_samples_hook(dataset_dir, tracker, t.sample_tokens, defer=True, manifest=manifest)
               if rank == 0 else None)
    if engine.sharded and lc.get("mlflow_run_id") and t.sample_tokens > 0:
        samples = _gathered(samples)  # every worker gathers the weights; rank 0 generates

    hooks = standard_hooks(tracker, audit, on_checkpoint, on_eval_extra=samples,
                           spikes=SpikeRecord(join(run_storage, RECORD_FILE)) if rank == 0 else None, say=worker_print)
    if resumes is not None:  # train/world_size, and after a resume the work it cost
        log = hooks.on_log
        hooks.on_log = lambda e, metrics: log(e, resumes.logged(e, metrics))
    stop = StopRequest(join(run_storage, STOP_FILE), notices=[elastic.NOTICE])  # SIGTERM, Ray's node drains
    elastic.NOTICE.training = True
    try:
        res = fit(engine, train_batches, val_batches, hooks, max_steps=lc.get("max_steps"), progress=rank == 0,
                  stop=stop, evaluate=evaluate, rewinder=rewinder)
    except BaseException as exc:
        if audit is not None:  # one try, no waiting, and never in place of the error that ends the attempt
            with faults.retry_window_of(0), contextlib.suppress(Exception):
                audit.close()
        found = storage_error_in(exc)  # bare, or inside Ray Data's RayTaskError(UserCodeException) from a read task
        if found is not None:  # its line says it all (pipeline/console.py logs it as one line, no frames); its kind
            raise type(found)(str(found)) from None  # kept: a full disk is not retried (failure_policy.py)
        raise
    finally:
        elastic.NOTICE.training = False
    uploads.finish()  # the last checkpoint (a stop's, a preemption's too) uploaded and registered before the end
    if audit is not None:
        audit.close()
    if res.stopped_early and stop.preempted:  # checkpointed; the next attempt starts on the nodes that remain
        elastic.wait_for_checkpoint()  # registered by Ray Train before this attempt ends, or the next would miss it
        # Its `preemption:` line comes from Ray Train's controller (elastic.ElasticEvents), which outlives the
        # attempt: a worker's own line could be lost, its process killed once another rank had raised.
        raise elastic.PreemptionStop(f"{stop.preempted}; checkpointed step {engine.step}"
                                     f"{elastic.PREEMPTION_STOP_END}")
    if resumes is not None:  # the last progress record, written in the background
        resumes.flush()
    if tracker is not None:  # samples that waited for storage: logged now, within run.storage_retry_s
        tracker.flush_deferred()


def _announce_parallel(engine, meta: dict[str, Any] | None, tracker) -> None:
    """Rank 0: which parallel mode runs and why (when there was a choice: several workers, or train.parallel set);
    on a resume with another worker count, what became of the global batch (the data cursor counts global
    sequences, so the resume stays exact either way)."""
    if engine.world_size > 1 or engine.cfg.train.parallel != "auto":
        over = (f"{engine.world_size} worker(s)" if engine.mesh.degree == 1 else
                f"{engine.world_size} workers, {engine.mesh.describe()}")
        worker_print(f"parallel: {engine.parallel} over {over} ({engine.parallel_reason})")
    before = (meta or {}).get("world_size")
    old_cfg = (meta or {}).get("config", {}).get("train", {})
    old_cp, cp = old_cfg.get("context_parallel_degree", 1), engine.mesh.degree
    experts = getattr(engine, "experts", None)
    old_ep, ep = old_cfg.get("expert_parallel_degree", 1), experts.mesh.degree if experts is not None else 1
    changed = bool(before) and (before != engine.world_size or old_cp != cp or old_ep != ep)
    if tracker is not None:
        from pipeline.tracking.names import MESH_TAG, PARALLEL_TAG

        mesh = f"{engine.world_size} worker(s), data {engine.data_world_size} x context {cp}"
        if ep > 1 or old_ep > 1:  # the experts' split: each block of experts on `expert` ranks of the data ranks
            mesh += f", experts split over expert {ep}"
        if changed:  # the run's params keep the first values: the tag says what it trains on since this step
            mesh += (f" since step {engine.step} (before: {before} worker(s), data {before // old_cp} x context "
                     f"{old_cp}{f', expert {old_ep}' if ep > 1 or old_ep > 1 else ''})")
        tracker.set_tags({PARALLEL_TAG: f"{engine.parallel}: {engine.parallel_reason}", MESH_TAG: mesh})
    if changed:
        t = engine.cfg.train
        old_global = old_cfg.get("batch_size", t.batch_size) * old_cfg.get("grad_accum", t.grad_accum) * (
            before // old_cp)  # rows per step: the data ranks' (a context group shares its rows)
        new_global = t.batch_size * t.grad_accum * engine.data_world_size
        note = "" if old_global == new_global else (f"; the global batch changes from {old_global} to {new_global} "
                                                    f"sequences per step (train.batch_size x train.grad_accum x "
                                                    f"workers / train.context_parallel_degree): set them to keep "
                                                    f"{old_global}")
        degrees = "" if old_cp == cp else f", context parallel degree {old_cp} -> {cp} (the weights are not split by it)"
        if old_ep != ep:  # a checkpoint holds every expert whole: any degree reads it
            degrees += f", expert parallel degree {old_ep} -> {ep} (the checkpoint holds every expert whole)"
        worker_print(f"resume: checkpoint written by {before} worker(s) ({meta.get('layout', 'full')} layout), "
                     f"resumed on {engine.world_size}{degrees}{note}")


def _gathered(samples):
    """The eval-samples hook under FSDP: generation needs whole weights, so every worker enters the gather and
    rank 0 (the one with a hook) generates inside it, through the hook-free twin full_model yields: no sharded
    module runs on rank 0 alone (engine.py full_model says why that would hang the next backward)."""
    def hook(engine, metrics) -> None:
        with engine.full_model() as decoder:
            if samples is not None:
                samples(engine, metrics, decoder)

    return hook


# ------------------------------------------------------------------------------------------ driver
def run_training(cfg: Config, dataset_dir: str | Path, run_dir: str | Path, *, mlflow_run_id: str | None = None,
                 init_from: str | Path | None = None, max_steps: int | None = None, phase: int = 0,
                 audit_data: bool = False, callbacks: list | None = None,
                 required_metric: str | None = None, schedule=None,
                 resume_from: str | Path | None = None, manifest=None) -> TrainOutcome:
    """Train with Ray Train. Checks inputs before any worker starts; returns the latest checkpoint. `manifest`: the
    dataset's, as the session read it (read here otherwise); the workers are handed it.

    `callbacks` go to Ray Train's RunConfig (a Tune trial passes TuneReportCallback: pipeline/sweep/trial.py).
    `required_metric`: every report must carry it, or the workers fail with MissingMetricError (a sweep's metric).

    Rerunning with the same run_dir resumes from the latest checkpoint in its Ray storage (Ray Train
    restores the run by name; an incomplete one is skipped for the newest complete one). `resume_from` resumes from
    that checkpoint instead (`train --resume RUN --checkpoint PATH`). `init_from` starts from another checkpoint's
    full state (phases); `schedule` (pipeline/train/engine.py PhaseSchedule) places the phase in the one LR
    schedule, with its re-warmup and optimizer reset.
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    from pipeline.train.distributed import elastic
    from pipeline.train.checkpoints.state import warn_if_no_room_for_checkpoints
    from pipeline.train.engine import check_checkpoint_fits, read_checkpoint_meta
    from pipeline.train.distributed.failure_policy import QuietController, trainer_class
    from pipeline.data.shards import check_compatible, check_trainable, load_manifest

    run_dir = Path(run_dir).resolve()
    dataset_dir = absolute(dataset_dir)
    manifest = manifest if manifest is not None else load_manifest(dataset_dir)
    check_compatible(manifest, seq_len=cfg.data.seq_len)
    # rows per micro-batch step: one per data rank (a context group of train.context_parallel_degree shares its rows)
    check_trainable(manifest, dataset_dir, cfg.train.batch_size, cfg.ray.num_workers // cfg.train.context_parallel_degree)
    if init_from is not None:
        init_from = absolute(init_from)
        with local_copy(init_from) as d:
            check_checkpoint_fits(read_checkpoint_meta(d), cfg.model.tier, manifest.vocab_size, init_from)
    if resume_from is not None:  # complete and of this model, before any worker starts
        resume_from = absolute(resume_from)
        check_checkpoint_fits(read_checkpoint_meta(resume_from), cfg.model.tier, manifest.vocab_size, resume_from,
                              mixer=cfg.model.mixer)
    from pipeline.train.task_scoring import check_scoring, validation_config

    score_tasks = check_scoring(cfg)  # eval.tasks: scored beside the workers by Ray Train's validation hook
    ensure_ray(cfg.ray.address, cfg)
    check_fits_cluster(cfg)  # START_TIMEOUT_ENV, when set here, reaches Ray Train's controller
    run_store, storage = run_storage(cfg, run_dir), ray_storage(cfg, run_dir)
    check_places_for_workers(cfg, {"the dataset": dataset_dir, "ray.storage_path": storage,
                                   "the run's storage": run_store, "the previous phase's checkpoint": init_from or "",
                                   "--checkpoint": resume_from or ""})
    for what, where in (("ray.storage_path", storage), ("the run's storage", run_store)):
        check(where, what=what, write=True)  # endpoint, bucket, credentials: one line, before any worker
    warn_if_no_room_for_checkpoints(cfg, manifest.vocab_size, storage)
    run_name = f"phase{phase}"
    # the manifest read once here, handed to every worker (and by them to their read tasks) as its dict
    lc = {"config": cfg.flat(), "dataset_dir": dataset_dir, "manifest": manifest.to_dict(),
          "vocab_size": manifest.vocab_size,
          "run_storage": run_store, "ray_storage": storage, "mlflow_run_id": mlflow_run_id, "init_from": init_from,
          "max_steps": max_steps, "phase": phase, "audit_data": audit_data,
          "required_metric": required_metric, "interactive": interactive(),
          "schedule": dataclasses.asdict(schedule) if schedule is not None else {},
          "resume_from": resume_from, "fit_id": uuid.uuid4().hex,  # fit_id: in meta.json of what this fit writes
          "score_tasks": score_tasks}
    # An error that the next attempt would raise again (a broken checkpoint, a refused config) spends no retry
    trainer = elastic.keeping_context_groups(_without_dataset_manager(trainer_class(TorchTrainer)),
                                             worker_group(cfg) if cfg.ray.min_workers else 1)(
        train_loop_per_worker,
        train_loop_config=lc,
        # A range MIN-MAX runs elastic (pipeline/train/distributed/elastic.py); the backend sets each worker up before its
        # process group starts (its network interface, SIGTERM as a preemption notice).
        scaling_config=ray.train.ScalingConfig(num_workers=elastic.worker_count(cfg), use_gpu=use_gpu(cfg),
                                               resources_per_worker=worker_resources(cfg),
                                               placement_strategy=cfg.ray.placement_strategy,
                                               elastic_resize_monitor_interval_s=cfg.ray.resize_check_s),
        # The process group's timeout bounds every collective's wait (gloo and NCCL): a rank that does not join one
        # ends the attempt with one line instead of a silent hang (pipeline/train/distributed/collectives.py)
        torch_config=elastic.torch_config(cfg.train.collective_timeout_s),
        validation_config=validation_config(cfg, lc),  # eval.tasks on the checkpoints, as Ray tasks beside the workers
        run_config=ray.train.RunConfig(
            # Ray's own storage calls (its snapshot of the checkpoints, each worker's storage check at start, restores,
            # deletions) ride out an outage for run.storage_retry_s too: a restart waits for the store.
            name=run_name, **ray_storage_args(storage, retry_s=cfg.run.storage_retry_s),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints,
                                                         checkpoint_score_attribute=VAL_LOSS,
                                                         checkpoint_score_order="min"),
            # Worker errors and failures to start the workers (their resources never came within the start
            # timeout) are both retried ray.max_failures times; Ray's default retries the latter forever. Errors
            # that would repeat are not retried (pipeline/train/distributed/failure_policy.py).
            failure_config=ray.train.FailureConfig(max_failures=cfg.ray.max_failures,
                                                   controller_failure_limit=cfg.ray.max_failures),
            # Ray Train's INFO lines (worker group started, each checkpoint reported) stay in its log files.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            callbacks=[QuietController(),
                       elastic.ElasticEvents(cfg.ray.resize_check_s if cfg.ray.min_workers else None),
                       *(callbacks or [])]),
    )
    try:
        result = fit_with_clean_stop(trainer, join(run_store, STOP_FILE))
    except Exception as exc:  # noqa: BLE001 -- a failure to start becomes one line; anything else goes on up
        elastic.raise_setup_error(exc)  # a node whose workers cannot join the process group: its one line
        from pipeline.ray_runtime import find_cause

        storage_error = find_cause(exc, lambda e: isinstance(e, StorageError))
        if storage_error is not None:  # the store (also when the workers could not start for it): its own line
            raise type(storage_error)(str(storage_error).strip().splitlines()[0]) from None
        raw = find_cause(exc, lambda e: isinstance(e, OSError) and "AWS Error" in str(e) and bool(faults.kind(e)))
        if raw is not None:  # Ray's own storage call (its storage check at a worker's start, its snapshot)
            raise explain(raw, storage, "ray.storage_path") from None
        start_error = _start_failure(exc, cfg.ray.max_failures + 1)
        if start_error is None:
            from pipeline.ray_runtime import find_cause
            from pipeline.train.distributed.collectives import CollectiveTimeoutError

            # a worker's one-line error, out of Ray's wrappers (TrainingFailedError's worker failures)
            line = find_cause(exc, lambda e: isinstance(e, CollectiveTimeoutError))
            if line is not None:
                raise CollectiveTimeoutError(str(line)) from None
            raise
        raise TrainStartError(f"{_request_text(cfg)}: {start_error}; {_cluster_text()}. Free the resources, "
                              f"lower ray.num_workers / ray.cpus_per_worker, or wait longer per attempt with "
                              f"{START_TIMEOUT_ENV}") from None
    ckpt = (native(location_of(result.checkpoint.filesystem, result.checkpoint.path, storage))
            if result.checkpoint is not None else None)
    metrics = dict(result.metrics or {})
    stopped = metrics.get("step", 0) < (max_steps or cfg.train.max_steps)
    return TrainOutcome(run_dir, ckpt, metrics, mlflow_run_id, stopped)


def check_places_for_workers(cfg: Config, places: dict[str, str]) -> None:
    """Before any worker starts: every place the workers open must be one they can reach. A bare local path
    (dataset, checkpoints, run storage) or a local MLflow store on a cluster whose workers run on other nodes is
    refused with one line naming the fix."""
    require_shared(cfg, places)
    from pipeline.tracking.tracker import TrackingError, local_store_path

    uri = cfg.tracking.tracking_uri
    if cfg.tracking.enabled and uri and local_store_path(uri) is not None and workers_may_be_elsewhere(cfg):
        raise TrackingError(f"the MLflow store {uri} is a file on this machine, but rank 0 may run on another node "
                            "and log there; set MLFLOW_TRACKING_URI (or tracking.tracking_uri) to an MLflow server "
                            "every node reaches (cluster.yaml runs one on the head)")


# ------------------------------------------------------------------------------- resources, start failures
def worker_resources(cfg: Config) -> dict[str, float]:
    """What each Ray Train worker reserves (ScalingConfig adds the GPU when use_gpu; a worker that leaves part of its
    GPU to the downstream tasks' scoring asks for the rest: pipeline/train/task_scoring.py gpu_share)."""
    from pipeline.train.task_scoring import gpu_share

    return {"CPU": worker_cpus(cfg), **({"GPU": gpu_share(cfg) or 1} if use_gpu(cfg) else {})}


def check_fits_cluster(cfg: Config) -> None:
    """Fail at once, with the fix, when the workers ask for more of a resource than the whole local Ray has.
    Anything else that keeps them from starting (resources held by others, a placement no node allows) is
    waited for, START_TIMEOUT_ENV seconds per attempt. A joined cluster may autoscale: it is not checked."""
    import ray

    from pipeline.ray_runtime import joins_cluster

    if joins_cluster(cfg.ray.address):
        return
    total = ray.cluster_resources()
    n = cfg.ray.min_workers or cfg.ray.num_workers  # an elastic run starts with what there is, from MIN
    for name, per_worker in worker_resources(cfg).items():
        if per_worker * n > total.get(name, 0):
            raise TrainStartError(f"{_request_text(cfg)} can never start: this Ray has {total.get(name, 0):g} {name} "
                                  f"in all; lower ray.num_workers or ray.cpus_per_worker"
                                  + (", or set ray.use_gpu=false" if name == "GPU" else ""))


def _request_text(cfg: Config) -> str:
    res = ", ".join(f"{k} {v:g}" for k, v in worker_resources(cfg).items())
    count = f"{cfg.ray.min_workers}-{cfg.ray.num_workers}" if cfg.ray.min_workers else cfg.ray.num_workers
    return f"Ray Train's {count} worker(s) with {{{res}}} each ({cfg.ray.placement_strategy})"


def _cluster_text() -> str:
    import ray

    free, total = ray.available_resources(), ray.cluster_resources()
    shown = [k for k in ("CPU", "GPU") if k in total]
    return "free now: " + ", ".join(f"{k} {free.get(k, 0):g} of {total[k]:g}" for k in shown)


def _start_failure(exc: BaseException, attempts: int) -> str | None:
    """A short reason when `exc` is Ray Train giving up on starting the workers, else None."""
    from ray.train.v2._internal.exceptions import (InsufficientClusterResourcesError, WorkerGroupStartupFailedError,
                                                   WorkerGroupStartupTimeoutError)

    from pipeline.ray_runtime import find_cause

    cause = find_cause(exc, lambda e: isinstance(e, (WorkerGroupStartupTimeoutError, WorkerGroupStartupFailedError,
                                                     InsufficientClusterResourcesError)))
    if cause is None:
        return None
    if isinstance(cause, WorkerGroupStartupTimeoutError):
        timeout = float(os.environ.get(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S))
        return f"their resources did not come within {timeout:g} s, in {attempts} attempt(s) (ray.max_failures + 1)"
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}"


def fit_with_clean_stop(trainer, stop_file: str):
    """trainer.fit(), where the first Ctrl+C makes every worker checkpoint and stop at the same step.

    Ray Train's own Ctrl+C handler aborts the run without a checkpoint, and it only installs itself from
    the main thread; so fit() runs in a helper thread while the main thread turns Ctrl+C into the stop
    file the workers poll (a local path, or an object in the run's storage). A second Ctrl+C interrupts at
    once. In a Tune trial (not the main thread) this is plain trainer.fit().
    """
    if threading.current_thread() is not threading.main_thread():
        return trainer.fit()
    delete(stop_file)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    def on_sigint(signum, frame) -> None:
        if exists(stop_file):
            raise KeyboardInterrupt
        write_bytes(stop_file, b"")
        print("\nstop requested: the workers checkpoint and stop at their next log step "
              "(Ctrl+C again to abort without a checkpoint)", flush=True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    thread = threading.Thread(target=run, name="ray-train-fit", daemon=True)
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
    finally:
        signal.signal(signal.SIGINT, previous)
        try:  # a stop request left behind is harmless (the next fit deletes it first): never hide fit()'s outcome
            delete(stop_file)
        except StorageError as exc:
            if "error" not in box:
                print(f"warning: the stop request {stop_file} was not removed: {exc}", flush=True)
    if "error" in box:
        raise box["error"]
    return box["result"]
