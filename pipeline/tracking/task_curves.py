"""The downstream tasks' curves: each lm-evaluation-harness task's metrics over the training steps, one panel per
task, error bars of one standard error, as the run's artifact eval_tasks.png (redrawn from the run's whole history
each time a checkpoint is scored; pipeline/eval/harness_tasks.py log_task_report calls it).

    log_task_plot(MlflowClient(uri), run_id, title="nano attention")         # -> "eval_tasks.png" or None
    plot_task_curves({"builtin_cloze": {"acc": [(50, 0.31, 0.03), (100, 0.38, 0.03)]}}, "eval_tasks.png")

A task whose latest scoring FAILED says so in its panel's title (the tag longtrain.eval_task.<task>).
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

from pipeline.tracking.names import (STDERR_SUFFIX, TASK_FAILED, TASK_STATUS_TAG_PREFIX, task_metric,
                                     task_seconds, task_stderr)

TASK_CURVES = "eval_tasks.png"

Series = dict[str, dict[str, list[tuple[int, float, float | None]]]]  # task -> metric -> [(step, value, stderr)]


def plot_task_curves(series: Series, out_path: str | Path, title: str | None = None,
                     failed: dict[str, str] | None = None) -> Path:
    """A PNG with one panel per task (metrics as lines over the step, error bars of one standard error), written
    atomically. `failed`: task -> its latest FAILED line, shown in that panel's title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_path)
    tasks = sorted(set(series) | set(failed or {}))
    cols = min(3, max(1, len(tasks)))
    rows = -(-max(1, len(tasks)) // cols)
    fig = Figure(figsize=(4.6 * cols, 3.4 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, task in zip(axes, tasks):
        drew = False
        for metric, points in sorted(series.get(task, {}).items()):
            points = sorted(p for p in points if math.isfinite(p[1]))
            if not points:
                continue
            steps = [p[0] for p in points]
            values = [p[1] for p in points]
            errors = [p[2] if p[2] is not None and math.isfinite(p[2]) else 0.0 for p in points]
            ax.errorbar(steps, values, yerr=errors, marker="o", capsize=3, label=metric)
            drew = True
        note = f" ({TASK_FAILED})" if (failed or {}).get(task) else ""
        ax.set_title(f"{task}{note}", fontsize=10)
        ax.set_xlabel("step")
        if drew:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, "no score yet", ha="center", va="center", transform=ax.transAxes, color="0.5")
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".png", delete=False) as tmp:
        fig.savefig(tmp.name, format="png")
    Path(tmp.name).replace(out)
    return out


def run_task_series(client, run_id: str) -> tuple[Series, dict[str, str]]:
    """(every task's metric histories, the tasks whose latest tag says FAILED) of an MLflow run."""
    run = client.get_run(run_id)
    tags = {k[len(TASK_STATUS_TAG_PREFIX):]: v for k, v in run.data.tags.items()
            if k.startswith(TASK_STATUS_TAG_PREFIX)}
    series: Series = {}
    for task in tags:
        prefix = task_metric(task, "")
        for key in run.data.metrics:
            if (not key.startswith(prefix) or key.endswith(STDERR_SUFFIX) or "/" in key[len(prefix):]
                    or key == task_seconds(task)):
                continue
            metric = key[len(prefix):]
            errs = {m.step: m.value for m in client.get_metric_history(run_id, task_stderr(task, metric))} \
                if task_stderr(task, metric) in run.data.metrics else {}
            series.setdefault(task, {})[metric] = [(m.step, m.value, errs.get(m.step))
                                                   for m in client.get_metric_history(run_id, key)]
    failed = {t: v for t, v in tags.items() if v.startswith(TASK_FAILED)}
    return series, failed


def log_task_plot(client, run_id: str, title: str | None = None) -> str | None:
    """eval_tasks.png from the run's whole history of task metrics, logged to the run; None when it has no task."""
    series, failed = run_task_series(client, run_id)
    if not series and not failed:
        return None
    with tempfile.TemporaryDirectory(prefix="longtrain-tasks-") as tmp:
        png = plot_task_curves(series, Path(tmp) / TASK_CURVES, title=title, failed=failed)
        client.log_artifact(run_id, str(png))
    return TASK_CURVES
