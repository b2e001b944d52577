"""The training loop around the engine: epochs and the data cursor, logging, evaluation, checkpoints, a rank-0
progress bar and a clean stop on Ctrl+C (the request: pipeline/train/stop_request.py; the data audit each step
writes: pipeline/train/audit_log.py; a --no-ray run's checkpoints: pipeline/train/checkpoints/local_dir.py). Ray-free;
pipeline/train/ray_train.py calls `fit` from each Ray Train worker with hooks that report to Ray, and `train_local`
runs it in a plain process.

    python pipeline/run.py train --no-ray ...     # this loop without Ray (one process, one device)
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from pipeline.console import progress as console_progress
from pipeline.train.distributed.collectives import CollectiveWatch
from pipeline.eval.positions import evaluate_by_position
from pipeline.tracking.names import (EVAL_DATA_WAIT, TRAIN_DATA_WAIT, TRAIN_LOSS, TRAIN_LR, TRAIN_PPL,
                                     TRAIN_TOKENS_PER_S, is_position_metric)
from pipeline.train.audit_log import AuditLog
from pipeline.train.engine import Engine, StepOutcome
from pipeline.train.spike_rewind import Rewinder, outlier_event, rewind
from pipeline.train.stop_request import StopRequest

BatchIter = Iterator[dict[str, torch.Tensor]]
# Share of the logging window's wall-clock time spent waiting for the next batch (starting an epoch's
# stream included): ~0 when the data keeps up with the step. EVAL_DATA_WAIT: the same for an evaluation, the share of
# its wall-clock time spent waiting for validation batches (storage reads). Stable names: pipeline/tracking/names.py.
DATA_WAIT = TRAIN_DATA_WAIT


class DataExhaustedError(ValueError):
    """The training split cannot fill even one step."""


@dataclass
class Hooks:
    """What a launcher does at each event; every hook is optional. Metrics use the stable names."""

    on_step: Callable[[Engine, StepOutcome, list[dict[str, torch.Tensor]]], None] | None = None
    on_log: Callable[[Engine, dict[str, float]], None] | None = None
    on_eval: Callable[[Engine, dict[str, float]], None] | None = None
    on_checkpoint: Callable[[Engine, dict[str, float]], None] | None = None
    # a loss-spike event (pipeline/train/spike_rewind.py: an outlier skipped or applied, a rewind, a stop): every rank
    on_spike: Callable[[Engine, dict], None] | None = None


class CheckpointClock:
    """train.checkpoint_every_s: a checkpoint once that many seconds have passed since the last one. Only rank 0's
    clock counts (StopRequest.boundary hands its verdict to every rank at the same step): ranks whose clocks
    disagreed would enter the checkpoint's collectives at different steps and hang."""

    now = staticmethod(time.monotonic)

    def __init__(self, every_s: float, rank: int) -> None:
        self.every_s, self.rank = every_s, rank
        self.last = self.now()

    def due(self) -> bool:
        return self.every_s > 0 and self.rank == 0 and self.now() - self.last >= self.every_s

    def reset(self) -> None:
        self.last = self.now()


@dataclass
class FitResult:
    step: int
    stopped_early: bool
    last_train: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)


