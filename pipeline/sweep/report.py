"""What a sweep leaves behind: one row per trial, the table as markdown and as a PNG chart, and the best
trial's config as a preset file `python pipeline/run.py --preset` accepts. Ray-free; pipeline/sweep/results.py
fills the rows.

    rows = [TrialRow("a1_00000", {"train.batch_size": 4}, "nano", 4, 9.1e3, 0.012, 3.91, "ok", steps=32), ...]
    write_markdown(rows, "val/loss", path); plot_sweep(rows, path_png); write_best_preset(best_cfg, ...)
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Statuses a trial can end with.
OK = "ok"  # trained to the end
OOM = "oom"  # ran out of device memory (or the max-batch finder said it cannot fit: `skipped` is set)
STOPPED = "stopped"  # stopped early by the scheduler (ASHA): its metrics are from fewer tokens
FAILED = "failed"  # any other error; `reason` names it

# Config fields a preset should not pin: where this sweep ran, not how to train.
NOT_IN_PRESET = ("run.name", "run.root", "run.storage", "ray.storage_path", "ray.address", "ray.max_failures",
                 "tracking.tracking_uri", "tracking.artifact_location", "train.memory_limit_gib", "data.dataset_dir",
                 "data.dataset_store")


@dataclass
class TrialRow:
    trial_id: str
    params: dict[str, Any]  # the searched values, by field path
    tier: str
    batch_size: int
    tokens_per_s: float | None  # steady state (STEADY_NOTE)
    peak_mem_gib: float | None  # the trial's peak, the largest on any of its workers
    metric_value: float | None  # the sweep's metric (val/loss by default), last reported
    status: str  # OK | OOM | STOPPED | FAILED
    reason: str = ""  # for OOM/FAILED: what happened
    mlflow_run_id: str | None = None
    steps: int | None = None
    tokens_seen: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # a mixture: val/<source>/loss of each source (table columns)
    mfu: float | None = None  # steady state, where the device's peak is known
    steady_steps: int | None = None  # how many of the trial's last steps tokens/s and MFU are over
    params_total: int | None = None  # the model's parameters (MLflow param model.params)
    params_active: int | None = None  # those one token uses (model.active_params; fewer for a mixture of experts)

    @property
    def status_text(self) -> str:
        return f"{self.status} ({self.reason})" if self.reason else self.status

    @property
    def timed_steps(self) -> str:
        """`4–32`: the steps the steady-state figures are over (the last `steady_steps` up to `steps`)."""
        if not self.steady_steps or not self.steps:
            return "–"
        last = int(self.steps)
        return f"{last - int(self.steady_steps) + 1}–{last}"


STEADY_NOTE = ("tokens/s and MFU are steady state: each trial's optimizer steps after its first 3 (torch.compile and "
               "warm-up) up to its last report, timed inside the steps (data waits, evaluation and checkpoints not "
               "counted); `timed steps` names them. Peak memory is the trial's peak on any of its workers.")


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, int) and not isinstance(value, bool) and spec == ".4g":
        return str(value)  # a searched int (a worker count, a step interval) as written, not 1e+05
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def best_row(rows: list[TrialRow], mode: str) -> TrialRow | None:
    """The finished trial with the best finite metric value (min or max)."""
    done = [r for r in rows if r.status == OK and r.metric_value is not None and math.isfinite(r.metric_value)]
    if not done:
        return None
    return (min if mode == "min" else max)(done, key=lambda r: r.metric_value)


def markdown_table(rows: list[TrialRow], metric: str) -> str:
    """tier | batch size | <other searched params> | [params | active params] | tokens/s | MFU | timed steps | peak
    memory | <metric> | <each mixture source's val/<source>/loss> | status | trial, then STEADY_NOTE. The parameter
    columns appear when a trial is a mixture of experts (its active parameters fewer than its total)."""
    others = sorted({k for r in rows for k in r.params} - {"model.tier", "train.batch_size"})
    sources = list(dict.fromkeys(k for r in rows for k in r.extra))  # in the order the trials reported them
    sizes = any(r.params_active is not None and r.params_active != r.params_total for r in rows)
    head = ["tier", "batch size", *others, *(["params", "active params"] if sizes else []), "tokens/s", "MFU",
            "timed steps", "peak memory (GiB)", metric, *sources, "status", "trial"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    order = sorted(rows, key=lambda r: (r.tier, r.batch_size, r.trial_id))
    for r in order:
        cells = [r.tier, str(r.batch_size), *(_fmt(r.params.get(k)) for k in others),
                 *([_fmt(r.params_total, ","), _fmt(r.params_active, ",")] if sizes else []),
                 _fmt(r.tokens_per_s, ",.0f"),
                 _fmt(r.mfu, ".1%"), r.timed_steps, _fmt(r.peak_mem_gib or None, ".3f"),  # 0: not counted (CPU)
                 _fmt(r.metric_value, ".4f"), *(_fmt(r.extra.get(k), ".4f") for k in sources),
                 r.status_text, r.trial_id]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + STEADY_NOTE + "\n"


def _atomic_write(path: Path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_markdown(rows: list[TrialRow], metric: str, path: str | Path, title: str = "") -> Path:
    text = (f"# {title}\n\n" if title else "") + markdown_table(rows, metric)
    return _atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text))


def plot_sweep(rows: list[TrialRow], path: str | Path, metric: str, x_key: str = "train.batch_size",
               title: str = "") -> Path:
    """Two panels against `x_key` (batch size by default), one line per tier: tokens/s and the metric.
    Trials that ran out of memory are red crosses on the x axis; failed ones grey crosses."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def raw_x(r: TrialRow) -> Any:
        return r.batch_size if x_key == "train.batch_size" else r.params.get(x_key, float("nan"))

    # a searched string (model.mixer, model.tier) goes on a categorical axis: one tick per value
    categories = sorted({str(raw_x(r)) for r in rows if isinstance(raw_x(r), str)})

    def x_of(r: TrialRow) -> float:
        return float(categories.index(str(raw_x(r)))) if categories else float(raw_x(r))

    def finite(v: Any) -> bool:
        return v is not None and math.isfinite(v)

    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    panels = [("tokens/s", lambda r: r.tokens_per_s), (metric, lambda r: r.metric_value)]
    tiers = sorted({r.tier for r in rows})
    all_x = sorted({x_of(r) for r in rows if finite(x_of(r))})
    log_x = x_key in ("train.batch_size", "train.lr") and all_x and all_x[0] > 0
    for i, (label, get) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        for tier in tiers:
            pts = sorted((x_of(r), get(r)) for r in rows if r.tier == tier and r.status == OK and finite(get(r)))
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"tier {tier}")
            stopped = [(x_of(r), get(r)) for r in rows if r.tier == tier and r.status == STOPPED and finite(get(r))]
            if stopped:  # hollow: measured on fewer tokens than the finished trials
                ax.scatter([p[0] for p in stopped], [p[1] for p in stopped], facecolors="none", s=50,
                           edgecolors=line[0].get_color(), label=f"tier {tier}, stopped early")
        for status, color in ((OOM, "tab:red"), (FAILED, "tab:gray")):
            xs = [x_of(r) for r in rows if r.status == status]
            if xs:  # at the bottom of the panel, whatever the y range
                ax.scatter(xs, [0.03] * len(xs), marker="x", color=color, s=70, label=status, zorder=3,
                           transform=ax.get_xaxis_transform(), clip_on=False)
        if all_x:
            lo, hi = all_x[0], all_x[-1]
            pad = (hi / lo) ** 0.08 if log_x and hi > lo else 1.3
            ax.set_xlim(*((lo / pad, hi * pad) if log_x else (lo - 0.1 * (hi - lo + 1), hi + 0.1 * (hi - lo + 1))))
        if categories:
            ax.set_xticks(range(len(categories)), categories)
        if log_x:
            ax.set_xscale("log")
            if x_key == "train.batch_size":
                ax.set_xticks(all_x, [f"{x:g}" for x in all_x])
                ax.minorticks_off()
        ax.set_xlabel(x_key)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png"))


