"""The training-curve figure: loss, learning rate and throughput over a run, as one PNG artifact.

    from pipeline.tracking.curves import plot_training_curves
    plot_training_curves(history, "runs/my-run/training_curves.png")

`history` is the list of records the engine logged, one dict per logging or evaluation event, keyed by
the stable metric names of pipeline.tracking.names plus "step", e.g.
    {"step": 10, "train/loss": 4.1, "train/lr": 3e-3, "train/tokens_per_s": 9e3, "train/tokens_seen": 20480}
    {"step": 50, "val/loss": 3.9}
Missing keys, None and NaN/inf values are simply absent from the plot; a panel with nothing to draw says
"no data". `spikes` marks a run's loss-spike events on the loss-vs-step panel (pipeline/train/spike_record.py
curve_markers): a skipped or applied outlier as a cross at its step and loss, a rewind as a dashed line at its step
with an arrow back to the step it returned to. matplotlib is imported inside the function (the engine host may not
have it) and drives the Agg
renderer through a standalone Figure, so no pyplot global state or display is involved.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

from pipeline.tracking.names import TRAIN_LOSS, TRAIN_LR, TRAIN_TOKENS_PER_S, TRAIN_TOKENS_SEEN, VAL_LOSS


def _series(history: Iterable[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records holding a finite `key` and a step, sorted by step."""
    points = []
    for record in history:
        step, value = record.get("step"), record.get(key)
        if step is None or value is None:
            continue
        step, value = float(step), float(value)
        if math.isfinite(step) and math.isfinite(value):
            points.append((step, value))
    points.sort()
    return [p[0] for p in points], [p[1] for p in points]


def _tokens_at(steps: list[float], seen_steps: list[float], seen: list[float]) -> list[float]:
    """Tokens seen at each step, interpolated from the records that report train/tokens_seen
    (evaluation records usually carry only the step)."""
    import numpy as np

    if not seen_steps:
        return []
    return list(np.interp(steps, seen_steps, seen))


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")


def _mark_spikes(ax, spikes: list[Mapping[str, Any]]) -> bool:
    """Draw the loss-spike events on the loss-vs-step axes; whether there was one to draw."""
    outliers = [(float(m["step"]), float(m["loss"])) for m in spikes
                if m.get("kind") in ("skip", "applied") and m.get("loss") is not None and math.isfinite(m["loss"])]
    if outliers:
        ax.plot(*zip(*outliers), "x", color="tab:red", markersize=8, label="spike (outlier)")
    rewinds = [m for m in spikes if m.get("kind") in ("rewind", "stop")]
    for i, m in enumerate(rewinds):
        ax.axvline(float(m["step"]), color="tab:red", linestyle="--", alpha=0.6,
                   label=("rewind" if m["kind"] == "rewind" else "stop") if i == 0 else None)
        if m.get("to_step") is not None:
            ax.annotate("", xy=(float(m["to_step"]), 0.97), xytext=(float(m["step"]), 0.97),
                        xycoords=("data", "axes fraction"), arrowprops={"arrowstyle": "->", "color": "tab:red"})
    return bool(outliers or rewinds)


def plot_training_curves(history: list[dict], out_path: str | Path, title: str | None = None,
                         spikes: list[Mapping[str, Any]] | None = None) -> Path:
    """Write a 2x2 PNG: loss vs step, loss vs tokens seen, learning rate vs step, tokens/s vs step; `spikes` marked on
    the first (the module docstring says how).

    Train and validation loss share the loss panels. The file appears atomically (written to a temporary
    name in the same folder, then renamed), so a reader never sees half a PNG. Returns the path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    train_steps, train_loss = _series(history, TRAIN_LOSS)
    val_steps, val_loss = _series(history, VAL_LOSS)
    lr_steps, lr = _series(history, TRAIN_LR)
    tps_steps, tps = _series(history, TRAIN_TOKENS_PER_S)
    seen_steps, seen = _series(history, TRAIN_TOKENS_SEEN)

    fig = Figure(figsize=(11, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_step, ax_tokens), (ax_lr, ax_tps) = fig.subplots(2, 2)
    if title:
        fig.suptitle(title)

    # Loss vs step and vs tokens seen: the second one is what compares runs with different batch sizes.
    for ax, x_of in ((ax_step, lambda s: s), (ax_tokens, lambda s: _tokens_at(s, seen_steps, seen))):
        drew = False
        for steps, values, label, style in ((train_steps, train_loss, "train", "-"),
                                            (val_steps, val_loss, "val", "o-")):
            xs = x_of(steps)
            if steps and len(xs) == len(values):
                ax.plot(xs, values, style, label=label, markersize=4)
                drew = True
        if ax is ax_step and spikes:
            drew = _mark_spikes(ax, spikes) or drew
        if drew:
            ax.legend()
        else:
            _no_data(ax)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    ax_step.set_xlabel("step")
    ax_step.set_title("loss vs step")
    ax_tokens.set_xlabel("tokens seen")
    ax_tokens.set_title("loss vs tokens seen")

    for ax, steps, values, name in ((ax_lr, lr_steps, lr, "learning rate"), (ax_tps, tps_steps, tps, "tokens/s")):
        if steps:
            ax.plot(steps, values, "-")
        else:
            _no_data(ax)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.set_title(f"{name} vs step")
        ax.grid(alpha=0.3)

    fmt = out.suffix.lstrip(".").lower() or "png"
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=out.suffix or ".png")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=fmt)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
