"""The picture of a mixture of experts' load: every expert of every MoE layer over the training steps.

    plot_expert_load(history, layers, "expert_load.png")   # history: MoEBalance.history [(step, [[fraction]])]
    tracker.log_expert_load(history, layers, title)         # the png and its numbers (expert_load.json), to MLflow

One heatmap panel per MoE layer: experts down, logging steps across, each cell the expert's share of the layer's
assignments over that logging window times E (1 = its even share; the colour scale is centred on 1, blue under,
red over, clipped at 0 and 2), so a collapsing router shows as a few red rows and many blue ones, and balancing as
the picture turning white. The numbers go beside it as JSON ({"steps": [...], "layers": [...], "load": [step][layer]
[expert]}), so runs compare in a notebook too. matplotlib's Agg renderer on a standalone Figure, written atomically
(as pipeline/tracking/long_context_plots.py); nothing here imports MLflow.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

EXPERT_LOAD_PLOT = "expert_load.png"
EXPERT_LOAD_DATA = "expert_load.json"


def _atomic_write(out: Path, write) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=out.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def load_table(history: list[tuple[int, list[list[float]]]], layers: list[int]) -> dict:
    """The JSON beside the picture: steps, the MoE layers' block indices, load[step][layer][expert] (fractions)."""
    return {"steps": [step for step, _ in history], "layers": list(layers), "load": [f for _, f in history]}


def plot_expert_load(history: list[tuple[int, list[list[float]]]], layers: list[int], out_path: str | Path,
                     title: str | None = None) -> Path:
    """Draw the heatmaps (module docstring) of `history` ([(step, fractions per layer per expert)]) to out_path."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    if not history:
        raise ValueError("no expert load to draw: the history is empty")
    steps = [step for step, _ in history]
    n_layers = len(history[0][1])
    E = len(history[0][1][0])
    cols = min(n_layers, 4)
    rows = math.ceil(n_layers / cols)
    fig = Figure(figsize=(3.2 * cols + 1.2, 2.6 * rows + 0.6), constrained_layout=True)
    axes = fig.subplots(rows, cols, squeeze=False)
    norm = TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=2.0)
    image = None
    for i in range(rows * cols):
        ax = axes[i // cols][i % cols]
        if i >= n_layers:
            ax.set_axis_off()
            continue
        grid = [[min(2.0, history[t][1][i][e] * E) for t in range(len(history))] for e in range(E)]  # (E, steps)
        image = ax.imshow(grid, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest",
                          extent=(-0.5, len(steps) - 0.5, E - 0.5, -0.5))
        ax.set_title(f"layer {layers[i]}", fontsize=9)
        ticks = sorted({0, len(steps) // 2, len(steps) - 1})
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks], fontsize=7)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("expert", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    fig.colorbar(image, ax=axes, shrink=0.8, label="load / even share")
    if title:
        fig.suptitle(title, fontsize=10)
    return _atomic_write(Path(out_path), lambda f: fig.savefig(f, format="png", dpi=100))


def write_expert_load(history, layers: list[int], directory: str | Path, title: str | None = None
                      ) -> tuple[Path, Path]:
    """(png, json) of the load history in `directory`."""
    directory = Path(directory)
    png = plot_expert_load(history, layers, directory / EXPERT_LOAD_PLOT, title)
    data = json.dumps(load_table(history, layers)).encode()
    return png, _atomic_write(directory / EXPERT_LOAD_DATA, lambda f: f.write(data))
