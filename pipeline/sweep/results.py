"""From Tune's results to what a sweep leaves behind: one row per trial (`rows_of`), then the table as markdown and
PNG, the best trial's config as a preset and the counts, logged to the sweep's parent MLflow run (`report_sweep`;
the writers are pipeline/sweep/report.py's).

    rows = rows_of(tuner.fit(), space, cfg)
    result = report_sweep(cfg, space, rows, sweep_dir, name, parent)     # SweepResult
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import Config
from pipeline.sweep.report import (FAILED, OK, OOM, STOPPED, TrialRow, best_row, plot_sweep, write_best_preset,
                                   write_markdown)
from pipeline.sweep.space import Space
from pipeline.sweep.trial import REASON_KEY, RUN_ID_KEY, STATUS_KEY, resolved, with_token_budget
from pipeline.sweep.trial_failure import failure_reason, is_oom
from pipeline.tracking.names import (LOSS, SWEEP_BEST_METRIC, SWEEP_TRIALS, TRAIN_PEAK_MEM_GIB, TRAIN_STEADY_MFU,
                                     TRAIN_STEADY_STEPS, TRAIN_STEADY_TOKENS_PER_S, TRAIN_TOKENS_SEEN, VAL,
                                     split_metric, sweep_trials_with)


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


def is_source_loss(key: str) -> bool:
    """val/<source>/loss: a mixture source's validation loss (a column of the sweep table)."""
    parts = key.split("/")
    return len(parts) == 3 and key == split_metric(VAL, LOSS, parts[1])


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


def rows_of(grid, space: Space, base: Config) -> list[TrialRow]:
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
            reason = OOM if is_oom(result.error) else failure_reason(result.error)
            status = OOM if reason == OOM else FAILED
        if status == STOPPED:
            reason = "early, by the scheduler"
        total, active = _sizes(base, full)
        rows.append(TrialRow(
            trial_id=str(last.get("trial_id") or Path(result.path).name), params=params,
            params_total=total, params_active=active,
            tier=str(params.get("model.tier", base.model.tier)),
            batch_size=int(params.get("train.batch_size", base.train.batch_size)),
            tokens_per_s=last.get(TRAIN_STEADY_TOKENS_PER_S), peak_mem_gib=last.get(TRAIN_PEAK_MEM_GIB),
            metric_value=last.get(space.metric), status=status, reason=str(reason or ""),
            mlflow_run_id=last.get(RUN_ID_KEY) or None, steps=last.get("step"),
            tokens_seen=last.get(TRAIN_TOKENS_SEEN), mfu=last.get(TRAIN_STEADY_MFU),
            steady_steps=last.get(TRAIN_STEADY_STEPS),
            extra={k: v for k, v in last.items() if is_source_loss(k)}))  # a mixture: each source's val loss
    return rows


def add_task_scores(rows: list[TrialRow], metric: str, tracking_uri: str) -> None:
    """Each trial's latest value of downstream-task metric `metric` (eval/<task>/<metric>), read from its MLflow run
    into row.extra (a table column): Ray Train's validation hook logs it there, not in the trial's reports."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for r in rows:
        if not r.mlflow_run_id:
            continue
        history = client.get_metric_history(r.mlflow_run_id, metric)
        if history:
            r.extra[metric] = max(history, key=lambda m: (m.step, m.timestamp)).value


def best_by_task(rows: list[TrialRow], metric: str, mode: str) -> TrialRow | None:
    """The finished trial with the best finite `metric` in its extra (add_task_scores), or None."""
    done = [r for r in rows if r.status == OK and isinstance(r.extra.get(metric), (int, float))
            and math.isfinite(r.extra[metric])]
    return (min if mode == "min" else max)(done, key=lambda r: r.extra[metric]) if done else None


def report_sweep(cfg: Config, space: Space, rows: list[TrialRow], sweep_dir: Path, name: str, parent) -> SweepResult:
    if space.rank_by:  # ranked by a downstream task: its scores from the trials' MLflow runs
        from pipeline.tracking.tracker import resolve_tracking_uri

        add_task_scores(rows, space.rank_by, resolve_tracking_uri(cfg))
    title = f"sweep {name} ({space.path.name}): {space.metric}, {space.mode}" + (
        f"; ranked by {space.rank_by}, {space.rank_mode}" if space.rank_by else "")
    md = write_markdown(rows, space.metric, sweep_dir / "sweep_table.md", title=title)
    x_key = "train.batch_size" if "train.batch_size" in space.params else next(iter(space.params))
    png = plot_sweep(rows, sweep_dir / "sweep_table.png", space.metric, x_key=x_key, title=title)
    best = best_by_task(rows, space.rank_by, space.rank_mode) if space.rank_by else best_row(rows, space.mode)
    preset = None
    if best is not None:
        best_cfg = with_token_budget(cfg.replace(resolved(best.params, cfg.flat(), space.mixtures())),
                                     space.token_budget)
        preset = write_best_preset(best_cfg.flat(), Config().flat(), sweep_dir / "best_preset.yaml", sweep=name,
                                   row=best, metric=space.metric)
    for path in (md, png) + ((preset,) if preset else ()):
        parent.log_artifact(path)
    counts = {s: sum(r.status == s for r in rows) for s in (OK, OOM, STOPPED, FAILED)}
    parent.log_metrics({SWEEP_TRIALS: len(rows), **{sweep_trials_with(s): n for s, n in counts.items()},
                        **({SWEEP_BEST_METRIC: best.metric_value} if best else {})}, step=0)
    return SweepResult(name, sweep_dir, rows, best, preset, parent.run_id, md, png)
