"""Ray Tune sweeps over the one trainer, tracked as one MLflow parent run with a child run per trial: the driver.

    python pipeline/run.py tune --space tune_spaces/bs_tier.yaml --preset gpu      # pipeline/cli/tune.py
    ray job submit --working-dir . -- python pipeline/run.py tune --space tune_spaces/lr.yaml --address auto
    result = run_sweep(cfg, "tune_spaces/lr.yaml")                                  # SweepResult

How it runs (the Ray Train V2 way of running Train inside Tune): the data is prepared once, then every Tune trial is
a small function (pipeline/sweep/trial.py `run_trial`, ~0 CPU) that builds the trial's config from the space's field
paths, opens its MLflow child run, and calls pipeline/train/ray_train.py's `run_training` -- the same TorchTrainer,
workers, engine and metric names as a single run -- with Ray Train's `TuneReportCallback`. ASHA then compares trials
on the sweep's metric over tokens seen (`train/tokens_seen`), so different batch sizes are compared at equal tokens,
not equal steps. With `skip_unfit_batch: true` the largest micro-batch of each tier is found first
(pipeline/sweep/batch_fit.py) and batch sizes above it are recorded as `oom` without being run.

No trial can end the sweep: a trial's failure is recorded on the trial alone (pipeline/sweep/trial.py), and Tune
carries on with the others.

Figures: the table's tokens/s and MFU are steady state (train/steady_tokens_per_s, train/steady_mfu): each trial's
optimizer steps after its first three (torch.compile, warm-up) up to its last report, timed inside the steps; the
table says which steps. Peak memory is the trial's peak, the largest on any of its workers.

Ending trials. A trial that trains its token budget ends by itself (ASHA does not stop trials at max_t:
`stop_last_trials=False`), so its Train run shuts down its workers and placement group; a trial Tune stops has its
placement group removed by the driver (pipeline/sweep/placement_groups.py), and so has a Ctrl+C'd sweep's job on a
Ray that outlives the command. A Ctrl+C raises KeyboardInterrupt here (not Tune's own handling), the child runs
still running are marked KILLED.

At the end (pipeline/sweep/results.py): the table (tier, batch size, tokens/s, MFU, peak memory, metric, status) is
logged to the parent run as markdown and PNG, and the best finished trial's config is written as a preset:
<run.root>/tune/<sweep>/best_preset.yaml, for `python pipeline/run.py train --preset <that file>`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from pipeline.config import Config
from pipeline.console import stage
from pipeline.data.mixture import inline_mixture
from pipeline.sweep.batch_fit import max_fit_per_tier
from pipeline.sweep.placement_groups import ReleaseTrialResources, release_ended_job
from pipeline.sweep.report import OK, STOPPED, TrialRow
from pipeline.sweep.results import SweepResult, report_sweep, rows_of
from pipeline.sweep.space import Space, SpaceError, load_space
from pipeline.sweep.status_lines import StatusLines
from pipeline.sweep.trial import (REASON_KEY, STATUS_KEY, TAG_REASON, TAG_STATUS, TAG_SWEEP, TAG_TRIAL, TRIAL_CPUS,
                                  SweepContext, run_trial, with_token_budget)
from pipeline.train.ray_train import START_TIMEOUT_ENV


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
        max_fit = max_fit_per_tier(cfg, space, manifest.vocab_size) if space.skip_unfit_batch else {}
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
        rows = rows_of(grid, space, cfg)
        _close_stopped_children(parent, rows, name)
        result = report_sweep(cfg, space, rows, sweep_dir, name, parent)
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


def _kill_running_children(parent, sweep_name: str) -> None:
    """After a Ctrl+C: the sweep's child runs still RUNNING are marked KILLED (finished and failed trials keep
    theirs)."""
    if parent.run_id is None:
        return
    for run in parent.client.search_runs([parent.experiment_id], f"tags.`{TAG_SWEEP}` = '{sweep_name}'"):
        if run.info.run_id != parent.run_id and run.info.status == "RUNNING":
            parent.client.set_terminated(run.info.run_id, "KILLED")


def _check_named_mixtures(cfg: Config, space: Space, dataset: str) -> None:
    """MixtureError (one line) when a named mixture of the space would need more of a source than it may repeat."""
    from pipeline.data.mixture import check_plan, fitted_block_rows, mixture_of
    from pipeline.config import rows_per_step

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
