"""Downstream tasks scored on the checkpoints while the run trains (eval.tasks; docs/evaluation.md).

Under Ray Train each reported checkpoint (every eval.every_checkpoints-th, and the last) is scored by Ray Train's
validation hook: `ray.train.report(..., validation=True)` makes its controller run `score_reported_checkpoint` as a
Ray task with its own resources (eval.cpus, eval.gpus) while the workers go on training; one at a time, the next
checkpoint's waiting its turn, and the run's end waits for the last. The task loads the checkpoint on one process
(any layout: FSDP shards are consolidated, a context-parallel run's rows are scored whole), scores the tasks with
lm-evaluation-harness (pipeline/eval/harness_tasks.py), and logs eval/<task>/<metric> at the checkpoint's step, the
tags and the picture to the training run's MLflow run. A task that fails is one console line and a FAILED tag; the
task never raises for it, and training never waits for it.

A --no-ray run (pipeline/train/local.py) scores in its own process at each due checkpoint, between steps: the steps
wait for it there (no second process to run it beside them).

    validation = validation_config(cfg, lc)            # for the trainer, or None when eval.tasks is empty
    due = ScoringSchedule(cfg)                         # every worker, at every checkpoint: due.next(last)
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from pipeline.config import Config, from_flat


def scoring_wanted(cfg: Config) -> bool:
    return bool(cfg.eval.tasks.strip())


def check_scoring(cfg: Config, say: Callable[[str], None] = print) -> bool:
    """Before training, on the driver: whether the checkpoints will be scored. Without lm-eval installed, one line
    naming the extra and False (training goes on unscored); a task YAML path that does not exist is a TaskError."""
    if not scoring_wanted(cfg):
        return False
    from pipeline.eval.harness_tasks import EXTRA_LINE, harness_installed, resolve_tasks
    from pipeline.eval.builtin_tasks import BUILTIN_TASKS
    from pipeline.config import eval_task_names

    if not harness_installed():
        say(f"eval: {EXTRA_LINE}; training goes on without scoring eval.tasks={cfg.eval.tasks}")
        return False
    names = [n for n in eval_task_names(cfg.eval.tasks) if n not in BUILTIN_TASKS]
    resolve_tasks(",".join(names))  # a missing or nameless YAML: one line now, not at the first checkpoint
    return True


class ScoringSchedule:
    """Which checkpoints are scored: every eval.every_checkpoints-th of this fit, and the last. Every worker keeps
    one (they report the same checkpoints in the same order)."""

    def __init__(self, cfg: Config) -> None:
        self.every = cfg.eval.every_checkpoints
        self.count = 0

    def next(self, last: bool) -> bool:
        self.count += 1
        return last or self.count % self.every == 0


def gpu_share(cfg: Config) -> float | None:
    """With a fraction of a GPU for the scoring task (0 < eval.gpus < 1), what each GPU worker asks for instead of a
    whole one (1 - eval.gpus): on a one-GPU machine the scoring task then shares the worker's GPU (CUDA time-slices
    the two processes) instead of waiting for the run's end. None otherwise."""
    g = cfg.eval.gpus
    return 1.0 - g if scoring_wanted(cfg) and 0 < g < 1 else None


def validation_config(cfg: Config, lc: dict[str, Any]):
    """Ray Train's ValidationConfig running score_reported_checkpoint with eval.cpus / eval.gpus, or None."""
    if not lc.get("score_tasks"):
        return None
    from ray.train.v2.api.validation_config import ValidationConfig, ValidationTaskConfig

    kwargs = {"config": cfg.flat(), "dataset_dir": lc["dataset_dir"], "ray_storage": lc["ray_storage"],
              "mlflow_run_id": lc.get("mlflow_run_id"), "manifest": lc["manifest"]}
    # Outside any placement group (the run's end waits for its scoring, so the scoring must never wait for the run's
    # own reservation). In a sweep's trial it reserves no CPU: trials that filled the cluster would otherwise each
    # wait at their end for a scoring task that cannot start.
    cpus = 0 if lc.get("required_metric") else cfg.eval.cpus
    return ValidationConfig(fn=score_reported_checkpoint,
                            task_config=ValidationTaskConfig(fn_kwargs=kwargs, timeout_s=cfg.eval.timeout_s or None),
                            ray_remote_kwargs={"num_cpus": cpus, "num_gpus": cfg.eval.gpus, "max_retries": 0,
                                               "scheduling_strategy": "DEFAULT"})


