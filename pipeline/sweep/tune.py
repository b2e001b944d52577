"""Ray Tune sweeps over the one trainer, tracked as one MLflow parent run with a child run per trial.

    python pipeline/run.py tune --space tune_spaces/bs_tier.yaml --preset gpu
    python pipeline/run.py tune --space tune_spaces/lr.yaml --preset cpu --train.max_steps=300
    ray job submit --working-dir . -- python pipeline/run.py tune --space tune_spaces/lr.yaml --address auto

How it runs (the Ray Train V2 way of running Train inside Tune): every Tune trial is a small function
(`run_trial`, ~0 CPU) that builds the trial's config from the space's field paths, opens its MLflow
child run, and calls pipeline/train/ray_train.py's `run_training` -- the same TorchTrainer, workers, engine and
metric names as a single run -- with Ray Train's `TuneReportCallback`, so every report the workers make
(at each checkpoint) reaches Tune. ASHA then compares trials on the sweep's metric over tokens seen
(`train/tokens_seen`), so different batch sizes are compared at equal tokens, not equal steps.

Failures: no trial can end the sweep. Whatever a trial raises -- its config is invalid, its dataset cannot train
it, its workers cannot start, they fail or run out of memory (torch.OutOfMemoryError inside a Train worker comes
back as a TrainingFailedError wrapping it) -- is recorded on the trial alone: status `failed` (or `oom`) and the
reason in the table, its MLflow child run FAILED with tag longtrain.failure_reason, and Tune carries on with the
others. Every report that reaches Tune carries the sweep's metric (Tune's strict metric check would otherwise end
the whole sweep): the trial's workers check each report before they make it and fail the trial with
MissingMetricError naming what the report had. With `skip_unfit_batch: true` the max-batch finder
(pipeline/train/max_batch.py) runs once per tier first (for trials of several workers, which may shard the model
with FSDP, the memory model's plan for that worker count), and batch sizes above what fits are recorded as `oom`
without being run.

Figures: the table's tokens/s and MFU are steady state (train/steady_tokens_per_s, train/steady_mfu): each trial's
optimizer steps after its first three (torch.compile, warm-up) up to its last report, timed inside the steps; the
table says which steps. Peak memory is the trial's peak, the largest on any of its workers.

Ending trials. A trial that trains its token budget ends by itself (ASHA does not stop trials at max_t:
`stop_last_trials=False`), so its Train run shuts down its workers and placement group. A trial ASHA
stops early is ended by Tune terminating the trial's actor; the Train controller dies with it, and its
workers' placement group would not: Ray ties it to the job (the sweep's driver), and only Ray Train's
PlacementGroupCleaner, polling the state API, would remove it later. On a machine whose GPUs fit one
trial that left every later trial waiting for resources that never came back. So the driver's
`ReleaseTrialResources` callback removes the trial's placement group (every report names it) the moment
Tune ends the trial. A Ctrl+C ends the driver's job, and with it every trial at once; on a Ray that outlives the
command the driver then joins it again for a moment and removes any group that job still holds
(`release_ended_job`): a Train controller restarting its worker group as the job ended can register a group after
Ray has removed the job's, and that group would stay held.

At the end: the table (tier, batch size, tokens/s, MFU, peak memory, metric, status) is printed and logged to
the parent run as markdown and PNG, and the best finished trial's config is written as a preset:
<run.root>/tune/<sweep>/best_preset.yaml, for `python pipeline/run.py train --preset <that file>`.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.tune import Callback

from pipeline.config import Config, ConfigError, from_flat
from pipeline.console import stage
from pipeline.sweep.report import FAILED, OK, OOM, STOPPED, TrialRow, best_row, markdown_table, plot_sweep
from pipeline.sweep.report import write_best_preset, write_markdown
from pipeline.data.mixture import inline_mixture
from pipeline.sweep.space import Space, SpaceError, load_space, resolve_mixture  # noqa: F401  (SpaceError: API)
from pipeline.sweep.status_lines import StatusLines
from pipeline.train.ray_train import PLACEMENT_GROUP_KEY, START_TIMEOUT_ENV

TRIAL_CPUS = 0.01  # the trial function only waits on its TorchTrainer; Tune refuses a 0-CPU trial
STATUS_KEY, REASON_KEY, RUN_ID_KEY = "sweep/status", "sweep/reason", "sweep/mlflow_run_id"
TAG_SWEEP, TAG_TRIAL = "longtrain.sweep", "longtrain.trial_id"
TAG_STATUS, TAG_REASON = "longtrain.status", "longtrain.failure_reason"


class TrialFailed(RuntimeError):
    """Raised by a trial after it recorded its failure, so Tune marks it errored and goes on."""


@dataclass
class SweepContext:
    """What every trial needs from the driver (shipped once through tune.with_parameters)."""

    base: dict[str, Any]  # flat config: the preset, CLI overrides and the space's fixed values, paths pinned
    dataset_dir: str
    sweep_dir: str
    sweep_name: str
    metric: str
    token_budget: int
    parent_run_id: str | None
    max_fit: dict[str, int] = field(default_factory=dict)  # tier -> largest micro-batch that fits
    env: dict[str, str] = field(default_factory=dict)  # the driver's Ray Train settings, set in every trial
    mixtures: dict[str, str] = field(default_factory=dict)  # named mixtures of the space: name -> data.mixture


def resolved(params: dict[str, Any], base: dict[str, Any], mixtures: dict[str, str]) -> dict[str, Any]:
    """A trial's searched values as config overrides: a named mixture or simplex weights become data.mixture."""
    if "data.mixture" not in params:
        return params
    return {**params, "data.mixture": resolve_mixture(params["data.mixture"], base["data.mixture"], mixtures)}


