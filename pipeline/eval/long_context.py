"""The eval stage's long-context measures over a loaded model (pipeline/cli/eval.py loads the checkpoint, any layout:
a sharded FSDP checkpoint is consolidated on load, and hands the engine, the dataset's manifest and tokenizer down),
logged to the MLflow run that trained it.

    python pipeline/run.py eval --resume runs/<run> --by-position             # loss by position, trained length
    python pipeline/run.py eval --resume runs/<run> --seq-len 2x,4x           # rows 2x and 4x as long
    python pipeline/run.py eval --resume runs/<run> --passkey                 # passkey grid, up to 2x the length

    report = measure_long_context(engine, dataset_dir, seq_len, batch_size, step=step, by_position=True,
                                  factors=[2], passkey=True, tokenizer=tokenizer)
    log_long_context(report, tracking_uri, run_id)     # metrics at the checkpoint's step + the two pictures

The model is built and loaded by the engine (pipeline/train/engine.py Engine + load), as training built it: the
checkpoint's own config decides the tier, family, document masking and RoPE settings, so an evaluation past the
trained length uses the positions as the checkpoint is configured now. Metric names (docs/tracking.md):
eval/pos_loss|pos_docs|pos_tokens/<bucket>, eval/cum_ppl/<L> (--by-position); eval_<k>x/loss, eval_<k>x/ppl,
eval_<k>x/rows and the same position metrics under eval_<k>x/ (--seq-len kx); passkey/accuracy,
passkey/digit_accuracy, passkey/accuracy/<length> (--passkey). Artifacts: position_loss.png (redrawn from the
run's whole history: the training evaluations' lines and these), passkey_heatmap.png and passkey_grid.json.
"""
from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pipeline.eval.passkey import PasskeyGrid
from pipeline.eval.positions import PositionResult
from pipeline.tracking.names import LOSS, PPL, ROWS, longer_rows_prefix, split_metric

if TYPE_CHECKING:
    from pipeline.data.shards import Manifest


class LongEvalError(ValueError):
    """A long-context evaluation option is invalid; the message names the option and what it takes."""


def parse_factors(text: str) -> list[int]:
    """'2x' | '4x' | '2x,4x' (or plain integers) -> [2, 4]; LongEvalError otherwise."""
    out = []
    for part in re.split(r"[,\s]+", text.strip()):
        m = re.fullmatch(r"(\d+)x?", part)
        if not m or int(m[1]) < 2:
            raise LongEvalError(f"--seq-len {text!r}: give factors of the trained row length of at least 2, such as "
                                "2x, 4x or 2x,4x")
        out.append(int(m[1]))
    return sorted(set(out))


@dataclass
class LongContextReport:
    step: int  # the checkpoint's optimizer step: where the metrics are logged
    seq_len: int  # the trained row length
    metrics: dict[str, float] = field(default_factory=dict)
    positions: dict[str, PositionResult] = field(default_factory=dict)  # "eval", "eval_2x", ...
    passkey: PasskeyGrid | None = None