def preset_tree(flat: dict[str, Any], defaults: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The nested preset: every field that differs from the defaults, minus where-it-ran fields."""
    tree: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key in NOT_IN_PRESET or defaults.get(key) == value:
            continue
        section, name = key.split(".", 1)
        if key == "data.mixture" and value.lstrip().startswith("["):  # the sources as a YAML list, to read and edit
            import json

            value = json.loads(value)
        tree.setdefault(section, {})[name] = value
    return tree


def write_best_preset(best_flat: dict[str, Any], defaults: dict[str, Any], path: str | Path, *, sweep: str,
                      row: TrialRow, metric: str) -> Path:
    """A YAML preset (nested config tree) that `python pipeline/run.py train --preset PATH` loads."""
    import yaml

    header = (f"# Best trial of sweep {sweep}: {metric}={row.metric_value:.4f} (trial {row.trial_id}"
              f"{', MLflow run ' + row.mlflow_run_id if row.mlflow_run_id else ''}).\n"
              f"# Searched: {', '.join(f'{k}={v}' for k, v in sorted(row.params.items()))}\n"
              f"# Train with it:  python pipeline/run.py train --preset {path}\n")
    body = yaml.safe_dump(preset_tree(best_flat, defaults), sort_keys=True, default_flow_style=False)
    return _atomic_write(Path(path), lambda tmp: Path(tmp).write_text(header + body))