def fit(engine: Engine, train_batches: Callable[[int, int], Iterable[dict[str, torch.Tensor]]],
        val_batches: Callable[[], Iterable[dict[str, torch.Tensor]]] | None, hooks: Hooks | None = None,
        *, max_steps: int | None = None, progress: bool = True, stop: StopRequest | None = None,
        evaluate: Callable[[Engine, int], dict[str, float]] | None = None,
        rewinder: Rewinder | None = None) -> FitResult:
    """Train until engine.step == max_steps (default cfg.train.max_steps).

    train_batches(epoch, start) yields this worker's micro-batches from global sequence `start` of
    `epoch`; the engine's (epoch, cursor) say where to resume, so a restored engine continues at the
    exact next sequence. Each micro-batch advances the cursor by batch_size x world_size sequences.
    `evaluate(engine, max_batches)`, when given, evaluates instead of engine.evaluate(val_batches()) (a mixture:
    one validation split per source, pipeline/eval/sources.py).

    Loss spikes (engine.spikes, pipeline/train/spike_guard.py): an outlier step is reported to hooks.on_spike; when
    the guard calls for a rewind, every rank goes back to the checkpoint `rewinder` finds (pipeline/train/
    spike_rewind.py) and the cursor jumps over the rows the run's rewinds skipped whenever it reaches them.
    """
    t = engine.cfg.train
    hooks = hooks or Hooks()
    max_steps = max_steps or t.max_steps
    # Every collective-bearing call runs inside a region of `watch`: one that fails or times out (a rank that did
    # not join it) ends the run with one line naming this rank, the step and the collective (collectives.py).
    watch = CollectiveWatch.for_engine(engine)
    step_collective = {"ddp": "the gradient all-reduce (DDP)",
                       "fsdp": "FSDP's parameter all-gathers and gradient reduce-scatters"}.get(engine.parallel,
                                                                                                "the training step")
    result = FitResult(step=engine.step, stopped_early=False)
    window_start = time.perf_counter()
    _skip_rows(engine)
    it = iter(train_batches(engine.epoch, engine.cursor))
    waited = time.perf_counter() - window_start  # seconds of this logging window spent waiting for data
    # rank 0's progress (pipeline/console.py): a live bar in a terminal, a plain line at each log step in a log file
    bar = console_progress(f"train {engine.cfg.model.tier}", max_steps, "step", initial=engine.step, tenths=False,
                           enabled=progress and engine.rank == 0)
    clock = CheckpointClock(t.checkpoint_every_s, engine.rank)
    # Every rank decides at the same steps: at log steps, or at every step when a time-based checkpoint or a
    # preemption notice must be caught at the next step boundary (one tiny all-reduce per step under DDP/FSDP).
    every_step = t.checkpoint_every_s > 0 or bool(stop is not None and stop.notices)
    stop = stop if stop is not None else (StopRequest() if every_step else None)
    try:
        while engine.step < max_steps:
            _hold()
            bar.begin()
            micro = []
            while len(micro) < t.grad_accum:
                w0 = time.perf_counter()
                if _skip_rows(engine):  # rows a rewind skipped, reached at an epoch's start or after a resume
                    it = iter(train_batches(engine.epoch, engine.cursor))
                batch = next(it, None)
                if batch is None:  # end of epoch: the next one starts at sequence 0 in a new order
                    if engine.cursor == 0:
                        raise DataExhaustedError(
                            "the training split holds fewer sequences than one global micro-batch "
                            f"(train.batch_size={t.batch_size} x {engine.world_size} workers); prepare more "
                            "data or lower train.batch_size")
                    engine.epoch, engine.cursor = engine.epoch + 1, 0
                    it = iter(train_batches(engine.epoch, 0))
                    waited += time.perf_counter() - w0
                    continue
                waited += time.perf_counter() - w0
                micro.append(batch)
                engine.cursor += batch["tokens"].shape[0] * engine.data_world_size  # rows: a context group shares them
            with watch.region(step_collective, engine.step + 1):
                outcome = engine.train_step(micro)
            if hooks.on_step:
                hooks.on_step(engine, outcome, micro)
            if outcome.spike is not None and outcome.spike.outlier and hooks.on_spike:
                hooks.on_spike(engine, outlier_event(engine, outcome))
            if outcome.rewind is not None:  # every rank at this step: the same broadcast and load on each
                before = engine.step
                with watch.region("the rewind past a loss spike (its checkpoint's choice and load)", before):
                    rewind(engine, outcome.rewind, rewinder, hooks.on_spike)
                _skip_rows(engine)
                it = iter(train_batches(engine.epoch, engine.cursor))
                bar.update(engine.step - before)
                continue
            if outcome.skipped:
                continue
            bar.update(1)
            step, last = engine.step, engine.step == max_steps
            # Under DDP/FSDP a (tiny) collective every rank makes at the same step.
            stopping = timed = False
            if stop is not None and (step % t.log_every == 0 or last or every_step):
                with watch.region("the stop-request all-reduce (at a step boundary)", step):
                    stopping, timed = stop.boundary(engine.device, look=step % t.log_every == 0 or last,
                                                    checkpoint_due=clock.due())
            if step % t.log_every == 0 or last or stopping:
                with watch.region("the training-metrics all-reduce (at a log step)", step):
                    result.last_train = engine.pull_train_metrics()
                now = time.perf_counter()
                result.last_train[DATA_WAIT] = waited / max(now - window_start, 1e-9)
                waited, window_start = 0.0, now
                if hooks.on_log:  # first: a step on the console is a step the tracker (and a resume) knows of
                    with watch.region("the logging hook", step):
                        hooks.on_log(engine, result.last_train)
                last_train = result.last_train
                bar.set_postfix(loss=f"{last_train[TRAIN_LOSS]:.3f}", ppl=f"{last_train[TRAIN_PPL]:.1f}",
                                tok_s=f"{last_train[TRAIN_TOKENS_PER_S]:.0f}", lr=f"{last_train[TRAIN_LR]:.2e}",
                                refresh=False)
            if (val_batches is not None or evaluate is not None) and (step % t.eval_every == 0 or last):
                with watch.region("the evaluation (its forwards and the metrics all-reduce)", step):
                    result.last_eval = (evaluate(engine, t.eval_batches) if evaluate is not None
                                        else evaluate_timed(engine, val_batches(), t.eval_batches))
                    if t.eval_by_position:  # the same batches again, per token (every rank: one all-reduce at the end)
                        by_pos = evaluate_by_position(engine, val_batches(), engine.cfg.data.seq_len, t.eval_batches)
                        result.last_eval.update(by_pos.metrics("val"))
                if hooks.on_eval:
                    with watch.region("the evaluation hook (the samples' whole-weight gather under FSDP)", step):
                        hooks.on_eval(engine, result.last_eval)
            if hooks.on_checkpoint and (step % t.checkpoint_every == 0 or last or stopping or timed):
                with watch.region("the checkpoint (the report to Ray Train, the sharded save's barriers)", step):
                    hooks.on_checkpoint(engine, {**result.last_train, **result.last_eval})
                clock.reset()
            if stopping:
                result.stopped_early = True
                break
    finally:
        bar.close()
        watch.close()
    result.step = engine.step
    return result