@dataclass
class SweepResult:
    name: str
    sweep_dir: Path
    rows: list[TrialRow]
    best: TrialRow | None
    best_preset: Path | None
    parent_run_id: str | None
    table_md: Path
    table_png: Path


# ------------------------------------------------------------------------------------ failures
def is_oom(exc: BaseException | None) -> bool:
    """True if `exc` or anything it wraps (Ray task errors, Train worker failures, causes) is an
    out-of-memory error: torch.OutOfMemoryError, MemoryError or Ray's own OutOfMemoryError."""
    import torch

    from pipeline.ray_runtime import find_cause

    return find_cause(exc, lambda e: isinstance(e, (torch.OutOfMemoryError, MemoryError))
                      or type(e).__name__ == "OutOfMemoryError") is not None


def _reason(exc: BaseException, limit: int = 90) -> str:
    """One line naming what failed, at most `limit` characters (the table's; MLflow's tag gets 250)."""
    inner = exc
    for e in getattr(exc, "worker_failures", {}).values():
        inner = e
        break
    lines = [ln.strip() for ln in str(inner).strip().splitlines() if ln.strip()]
    text = f"{type(inner).__name__}: {lines[-1] if lines else ''}"
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ---------------------------------------------------------------------------------- the trial
def tokens_per_step(cfg: Config) -> int:
    return cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len * cfg.ray.num_workers


def trial_config(ctx: SweepContext, params: dict[str, Any], trial_id: str) -> Config:
    """The trial's config: base + searched values, its own storage, and steps from the token budget."""
    cfg = from_flat(ctx.base).replace(resolved(params, ctx.base, ctx.mixtures))
    storage = cfg.ray.storage_path.rstrip("/")
    over: dict[str, Any] = {"run.name": f"{ctx.sweep_name}-{trial_id}",
                            # Ray Train resumes a run by name in its storage: each trial needs its own.
                            "ray.storage_path": f"{storage}/{ctx.sweep_name}/{trial_id}" if storage else ""}
    return with_token_budget(cfg.replace(over), ctx.token_budget)


def with_token_budget(cfg: Config, token_budget: int) -> Config:
    """cfg with train.max_steps set so the run trains `token_budget` tokens (unchanged when 0)."""
    if not token_budget:
        return cfg
    return cfg.replace({"train.max_steps": max(1, math.ceil(token_budget / tokens_per_step(cfg)))})


