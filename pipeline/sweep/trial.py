"""One Tune trial: the trial's config from the space's field paths, its MLflow child run, and a Ray Train run over
the one trainer (pipeline/train/ray_train.py's `run_training`, with Ray Train's `TuneReportCallback`, so every report
the workers make reaches Tune). pipeline/sweep/tune.py runs the trials.

    tune.with_parameters(run_trial, ctx=SweepContext(...))     # the Tune trainable
    cfg = trial_config(ctx, {"train.batch_size": 4}, "a1_00000")

Failures: whatever a trial raises -- its config is invalid, its dataset cannot train it, its workers cannot start,
they fail or run out of memory -- is recorded on the trial alone: status `failed` (or `oom`) and the reason
(pipeline/sweep/trial_failure.py) in the table, its MLflow child run FAILED with tag longtrain.failure_reason, and
Tune carries on with the others (TrialFailed). Every report that reaches Tune carries the sweep's metric (Tune's
strict metric check would otherwise end the whole sweep).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError, from_flat, rows_per_step
from pipeline.sweep.report import FAILED, OK, OOM
from pipeline.sweep.space import resolve_mixture
from pipeline.sweep.trial_failure import failure_reason, is_oom
from pipeline.tracking.names import (SWEEP_MLFLOW_RUN_ID, SWEEP_REASON, SWEEP_STATUS, TRAIN_PEAK_MEM_GIB,
                                     TRAIN_STEADY_MFU, TRAIN_STEADY_STEPS, TRAIN_STEADY_TOKENS_PER_S,
                                     TRAIN_TOKENS_PER_S, TRAIN_TOKENS_SEEN)

TRIAL_CPUS = 0.01  # the trial function only waits on its TorchTrainer; Tune refuses a 0-CPU trial
STATUS_KEY, REASON_KEY, RUN_ID_KEY = SWEEP_STATUS, SWEEP_REASON, SWEEP_MLFLOW_RUN_ID
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


def tokens_per_step(cfg: Config) -> int:
    return rows_per_step(cfg) * cfg.data.seq_len


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
SUMMARY_KEYS = (TRAIN_TOKENS_PER_S, TRAIN_STEADY_TOKENS_PER_S, TRAIN_STEADY_MFU, TRAIN_STEADY_STEPS,
                TRAIN_PEAK_MEM_GIB, TRAIN_TOKENS_SEEN, "step")


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
        full = failure_reason(exc, limit=250) if exc is not None else reason
        tracker.set_tags({TAG_STATUS: status, TAG_REASON: status if status == OOM else full})
        tracker.finish("FAILED")
        ray.tune.report({**summary, STATUS_KEY: status, REASON_KEY: reason})
        raise TrialFailed(f"trial {trial_id} failed: {status} ({reason})") from exc

    if invalid is not None:
        fail(FAILED, failure_reason(invalid), invalid)
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
            fail(FAILED, failure_reason(exc), exc)
    try:
        outcome = run_training(cfg, ctx.dataset_dir, run_dir, mlflow_run_id=tracker.run_id,
                               callbacks=[TuneReportCallback()], required_metric=ctx.metric)
    except Exception as exc:  # noqa: BLE001 -- every failure is recorded, then re-raised for Tune
        fail(OOM if is_oom(exc) else FAILED, failure_reason(exc), exc)
    tracker.set_tags({TAG_STATUS: OK})
    tracker.finish("FINISHED")
    last = outcome.metrics
    summary.update({k: last[k] for k in SUMMARY_KEYS if k in last})
    summary[ctx.metric] = float(last.get(ctx.metric, float("nan")))
    return summary
