"""Fit a run to the data it has: a small corpus gets shorter rows, and no run passes over its data more than
`train.max_epochs` times. The `gpu` preset (the default with CUDA) turns both on, so `python pipeline/run.py` on a
GPU trains the built-in corpus a few times over at a row length it fills, instead of 1,000 epochs of 15 rows.

    python pipeline/run.py                                  # on a GPU: the gpu preset, sized to the built-in corpus
    python pipeline/run.py train --data.min_rows=512 --train.max_epochs=2     # the same rules on any preset

The rules, applied by the train stage (pipeline/train/session/train_session.py) to a run of one phase, and printed as `size:` lines:

1. Rows (`data.min_rows` > 0). Prepare at `data.seq_len`. When the corpus packs into fewer rows than min_rows, it is
   packed again at the longest power-of-two seq_len that gives at least min_rows rows (the token stream does not
   depend on seq_len, so the count is exact: tokens // (seq_len + 1)); never below MIN_SEQ_LEN. Only a corpus
   smaller than min_rows x seq_len tokens is tokenized twice, and such a corpus takes seconds.
2. Micro-batches. Rows f times shorter hold f times fewer tokens, so up to f micro-batches of gradient
   accumulation are merged into one: train.batch_size x k, train.grad_accum / k, with k the largest divisor of
   grad_accum that is at most f. Rows per optimizer step stay as they were; a micro-batch never holds more tokens.
3. Steps (`train.max_epochs` > 0). train.max_steps is capped at max_epochs passes over the training split (each
   pass is the split's whole global micro-batches). When the cap binds, warmup, eval and checkpoint intervals
   shrink by the same factor, so the schedule keeps its shape.

A sweep trains every trial its token budget at the configured seq_len (pipeline/sweep/tune.py) and is not sized.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.config import Config, rows_per_step

MIN_SEQ_LEN = 128  # shorter rows would say little about a long-context model


def rows_at(tokens: int, seq_len: int) -> int:
    """Rows a stream of `tokens` packs into at `seq_len` (windows of seq_len + 1, the last partial one dropped)."""
    return tokens // (seq_len + 1)


def shorter_seq_len(tokens: int, seq_len: int, min_rows: int) -> int:
    """The longest seq_len <= `seq_len`, a power of two below it, at which `tokens` fill at least `min_rows` rows;
    MIN_SEQ_LEN when even that falls short (or `seq_len` itself when it is shorter still)."""
    s = seq_len
    while rows_at(tokens, s) < min_rows and s > MIN_SEQ_LEN:
        s = max(MIN_SEQ_LEN, 1 << ((s - 1).bit_length() - 1))  # the next power of two below s
    return s


def fold_accumulation(batch_size: int, grad_accum: int, factor: int) -> tuple[int, int]:
    """(batch_size x k, grad_accum / k) with k the largest divisor of grad_accum that is <= factor."""
    k = max(d for d in range(1, grad_accum + 1) if grad_accum % d == 0 and d <= max(1, factor))
    return batch_size * k, grad_accum // k


def epoch_steps(cfg: Config, train_rows: int) -> float:
    """Optimizer steps one pass over `train_rows` takes: its whole global micro-batches over grad_accum."""
    t = cfg.train
    return (train_rows // (rows_per_step(cfg) // t.grad_accum)) / t.grad_accum


def cap_steps(cfg: Config, train_rows: int) -> tuple[Config, str]:
    """cfg with train.max_steps capped at train.max_epochs passes over `train_rows`, the intervals scaled with it;
    and the line that says so ("" when the cap does not bind)."""
    t = cfg.train
    if t.max_epochs <= 0:
        return cfg, ""
    per_epoch = epoch_steps(cfg, train_rows)
    cap = max(1, math.floor(t.max_epochs * per_epoch))
    if cap >= t.max_steps:
        return cfg, ""
    scale = cap / t.max_steps

    def shrink(n: int, low: int) -> int:
        return max(low, round(n * scale)) if n else 0

    over = {"train.max_steps": cap, "train.warmup_steps": shrink(t.warmup_steps, 1),
            "train.eval_every": shrink(t.eval_every, 1), "train.checkpoint_every": shrink(t.checkpoint_every, 1)}
    sized = cfg.replace(over)
    rows = rows_per_step(cfg)
    tokens = cap * rows * cfg.data.seq_len
    line = (f"size: train.max_epochs={t.max_epochs:g} over {train_rows:,} training rows at {rows} rows per "
            f"step caps train.max_steps {t.max_steps:,} -> {cap:,} ({tokens:,} tokens, {cap / per_epoch:.1f} "
            f"epochs); warmup {t.warmup_steps} -> {over['train.warmup_steps']}, eval every {t.eval_every} -> "
            f"{over['train.eval_every']}, checkpoint every {t.checkpoint_every} -> {over['train.checkpoint_every']}")
    return sized, line


@dataclass
class Sized:
    cfg: Config  # the run's config, sized to its data
    dataset: Path  # the dataset it trains on
    lines: list[str] = field(default_factory=list)  # what changed and why, as printed
    epochs: float | None = None  # passes over the training split the run makes, when train.max_epochs capped it


def size_to_data(cfg: Config, prepare: Callable[[Config], Path], steps: bool = True) -> Sized:
    """Prepare cfg's data and apply the rules of the module docstring (rule 3 only with `steps`); prints each
    `size:` line as it decides."""
    from pipeline.data.shards import load_manifest

    dataset = Path(prepare(cfg))
    manifest = load_manifest(dataset)
    lines: list[str] = []
    d, t = cfg.data, cfg.train
    rows = manifest.rows("train") + manifest.rows("val")
    if d.min_rows > 0 and rows < d.min_rows:
        tokens = int(manifest.counts["tokens_total"])
        seq_len = shorter_seq_len(tokens, d.seq_len, d.min_rows)
        if seq_len < d.seq_len:
            batch, accum = fold_accumulation(t.batch_size, t.grad_accum, d.seq_len // seq_len)
            line = (f"size: {rows:,} rows of {d.seq_len:,} tokens are fewer than data.min_rows={d.min_rows:,}: packing "
                    f"the corpus ({tokens:,} tokens) again at data.seq_len={seq_len:,} ({rows_at(tokens, seq_len):,} "
                    f"rows)")
            if (batch, accum) != (t.batch_size, t.grad_accum):
                line += (f"; micro-batch {t.batch_size} x {t.grad_accum} accumulated -> {batch} x {accum} (the same "
                         f"{t.batch_size * t.grad_accum} rows per step)")
            print(line, flush=True)
            lines.append(line)
            cfg = cfg.replace({"data.seq_len": seq_len, "train.batch_size": batch, "train.grad_accum": accum})
            dataset = Path(prepare(cfg))
            manifest = load_manifest(dataset)
    cfg, line = cap_steps(cfg, manifest.rows("train")) if steps else (cfg, "")
    epochs = None
    if line:
        print(line, flush=True)
        lines.append(line)
        epochs = cfg.train.max_steps / epoch_steps(cfg, manifest.rows("train"))
    return Sized(cfg, dataset, lines, epochs)


def sizes(cfg: Config) -> bool:
    """Whether the run has sizing rules on (data.min_rows or train.max_epochs)."""
    return cfg.data.min_rows > 0 or cfg.train.max_epochs > 0