def _child_tracker(cfg: Config, ctx: SweepContext, trial_id: str, params: dict[str, Any], valid: bool = True):
    """The trial's MLflow child run, with the same params as a single run (pipeline/train/session/train_session.py). For a trial
    whose config is invalid (`valid` False, `cfg` the sweep's base): the base config and the searched values."""
    from pipeline.data.shards import load_manifest
    from pipeline.tracking.tracker import open_tracker
    from pipeline.train.session.train_session import run_params

    short = " ".join(f"{k.split('.')[-1]}={v:.3g}" if isinstance(v, float) else f"{k.split('.')[-1]}={v}"
                     for k, v in sorted(params.items()))
    tracker = open_tracker(cfg, run_name=f"{trial_id} {short}", parent_run_id=ctx.parent_run_id)
    tracker.set_tags({TAG_SWEEP: ctx.sweep_name, TAG_TRIAL: trial_id})
    if valid:
        tracker.log_config(run_params(cfg, load_manifest(ctx.dataset_dir)))
    else:
        tracker.log_params({**cfg.flat(), **params})
    return tracker


# What a finished trial's summary takes from its last report.
SUMMARY_KEYS = ("train/tokens_per_s", "train/steady_tokens_per_s", "train/steady_mfu", "train/steady_steps",
                "train/peak_mem_gib", "train/tokens_seen", "step")


