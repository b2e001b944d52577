"""The long-context pictures: loss by position in the document and the passkey heatmap, as MLflow artifacts.

    log_position_plot(client, run_id)              # every <prefix>/pos_loss/* history of the run -> position_loss.png
    plot_position_loss(lines, "position_loss.png")
    plot_passkey_heatmap(grid, "passkey_heatmap.png")   # grid: pipeline/eval/passkey.py PasskeyGrid.to_dict()

position_loss.png has two panels, both with a log x axis: the mean loss of each position bucket drawn at the
bucket's geometric middle (`<prefix>/pos_loss/<lo>-<hi>`), and the cumulative-mean perplexity at each context length
(`<prefix>/cum_ppl/<L>`). One line per evaluation step of training (`val/...`, coloured from early to late) and
one per eval-stage measurement (`eval/...` at the trained length, `eval_2x/...` on rows twice as long, dashed).
The figure is redrawn from the run's metric history whenever a new evaluation lands, so it always shows every
step, across restarts too, and two runs' plots compare side by side in the MLflow UI's artifact view.

matplotlib drives the Agg renderer through a standalone Figure (no pyplot state, no display); files appear
atomically. Nothing here imports MLflow: callers pass an MlflowClient.
"""
from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POSITION_PLOT = "position_loss.png"
PASSKEY_HEATMAP = "passkey_heatmap.png"
PASSKEY_GRID = "passkey_grid.json"
_POS = re.compile(r"^(?P<prefix>[\w]+)/pos_loss/(?P<lo>\d+)-(?P<hi>\d+)$")
_CUM = re.compile(r"^(?P<prefix>[\w]+)/cum_ppl/(?P<length>\d+)$")


@dataclass
class PositionLine:
    label: str
    prefix: str  # val | eval | eval_<k>x
    step: int
    buckets: list[tuple[int, int, float]] = field(default_factory=list)  # (lo, hi, mean loss)
    cumulative: list[tuple[int, float]] = field(default_factory=list)  # (context length, perplexity)


def _label(prefix: str, step: int) -> str:
    if prefix == "val":
        return f"step {step}"
    if prefix == "eval":
        return f"eval, step {step}"
    return f"eval {prefix.split('_', 1)[-1]} rows, step {step}"


def position_lines(histories: dict[str, list[tuple[int, float]]]) -> list[PositionLine]:
    """Lines from metric histories {name: [(step, value), ...]}: one per (prefix, step), val lines by step first."""
    lines: dict[tuple[str, int], PositionLine] = {}
    for name, points in histories.items():
        pos, cum = _POS.match(name), _CUM.match(name)
        if not (pos or cum):
            continue
        prefix = (pos or cum)["prefix"]
        for step, value in points:
            if not math.isfinite(value):
                continue
            line = lines.setdefault((prefix, step), PositionLine(_label(prefix, step), prefix, step))
            if pos:
                line.buckets.append((int(pos["lo"]), int(pos["hi"]), value))
            else:
                line.cumulative.append((int(cum["length"]), value))
    for line in lines.values():
        line.buckets.sort()
        line.cumulative.sort()
    return sorted(lines.values(), key=lambda ln: (ln.prefix != "val", ln.prefix, ln.step))


def _save(fig, out_path: str | Path) -> Path:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=out.suffix or ".png")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=(out.suffix.lstrip(".") or "png"))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def plot_position_loss(lines: list[PositionLine], out_path: str | Path, title: str | None = None) -> Path:
    """Write position_loss.png (module docstring) for `lines`; returns its path."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(11, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_pos, ax_cum = fig.subplots(1, 2)
    if title:
        fig.suptitle(title)
    val = [ln for ln in lines if ln.prefix == "val"]
    cmap = colormaps["viridis"]
    for ln in lines:
        if ln.prefix == "val":
            i = val.index(ln)
            style = {"color": cmap(i / max(1, len(val) - 1) * 0.9), "linestyle": "-", "marker": "o"}
        else:
            style = {"linestyle": "--", "marker": "s", "linewidth": 2}
        if ln.buckets:
            xs = [math.sqrt(lo * hi) for lo, hi, _ in ln.buckets]
            ax_pos.plot(xs, [v for *_, v in ln.buckets], label=ln.label, markersize=4, **style)
        if ln.cumulative:
            ax_cum.plot([x for x, _ in ln.cumulative], [v for _, v in ln.cumulative], label=ln.label,
                        markersize=3, **style)
    for ax, ylabel, name in ((ax_pos, "mean loss (nats/token)", "loss by position in the document"),
                             (ax_cum, "perplexity of positions 1..L", "cumulative-mean perplexity")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))  # 1,024 rather than 2^10
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(alpha=0.3, which="both")
        if ax.lines:
            ax.legend(fontsize=7, ncol=1 + len(ax.lines) // 12)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
    ax_pos.set_xlabel("position in the document (tokens of context; bucket middles)")
    ax_cum.set_xlabel("context length L (tokens)")
    return _save(fig, out_path)


def run_position_lines(client, run_id: str) -> list[PositionLine]:
    """The position lines of an MLflow run, from the full history of each of its pos_loss and cum_ppl metrics."""
    names = [k for k in client.get_run(run_id).data.metrics if _POS.match(k) or _CUM.match(k)]
    return position_lines({k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in names})


def log_position_plot(client, run_id: str, title: str | None = None) -> bool:
    """Redraw position_loss.png from the run's metric history and log it as the run's artifact (replacing the last
    one); False when the run has no position metrics yet."""
    lines = run_position_lines(client, run_id)
    if not lines:
        return False
    with tempfile.TemporaryDirectory(prefix="longtrain-pos-") as tmp:
        png = plot_position_loss(lines, Path(tmp) / POSITION_PLOT, title=title)
        client.log_artifact(run_id, str(png))
    return True


def plot_passkey_heatmap(grid: dict[str, Any], out_path: str | Path, title: str | None = None) -> Path:
    """Write the passkey accuracy heatmap: rows = prompt length (tokens), columns = depth of the key, colour and
    number = share of keys retrieved exactly; a line marks the trained length when `grid` names it."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    acc = np.asarray(grid["accuracy"], dtype=float)
    lengths, depths = grid["lengths"], grid["depths"]
    fig = Figure(figsize=(1.6 + 1.0 * len(depths), 1.4 + 0.45 * len(lengths)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_yticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    trained = grid.get("trained_len")
    if trained and any(n > trained for n in lengths) and any(n <= trained for n in lengths):
        ax.axhline(sum(n <= trained for n in lengths) - 0.5, color="black", linewidth=2)
        ax.text(len(depths) - 0.5, sum(n <= trained for n in lengths) - 0.5, " trained length ", ha="right",
                va="bottom", fontsize=7)
    ax.set_xlabel("depth of the key in the prompt")
    ax.set_ylabel("prompt length (tokens)")
    ax.set_title(title or f"passkey retrieval, {grid.get('trials', '?')} keys per cell (greedy)", fontsize=9)
    fig.colorbar(image, ax=ax, label="exact-key accuracy")
    return _save(fig, out_path)