def _skip_rows(engine: Engine) -> bool:
    """Move the data cursor past the rows the run's rewinds skipped when it stands at (or in) them; whether it moved.
    Ranges begin at a checkpoint's cursor, a step boundary, so a run with the same rows per step lands on them."""
    end = engine.spikes.jump(engine.phase, engine.epoch, engine.cursor)
    if end is None:
        return False
    engine.cursor = end
    return True


HOLD_ENV = "LONGTRAIN_TRAIN_HOLD"


def _hold() -> None:
    """Test hook: with LONGTRAIN_TRAIN_HOLD=<path> in a worker's environment, wait at each step boundary while that
    file exists, so a test of restarts and resizes can act between steps whatever the machine's speed (a test
    creates the file, does what it must, removes it). While it waits, `<path>.held` exists: the test knows the
    process is there, however long a loaded machine took to get there."""
    path = os.environ.get(HOLD_ENV)
    if not (path and os.path.exists(path)):
        return
    held = f"{path}.held"
    with contextlib.suppress(OSError):
        open(held, "w").close()
    while os.path.exists(path):
        time.sleep(0.2)
    with contextlib.suppress(OSError):
        os.remove(held)


def evaluate_timed(engine: Engine, batches: Iterable[dict[str, torch.Tensor]], max_batches: int) -> dict[str, float]:
    """engine.evaluate over `batches`, plus EVAL_DATA_WAIT: the share of the evaluation's wall-clock time spent
    waiting for the next batch (reading the validation split, from object storage possibly)."""
    waited = [0.0]

    def timed() -> Iterator[dict[str, torch.Tensor]]:
        it = iter(batches)
        for _ in range(max_batches):  # no batch past the last one used is read
            t0 = time.perf_counter()
            batch = next(it, None)
            waited[0] += time.perf_counter() - t0
            if batch is None:
                return
            yield batch

    start = time.perf_counter()
    metrics = engine.evaluate(timed(), max_batches=max_batches)
    metrics[EVAL_DATA_WAIT] = waited[0] / max(time.perf_counter() - start, 1e-9)
    return metrics


def standard_hooks(tracker=None, audit: AuditLog | None = None,
                   on_checkpoint: Callable[[Engine, dict[str, float]], None] | None = None,
                   on_eval_extra: Callable[[Engine, dict[str, float]], None] | None = None,
                   spikes=None, say: Callable[[str], None] = print) -> Hooks:
    """The hooks every launcher wants: metrics to the tracker (rank 0 passes one), the data audit,
    and the launcher's own checkpoint writer. A loss-spike event: its line on rank 0's console (`say`), a tag and the
    spike counts in MLflow (the tracker's rank), and the run's spikes.json (`spikes`: rank 0's
    pipeline/train/spike_record.py SpikeRecord)."""

    def log(engine: Engine, metrics: dict[str, float]) -> None:
        if tracker is not None:
            tracker.log_metrics(metrics, step=engine.step)

    def on_eval(engine: Engine, metrics: dict[str, float]) -> None:
        log(engine, metrics)
        if tracker is not None and any(is_position_metric(k) for k in metrics):  # train.eval_by_position
            tracker.log_position_plot(title=f"{engine.cfg.model.tier} {engine.cfg.model.mixer}")
        if tracker is not None and engine.moe is not None:  # a mixture of experts: its load over the steps
            tracker.log_expert_load(engine.moe.history, engine.moe.block_index, title=engine.cfg.model.tier)
        if on_eval_extra is not None:
            on_eval_extra(engine, metrics)

    def on_spike(engine: Engine, event: dict) -> None:
        if engine.rank == 0:
            say(event["line"])
        index = spikes.add(event) if spikes is not None else None
        if tracker is not None:
            from pipeline.tracking.names import TRAIN_SPIKE_REWINDS, TRAIN_SPIKE_SKIPS, spike_tag

            if index is not None:
                tracker.set_tags({spike_tag(index): event["line"]})
            rewinds = len(engine.spikes.rewinds) + (event["kind"] == "rewind")  # a rewind's is recorded as it loads
            tracker.log_metrics({TRAIN_SPIKE_SKIPS: float(engine.spikes.skips), TRAIN_SPIKE_REWINDS: float(rewinds)},
                                step=event["step"])

    return Hooks(on_step=audit.write if audit is not None else None, on_log=log, on_eval=on_eval,
                 on_checkpoint=on_checkpoint, on_spike=on_spike)