def run_trial(params: dict[str, Any], ctx: SweepContext) -> dict[str, Any]:
    """One Tune trial: train with the trial's config and return its summary (Tune reports it last)."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from pipeline.train.ray_train import run_training

    trial_id = ray.tune.get_context().get_trial_id()
    os.environ.update(ctx.env)  # a trial runs in a Ray worker, which has the cluster's environment, not ours
    try:  # a combination of searched values that is invalid together: the trial fails, with a child run to show it
        cfg, invalid = trial_config(ctx, params, trial_id), None
    except ConfigError as exc:
        cfg, invalid = from_flat(ctx.base), exc
    run_dir = Path(ctx.sweep_dir) / "trials" / trial_id
    run_dir.mkdir(parents=True, exist_ok=True)
    tracker = _child_tracker(cfg, ctx, trial_id, params, valid=invalid is None)
    # Every report to Tune carries the metric (NaN until known): Tune's strict metric check ends the sweep otherwise.
    summary = {STATUS_KEY: OK, REASON_KEY: "", RUN_ID_KEY: tracker.run_id or "", ctx.metric: float("nan")}

    def fail(status: str, reason: str, exc: BaseException | None) -> None:
        full = _reason(exc, limit=250) if exc is not None else reason
        tracker.set_tags({TAG_STATUS: status, TAG_REASON: status if status == OOM else full})
        tracker.finish("FAILED")
        ray.tune.report({**summary, STATUS_KEY: status, REASON_KEY: reason})
        raise TrialFailed(f"trial {trial_id} failed: {status} ({reason})") from exc

    if invalid is not None:
        fail(FAILED, _reason(invalid), invalid)
    fit_max = ctx.max_fit.get(cfg.model.tier)
    if fit_max is not None and cfg.train.batch_size > fit_max:
        fail(OOM, f"skipped: largest batch that fits is {fit_max}", None)
    if cfg.data.mixture:  # each source's rows and passes for this trial's weights (refused when one runs out)
        from pipeline.data.mixture import MixtureError
        from pipeline.data.shards import load_manifest
        from pipeline.train.session.mixture_run import record_data

        try:
            cfg = record_data(cfg, ctx.dataset_dir, load_manifest(ctx.dataset_dir), tracker,
                              steps=cfg.train.max_steps, run_dir=run_dir)  # a trial shorter than a block: its own
        except MixtureError as exc:
            fail(FAILED, _reason(exc), exc)
    try:
        outcome = run_training(cfg, ctx.dataset_dir, run_dir, mlflow_run_id=tracker.run_id,
                               callbacks=[TuneReportCallback()], required_metric=ctx.metric)
    except Exception as exc:  # noqa: BLE001 -- every failure is recorded, then re-raised for Tune
        fail(OOM if is_oom(exc) else FAILED, _reason(exc), exc)
    tracker.set_tags({TAG_STATUS: OK})
    tracker.finish("FINISHED")
    last = outcome.metrics
    summary.update({k: last[k] for k in SUMMARY_KEYS if k in last})
    summary[ctx.metric] = float(last.get(ctx.metric, float("nan")))
    return summary


# ---------------------------------------------------------------------------------- the driver
def _plan_fit(flat: dict[str, Any], tier: str, vocab_size: int, upper: int) -> tuple[str, int, str]:
    """(tier, largest micro-batch, how) for a trial of ray.num_workers > 1 workers, from the memory model
    (pipeline/train/memory/plan.py) with this process's device, as the trial's workers will resolve
    train.parallel and use model.activation_checkpointing."""
    from pipeline.train.memory.hardware import default_device
    from pipeline.train.memory.plan import choose_parallel, max_batch_by_model, usable_bytes
    from pipeline.train.distributed.parallel import device_memory_gib

    cfg = from_flat(flat).replace({"model.tier": tier})
    device, workers = default_device(), cfg.ray.num_workers
    limit = device_memory_gib(cfg, device)
    mode = cfg.train.parallel
    if mode == "auto":
        mode = choose_parallel(cfg, vocab_size, workers=workers, limit_gib=limit, device_type=device.type)[0]
    b, est = max_batch_by_model(cfg, vocab_size, limit_bytes=usable_bytes(limit, device.type), upper=upper,
                                workers=workers, parallel=mode, device_type=device.type)
    return tier, b, (f"memory model, {workers} workers, {mode}, activation checkpointing "
                     f"{cfg.model.activation_checkpointing}, {limit:.2f} GiB each")


def _max_fit_per_tier(cfg: Config, space: Space, vocab_size: int) -> dict[str, int]:
    """The largest micro-batch per tier in the sweep, each found by a Ray task on a trial worker's resources: the
    max-batch finder's measured search for one-worker trials; for trials of several workers (sharded under FSDP,
    their memory is not one process's to measure) the memory model's plan for that worker count."""
    import ray

    from pipeline.train.max_batch import find_max_batch
    from pipeline.ray_runtime import use_gpu

    upper = max(int(b) for b in space.values_of("train.batch_size", cfg))

    def probe(flat: dict[str, Any], tier: str) -> tuple[str, int, str]:
        if from_flat(flat).ray.num_workers > 1:
            return _plan_fit(flat, tier, vocab_size, upper)
        f = find_max_batch(from_flat(flat), tier=tier, vocab_size=vocab_size, upper=upper)
        return tier, f.max_batch, f"measured, {f.limit_gib:.2f} GiB {'simulated' if f.simulated else 'device'}"

    # max_calls=1: the worker process exits after its probe, so its CUDA context and cached device memory
    # go with it instead of staying in an idle Ray worker beside the trials (.options() cannot set it).
    task = ray.remote(num_cpus=cfg.ray.cpus_per_worker, num_gpus=1 if use_gpu(cfg) else 0, max_calls=1)(probe)
    tiers = [str(t) for t in space.values_of("model.tier", cfg)]
    found = ray.get([task.remote(cfg.flat(), t) for t in tiers])
    for tier, max_batch, how in found:
        print(f"max-batch finder: tier {tier} at seq_len {cfg.data.seq_len}: largest micro-batch {max_batch} ({how})")
    return {tier: max_batch for tier, max_batch, _ in found}


def _auto_concurrency(cfg: Config) -> int:
    """Trials that fit the cluster at once: each holds num_workers x cpus_per_worker CPUs (+1 for Ray Data)
    and, on GPUs, num_workers GPUs."""
    import ray

    from pipeline.ray_runtime import use_gpu

    res = ray.cluster_resources()
    n = int(res.get("CPU", 1) // (cfg.ray.num_workers * cfg.ray.cpus_per_worker + 1))
    if use_gpu(cfg):
        n = min(n, int(res.get("GPU", 0) // cfg.ray.num_workers))
    return max(1, n)


class ReleaseTrialResources(Callback):
    """Tune callback (driver side): when Tune ends a trial, remove the placement group its Train run holds.

    A trial ended by its own return has already released it (the Train controller removes it on shutdown);
    this is for a trial Tune stops (ASHA) or whose actor dies, whose Train controller dies with the actor and
    leaves the placement group to the job. Removing it also ends the Train workers inside it."""

    def __init__(self) -> None:
        self.placement_groups: dict[str, str] = {}  # trial id -> hex id of its Train run's latest placement group
        self.released: list[str] = []

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        if result.get(PLACEMENT_GROUP_KEY):
            self.placement_groups[trial.trial_id] = result[PLACEMENT_GROUP_KEY]

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.release(trial.trial_id)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.release(trial.trial_id)

    def release(self, trial_id: str) -> None:
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        pg_hex = self.placement_groups.pop(trial_id, None)
        if not pg_hex:
            return
        pg = PlacementGroup(ray.PlacementGroupID.from_hex(pg_hex))
        if ray.util.placement_group_table(pg).get("state") in (None, "REMOVED"):
            return  # the Train run gave it back itself
        remove_placement_group(pg)
        self.released.append(pg_hex)
        print(f"tune: trial {trial_id} ended; released its Train placement group {pg_hex}", flush=True)


def _sizes(base: Config, full: dict[str, Any]) -> tuple[int | None, int | None]:
    """(total, active) parameters of a trial's model at the config's vocabulary (model/flops.py), or Nones."""
    from model.flops import active_param_count, param_count
    from pipeline.config import ConfigError, model_tier

    try:
        cfg = base.replace(full)
    except ConfigError:
        return None, None
    tier, v, tie = model_tier(cfg), cfg.data.vocab_size, cfg.model.tie_embeddings
    return param_count(tier, v, tie), active_param_count(tier, v, tie)


def _rows(grid, space: Space, base: Config) -> list[TrialRow]:
    rows = []
    for result in grid:
        df = result.metrics_dataframe
        records = df.to_dict("records") if df is not None else []
        last: dict[str, Any] = {}
        for rec in records:  # last non-missing value of every column
            last.update({k: v for k, v in rec.items() if v is not None and not (isinstance(v, float) and math.isnan(v))})
        status = last.get(STATUS_KEY) or (FAILED if result.error else STOPPED)
        params = {k: result.config[k] for k in space.params}
        full = resolved(params, base.flat(), space.mixtures())
        if status == STOPPED and last.get("step", 0) >= with_token_budget(base.replace(full),
                                                                          space.token_budget).train.max_steps:
            status = OK  # stopped at its last report (an ASHA rung at the budget): it trained every step
        reason = last.get(REASON_KEY, "")
        if status == FAILED and not reason and result.error is not None:
            reason = OOM if is_oom(result.error) else _reason(result.error)
            status = OOM if reason == OOM else FAILED
        if status == STOPPED:
            reason = "early, by the scheduler"
        total, active = _sizes(base, full)
        rows.append(TrialRow(
            trial_id=str(last.get("trial_id") or Path(result.path).name), params=params,
            params_total=total, params_active=active,
            tier=str(params.get("model.tier", base.model.tier)),
            batch_size=int(params.get("train.batch_size", base.train.batch_size)),
            tokens_per_s=last.get("train/steady_tokens_per_s"), peak_mem_gib=last.get("train/peak_mem_gib"),
            metric_value=last.get(space.metric), status=status, reason=str(reason or ""),
            mlflow_run_id=last.get(RUN_ID_KEY) or None, steps=last.get("step"),
            tokens_seen=last.get("train/tokens_seen"), mfu=last.get("train/steady_mfu"),
            steady_steps=last.get("train/steady_steps"),
            extra={k: v for k, v in last.items() if is_source_loss(k)}))  # a mixture: each source's val loss
    return rows


def _close_stopped_children(parent, rows: list[TrialRow], sweep_name: str) -> None:
    """Trials ASHA stopped were ended with their actor, mid-run or just after their last report: mark their
    child runs finished (a stopped run's Train workers may have seen their placement group go first and
    recorded a failure), tagged with the row's status."""
    if parent.run_id is None:
        return
    for row in rows:
        if row.status not in (STOPPED, OK) or (row.status == OK and row.mlflow_run_id):
            continue
        found = parent.client.search_runs(
            [parent.experiment_id],
            f"tags.`{TAG_SWEEP}` = '{sweep_name}' and tags.`{TAG_TRIAL}` = '{row.trial_id}'")
        for run in found:
            row.mlflow_run_id = run.info.run_id
            parent.client.set_tag(run.info.run_id, TAG_STATUS, row.status)
            if run.info.status != "FINISHED":
                parent.client.set_terminated(run.info.run_id, "FINISHED")
                if TAG_REASON in run.data.tags:
                    parent.client.delete_tag(run.info.run_id, TAG_REASON)