def score_reported_checkpoint(checkpoint, *, config: dict[str, Any], dataset_dir: str, ray_storage: str,
                              mlflow_run_id: str | None, manifest: dict[str, Any]) -> dict[str, float]:
    """Ray Train's validation function (a Ray task): score Ray's `checkpoint` on eval.tasks and log the results to
    the run; returns the metrics (Ray adds them to the checkpoint's). Never raises for a task or a model that fails:
    those are FAILED marks and one line each."""
    from pipeline.console import worker_print
    from pipeline.storage import location_of

    cfg = from_flat(config)
    location = location_of(checkpoint.filesystem, checkpoint.path, ray_storage)
    report = score_checkpoint(location, cfg, dataset_dir, mlflow_run_id, manifest=manifest, say=worker_print)
    return report.metrics()


def score_checkpoint(location: str | Path, cfg: Config, dataset_dir: str, mlflow_run_id: str | None, *,
                     manifest: dict[str, Any] | None = None, say: Callable[[str], None] = print):
    """Load the checkpoint at `location` and score it (score_loaded); a checkpoint that does not load fails every
    task with its one line. Returns the TaskReport."""
    from pipeline.eval.harness_tasks import failed_report
    from pipeline.storage import local_copy
    from pipeline.train.handoff.loaded_checkpoint import load_for_eval

    try:
        with local_copy(location) as local:
            loaded = load_for_eval(local, dataset_dir)
    except Exception as exc:  # noqa: BLE001 -- the run goes on; the tasks say why they have no score
        step = _step_of(location)
        report = failed_report(cfg.eval.tasks, step, f"the checkpoint did not load: {str(exc).splitlines()[0]}")
        say(f"eval: checkpoint {location} not scored: {str(exc).splitlines()[0]}")
        _log(report, cfg, mlflow_run_id, say)
        return report
    return score_loaded(loaded.engine.module.decoder, cfg, loaded.dataset_dir, loaded.manifest, loaded.step,
                        mlflow_run_id, say=say)


def score_loaded(decoder, cfg: Config, dataset_dir: str | Path, manifest, step: int, mlflow_run_id: str | None,
                 *, say: Callable[[str], None] = print):
    """Score `decoder` (weights loaded) on cfg.eval's tasks at `step`, print one line, log to the run."""
    from pipeline.data.shards import dataset_tokenizer
    from pipeline.eval.harness_model import LongtrainLM
    from pipeline.eval.harness_tasks import failed_report, resolve_tasks, score_tasks, summary_line

    start = time.perf_counter()
    try:
        tokenizer = dataset_tokenizer(dataset_dir, manifest=manifest)
        specs = resolve_tasks(cfg.eval.tasks, dataset_dir, manifest, tokenizer)
        lm = LongtrainLM(decoder, tokenizer, cfg.data.seq_len)
        report = score_tasks(lm, specs, num_fewshot=cfg.eval.num_fewshot, limit=cfg.eval.limit, step=step, echo=say)
    except Exception as exc:  # noqa: BLE001 -- a task set that cannot start: every task FAILED, training goes on
        report = failed_report(cfg.eval.tasks, step, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        say(f"eval: tasks at step {step} not scored: {report.results[0].failed if report.results else exc}")
    say(summary_line(report, time.perf_counter() - start))
    _log(report, cfg, mlflow_run_id, say)
    return report


def _log(report, cfg: Config, mlflow_run_id: str | None, say: Callable[[str], None]) -> None:
    if not (mlflow_run_id and cfg.tracking.enabled):
        return
    from pipeline.eval.harness_tasks import log_task_report
    from pipeline.tracking.tracker import resolve_tracking_uri

    try:
        log_task_report(report, resolve_tracking_uri(cfg), mlflow_run_id,
                        title=f"{cfg.run.name or cfg.model.tier} {cfg.model.mixer}: downstream tasks")
    except Exception as exc:  # noqa: BLE001 -- the scores were printed; a store that is busy or down loses the log
        say(f"eval: task scores at step {report.step} not logged to MLflow: {str(exc).splitlines()[0]}")


def _step_of(location: str | Path) -> int:
    from pipeline.train.checkpoints.index import step_of

    try:
        return int(step_of(str(location)) or 0)
    except Exception:  # noqa: BLE001 -- a checkpoint that does not load may not say its step either
        return 0