def measure_long_context(engine, dataset_dir: str | Path, seq_len: int, batch_size: int, *, step: int = 0,
                         seed: int = 0, manifest: "Manifest | None" = None, tokenizer=None, by_position: bool = False,
                         factors: list[int] = (), passkey: bool = False, passkey_lengths: list[int] | None = None,
                         passkey_trials: int = 5, echo: Callable[[str], None] = print,
                         show_progress: bool = True) -> LongContextReport:
    """Run the asked measures with `engine` (a loaded model: pipeline/cli/eval.py load_for_eval) over the validation
    split of `dataset_dir` (rows of `seq_len` tokens, its `manifest` when already read), `batch_size` rows per batch,
    printing each as it finishes through `echo`, with progress while each runs (`show_progress`:
    pipeline/console.py progress, a bar in a terminal, plain lines in a log); `step`: the checkpoint's, where the
    metrics are logged; `seed`: the passkey keys'; `tokenizer`: the dataset's, needed by `passkey`. See the module
    docstring for what they log."""
    from pipeline.data.shards import eval_reader
    from pipeline.eval.long_rows import LongRows
    from pipeline.eval.passkey import default_lengths, haystack_tokens, passkey_grid
    from pipeline.eval.positions import evaluate_by_position
    from pipeline.console import progress

    if passkey and tokenizer is None:
        raise ValueError("measure_long_context(passkey=True) needs the dataset's tokenizer")
    T, batch = seq_len, batch_size
    report = LongContextReport(step, T)
    def counted(batches, desc: str):
        """`batches`, with progress per batch: a long row's forward can take minutes."""
        if not show_progress:
            yield from batches
            return
        bar = progress(desc, len(batches))
        try:
            for b in batches:
                yield b
                bar.update(1)
        finally:
            bar.close()

    if by_position:
        res = evaluate_by_position(engine, counted(eval_reader(dataset_dir, batch, manifest=manifest),
                                                   "eval by position"), T)
        report.positions["eval"] = res
        report.metrics.update(res.metrics("eval"))
        echo(f"eval by position (rows of {T} tokens; a bucket counts the documents that reach its end):\n"
             f"{res.table()}\n{_cumulative_line(res)}")
    for k in factors:
        rows = LongRows(dataset_dir, k, max(1, batch // k), manifest=manifest)
        res = evaluate_by_position(engine, counted(rows, f"eval {k}x"), rows.row_len, score_from=rows.score_from)
        prefix = longer_rows_prefix(k)
        report.positions[prefix] = res
        report.metrics.update({split_metric(prefix, LOSS): res.loss,
                               split_metric(prefix, PPL): math.exp(min(res.loss, 700.0)),
                               split_metric(prefix, ROWS): float(len(rows.rows)), **res.metrics(prefix)})
        echo(f"eval {k}x: rows of {rows.row_len} tokens ({k} windows of the stream), scoring the last window's "
             f"{T} targets of {len(rows.rows)} validation rows ({rows.skipped} without enough stream before them): "
             f"{split_metric(prefix, LOSS)}={res.loss:.4f}  {split_metric(prefix, PPL)}="
             f"{math.exp(min(res.loss, 700.0)):.2f}\n{res.table()}\n"
             f"{_cumulative_line(res)}")
    if passkey:
        lengths = passkey_lengths or default_lengths(T)
        grid = passkey_grid(engine.module.decoder, tokenizer, haystack_tokens(dataset_dir),
                            lengths, trials=passkey_trials, seed=seed,
                            progress=(lambda total: progress("passkey", total)) if show_progress else None)
        report.passkey = grid
        report.metrics.update(grid.metrics())
        skipped = f"; lengths {grid.skipped} too short for the prompt, left out" if grid.skipped else ""
        echo(f"passkey: accuracy {grid.mean_accuracy:.3f} (digits {grid.digit_accuracy.mean():.3f}; chance 0.00001 "
             f"and 0.1), {len(grid.lengths)} lengths x {len(grid.depths)} depths x {grid.trials} keys, greedy"
             f"{skipped}\n{grid.table()}")
    return report


def _cumulative_line(res: PositionResult) -> str:
    points = [f"{c.length}: {c.ppl:.2f}" for c in res.cumulative if c.tokens]
    return "cumulative-mean perplexity (context length: ppl)  " + "  ".join(points)


def artifact_location(artifact_uri: str, name: str) -> str:
    """Where artifact `name` of a run whose artifact root is `artifact_uri` is: a local path for a file:// root (the
    embedded store's runs/mlartifacts/...), else the URI (s3://..., mlflow-artifacts:/... on a tracking server)."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(artifact_uri)
    if parsed.scheme == "file":
        return str(Path(unquote(parsed.path)) / name)
    if parsed.scheme == "":
        return str(Path(artifact_uri) / name)
    return artifact_uri.rstrip("/") + "/" + name


def log_long_context(report: LongContextReport, tracking_uri: str, run_id: str, title: str | None = None) -> list[str]:
    """The report's metrics at its checkpoint's step, position_loss.png redrawn from the run's whole history, and
    the passkey heatmap and grid, into an existing MLflow run (its status unchanged). Returns where the pictures
    and the grid now are (artifact_location: local paths for a local store)."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.lineage import log_metrics_to_run
    from pipeline.tracking.long_context_plots import (PASSKEY_GRID, PASSKEY_HEATMAP, POSITION_PLOT, log_position_plot,
                                                plot_passkey_heatmap)

    log_metrics_to_run(tracking_uri, run_id, {k: v for k, v in report.metrics.items() if math.isfinite(v)},
                       report.step)
    client = MlflowClient(tracking_uri=tracking_uri)
    logged: list[str] = []
    if report.positions and log_position_plot(client, run_id, title=title):
        logged.append(POSITION_PLOT)
    if report.passkey is not None:
        grid = {**report.passkey.to_dict(), "trained_len": report.seq_len, "step": report.step}
        with tempfile.TemporaryDirectory(prefix="longtrain-passkey-") as tmp:
            png = plot_passkey_heatmap(grid, Path(tmp) / PASSKEY_HEATMAP,
                                       title=f"{title + ': ' if title else ''}passkey retrieval at step "
                                             f"{report.step}, {grid['trials']} keys per cell")
            (Path(tmp) / PASSKEY_GRID).write_text(json.dumps(grid, indent=1) + "\n")
            client.log_artifact(run_id, str(png))
            client.log_artifact(run_id, str(Path(tmp) / PASSKEY_GRID))
        logged += [PASSKEY_HEATMAP, PASSKEY_GRID]
    root = client.get_run(run_id).info.artifact_uri
    return [artifact_location(root, name) for name in logged]