def run_sweep(cfg: Config, space_path: str | Path, command: bool = False) -> SweepResult:
    """Prepare the data once, run the sweep, then write and log the table and the best preset. `command`: called by
    the CLI, whose process ends after a Ctrl+C (so its Ray connection may end with the sweep)."""
    import ray.tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from pipeline.data.stages import prepare_main
    from pipeline.data.shards import check_trainable, load_manifest
    from pipeline.tracking.tracker import check_tracking_uri, open_tracker, pin_tracking_uri, resolve_tracking_uri
    import ray

    from pipeline.ray_runtime import ensure_ray, joins_cluster
    from pipeline.storage import absolute, join, ray_storage_args, run_storage
    from pipeline.storage import pin as pin_storage

    space = load_space(space_path, cfg)
    # a data.mixture file becomes the list it holds: the trials run in other processes and directories
    cfg = pin_storage(inline_mixture(cfg.replace({**space.overrides(), "run.root": str(Path(cfg.run.root).resolve())})))
    if cfg.ray.cpus_per_worker == 0:  # auto: 1 CPU per worker in a sweep, so trials run side by side
        cfg = cfg.replace({"ray.cpus_per_worker": 1})
    if cfg.tracking.enabled:
        check_tracking_uri(resolve_tracking_uri(cfg))  # fail fast, before data or Ray work
        cfg = pin_tracking_uri(cfg)  # trials run in other processes and directories: one store for all
    name = cfg.run.name or f"{space.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep_dir = Path(cfg.run.root) / "tune" / name
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        raise SpaceError(f"sweep directory {sweep_dir} already exists; pick another --run.name (or none: "
                         f"a name with the time is generated)")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "space.yaml").write_text(space.path.read_text())

    dataset = absolute(prepare_main(cfg))
    manifest = load_manifest(dataset)
    check_trainable(manifest, dataset, batch_size=1)  # no validation rows: no trial could be ranked
    _check_named_mixtures(cfg, space, dataset)  # a named mixture that would run out: before any trial starts
    joined_here = not ray.is_initialized()  # a Ray this sweep joined ends with it on Ctrl+C
    ensure_ray(cfg.ray.address, cfg)
    parent = open_tracker(cfg, run_name=name)
    parent.set_tags({TAG_SWEEP: name})
    parent.log_params({"sweep.space": space.path.name, "sweep.metric": space.metric, "sweep.mode": space.mode,
                       "sweep.num_samples": space.num_samples, "sweep.scheduler": space.scheduler["type"],
                       "sweep.token_budget": space.token_budget, "sweep.params": ",".join(space.params)})
    parent.log_artifact(sweep_dir / "space.yaml")
    parent.log_dict(cfg.to_dict(), "base_config.json")
    status = "FAILED"
    try:
        max_fit = _max_fit_per_tier(cfg, space, manifest.vocab_size) if space.skip_unfit_batch else {}
        env = {k: os.environ[k] for k in (START_TIMEOUT_ENV,) if k in os.environ}
        ctx = SweepContext(cfg.flat(), str(dataset), str(sweep_dir), name, space.metric, space.token_budget,
                           parent.run_id, max_fit, env, space.mixtures())
        sched = space.scheduler
        if sched["type"] == "asha":
            max_t = sched["max_t"] or space.token_budget or 2**62  # no cap: trials end at train.max_steps
            # stop_last_trials=False: a trial at its budget ends by itself, releasing what it holds (module doc)
            scheduler = ASHAScheduler(time_attr=sched["time_attr"], max_t=max_t, grace_period=sched["grace_period"],
                                      reduction_factor=sched["reduction_factor"], stop_last_trials=False)
        else:
            scheduler = FIFOScheduler()
        storage = cfg.ray.storage_path or join(run_storage(cfg, sweep_dir), "ray_tune")  # the bucket, if run.storage
        tuner = ray.tune.Tuner(
            ray.tune.with_resources(ray.tune.with_parameters(run_trial, ctx=ctx), {"CPU": TRIAL_CPUS}),
            param_space=space.param_space(),
            tune_config=ray.tune.TuneConfig(metric=space.metric, mode=space.mode, num_samples=space.num_samples,
                                            scheduler=scheduler,
                                            max_concurrent_trials=space.max_concurrent_trials or _auto_concurrency(cfg)),
            # Tune silent (its status tables are ~130 lines for two CPU trials): one line per status change
            # instead, and the full table once at the end (tune_main)
            run_config=ray.tune.RunConfig(name=name, **ray_storage_args(storage), verbose=0,
                                          callbacks=[ReleaseTrialResources(),
                                                     StatusLines(space.metric, list(space.params), STATUS_KEY,
                                                                 REASON_KEY)]),
        )
        stage("tune", f"sweep {name}: trials")  # after prepare's banner: a Ctrl+C from here is the sweep's
        with _ctrl_c_interrupts():
            grid = tuner.fit()
        rows = _rows(grid, space, cfg)
        _close_stopped_children(parent, rows, name)
        result = _report(cfg, space, rows, sweep_dir, name, parent)
        status = "FINISHED"
        return result
    except KeyboardInterrupt:
        status = "KILLED"
        outlives = joins_cluster(cfg.ray.address)  # a Ray that outlives this command
        if joined_here or (command and outlives):
            # the job ends, and every trial (and Train run) with it, so none finishes its MLflow run after this
            ctx = ray.get_runtime_context()
            job, gcs = ctx.get_job_id(), ctx.gcs_address
            ray.shutdown()
            if outlives:  # nothing of the ended job stays held there
                release_ended_job(gcs, job)
        _kill_running_children(parent, name)
        raise
    finally:
        parent.finish(status)


@contextlib.contextmanager
def _ctrl_c_interrupts():
    """Ctrl+C during tuner.fit() raises KeyboardInterrupt here, as it does during `train`: Tune's own handler would
    end the sweep as if it had finished (its trials labelled stopped, the runs FINISHED, a table) and print a
    Tuner.restore() hint the CLI cannot follow. TUNE_DISABLE_SIGINT_HANDLER is read when fit() starts."""
    old = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = old


def job_placement_groups(job: str) -> set[str]:
    """Hex ids of the placement groups that job `job` (hex) holds on the connected Ray: for a sweep, Tune's trial
    groups and, inside the trials, their Train runs' groups (a group's id ends in the id of the job that made it)."""
    import ray

    return {pg for pg, info in ray.util.placement_group_table().items()
            if pg.endswith(job) and info["state"] != "REMOVED"}


def release_placement_groups(job: str, kept: frozenset[str] = frozenset(), quiet_s: float = 2.0,
                             timeout_s: float = 30.0) -> list[str]:
    """Every placement group of job `job` but `kept` removed from the connected Ray, again as new ones come, until
    none has come for `quiet_s` (at most `timeout_s`); the hex ids removed."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed: list[str] = []
    quiet_since, deadline = None, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = sorted(job_placement_groups(job) - kept - set(removed))
        for pg in left:
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg)))
            except Exception:  # noqa: BLE001 -- removed meanwhile by Ray (its creator died); the next pass looks again
                continue
            removed.append(pg)
        now = time.monotonic()
        if left:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            break
        time.sleep(0.2)
    return removed


def release_ended_job(gcs_address: str, job: str) -> list[str]:
    """After a Ctrl+C'd sweep's driver left a Ray that outlives it: joins that Ray again for a moment and removes
    any placement group its ended job still holds (`release_placement_groups`).

    Ending the job is what ends the trials all at once, so their MLflow runs stay RUNNING for the sweep to mark
    KILLED (removing their groups first, while the job lived, let a trial see its Train run fail and mark its run
    FAILED). But the end of a job is a race in Ray: a Train controller restarting its worker group as the job ended
    registered a new group 0.2 s after the GCS had removed the job's, and nothing ever removed it (2026-11-30,
    docs/tests.md). It held its bundle's CPUs; a GPU, on a one-GPU machine, and every later run there would wait
    for it. Best effort: a Ray that cannot be joined again is left as it is."""
    import logging

    import ray

    try:
        ray.init(address=gcs_address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception:  # noqa: BLE001 -- the sweep is already interrupted; its own line says so
        return []
    try:
        return release_placement_groups(job)
    finally:
        ray.shutdown()


def _kill_running_children(parent, sweep_name: str) -> None:
    """After a Ctrl+C: the sweep's child runs still RUNNING are marked KILLED (finished and failed trials keep
    theirs)."""
    if parent.run_id is None:
        return
    for run in parent.client.search_runs([parent.experiment_id], f"tags.`{TAG_SWEEP}` = '{sweep_name}'"):
        if run.info.run_id != parent.run_id and run.info.status == "RUNNING":
            parent.client.set_terminated(run.info.run_id, "KILLED")


def is_source_loss(key: str) -> bool:
    """val/<source>/loss: a mixture source's validation loss (a column of the sweep table)."""
    return key.startswith("val/") and key.endswith("/loss") and key.count("/") == 2


def _check_named_mixtures(cfg: Config, space: Space, dataset: str) -> None:
    """MixtureError (one line) when a named mixture of the space would need more of a source than it may repeat."""
    from pipeline.data.mixture import check_plan, fitted_block_rows, mixture_of
    from pipeline.train.session.mixture_run import rows_per_step

    for name, mixture in space.mixtures().items():
        trial = with_token_budget(cfg.replace({"data.mixture": mixture}), space.token_budget)
        steps, per_step = trial.train.max_steps, rows_per_step(trial)
        # the block the trial will train with (pipeline/train/session/mixture_run.py record_data)
        trial = trial.replace({"data.mixture_block_rows": fitted_block_rows(trial.data.mixture_block_rows,
                                                                             steps * per_step)})
        mix = mixture_of(dataset, trial)
        try:
            check_plan(mix.plan(steps * per_step), steps, per_step, mix.seq_len)
        except ValueError as exc:
            raise type(exc)(f"search space {space.path.name}, mixture {name!r}: {exc}") from None


def _report(cfg: Config, space: Space, rows: list[TrialRow], sweep_dir: Path, name: str, parent) -> SweepResult:
    title = f"sweep {name} ({space.path.name}): {space.metric}, {space.mode}"
    md = write_markdown(rows, space.metric, sweep_dir / "sweep_table.md", title=title)
    x_key = "train.batch_size" if "train.batch_size" in space.params else next(iter(space.params))
    png = plot_sweep(rows, sweep_dir / "sweep_table.png", space.metric, x_key=x_key, title=title)
    best = best_row(rows, space.mode)
    preset = None
    if best is not None:
        best_cfg = with_token_budget(cfg.replace(resolved(best.params, cfg.flat(), space.mixtures())),
                                     space.token_budget)
        preset = write_best_preset(best_cfg.flat(), Config().flat(), sweep_dir / "best_preset.yaml", sweep=name,
                                   row=best, metric=space.metric)
    for path in (md, png) + ((preset,) if preset else ()):
        parent.log_artifact(path)
    counts = {s: sum(r.status == s for r in rows) for s in (OK, OOM, STOPPED, FAILED)}
    parent.log_metrics({"sweep/trials": len(rows), **{f"sweep/trials_{s}": n for s, n in counts.items()},
                        **({"sweep/best_metric": best.metric_value} if best else {})}, step=0)
    return SweepResult(name, sweep_dir, rows, best, preset, parent.run_id, md, png)


def tune_main(cfg: Config, space_path: str | None) -> int:
    """`python pipeline/run.py tune --space FILE`: run the sweep, print the table; 0 if any trial finished."""
    if not space_path:
        found = sorted(str(p) for p in Path("tune_spaces").glob("*.yaml")) if Path("tune_spaces").is_dir() else []
        raise SpaceError("tune needs --space FILE" + (f"; for example: {', '.join(found)}" if found else ""))
    stage("tune", f"sweep {space_path}")
    result = run_sweep(cfg, space_path, command=True)
    stage("tune", "results")
    print(markdown_table(result.rows, load_space(space_path, cfg).metric))
    print(f"table: {result.table_md}\nchart: {result.table_png}")
    if result.best is None:
        print("no trial finished; nothing to recommend")
        return 1
    print(f"best: trial {result.best.trial_id} {result.best.params} -> {result.best.metric_value:.4f}\n"
          f"preset: {result.best_preset}\ntrain with it: python pipeline/run.py train --preset {result.best_preset}")
    return 0
