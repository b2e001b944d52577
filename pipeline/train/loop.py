"""The training loop around the engine: epochs and the data cursor, logging, evaluation, checkpoints,
a rank-0 progress bar and a clean stop on Ctrl+C. Ray-free; pipeline/train/ray_train.py calls `fit` from each
Ray Train worker with hooks that report to Ray, and `train_local` runs it in a plain process.

    python pipeline/run.py train --no-ray ...     # this loop without Ray (one process, one device)
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from pipeline.console import progress as console_progress
from pipeline.train.distributed.collectives import CollectiveWatch
from pipeline.eval.positions import evaluate_by_position
from pipeline.tracking.names import EVAL_DATA_WAIT, TRAIN_DATA_WAIT
from pipeline.train.engine import Engine, StepOutcome

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


class StopRequest:
    """A request to checkpoint and stop after the current step.

    In a plain process the first Ctrl+C (or SIGTERM) sets it and a second Ctrl+C interrupts at once;
    handlers are installed only in the main thread. Ray Train workers cannot see the driver's Ctrl+C,
    so the driver creates `stop_file` and workers look for it: a local path, or a URI in the run's storage
    when the workers run on other machines (a look costs one HEAD request, at log steps only; a failed look
    counts as no request). On object storage the look runs in a background thread and a poll takes the answer of
    the last look that finished, so a stalled or unreachable store never holds up a step (a stop is seen one log
    step later). `poll` is collective under DDP (every rank calls it at the same steps and they agree), so all
    workers stop at the same step.

    `notices` are preemption notices a worker may get (pipeline/train/distributed/elastic.py: a SIGTERM to a Ray Train worker,
    Ray draining its node), each a callable returning a reason or None; with any, the loop asks at every step, so
    the checkpoint lands at the next step boundary. `preempted` is then the reason, the same on every rank ("rank 1:
    SIGTERM to the worker on host-b (pid 7)" under a process group), and the launcher stops that attempt rather
    than the run.
    """

    def __init__(self, stop_file: str | Path | None = None,
                 notices: Iterable[Callable[[], str | None]] = ()) -> None:
        self.requested = False
        self.stop_file = str(stop_file) if stop_file else None
        self.notices = list(notices)
        self.preempted: str | None = None
        self._previous: dict[int, Any] = {}
        self._look: threading.Thread | None = None
        self._seen = False  # what the last finished look in the background found

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstop requested: finishing this step and writing a checkpoint (Ctrl+C again to abort)", flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _stop_file_seen(self) -> bool:
        from pipeline.storage import is_local

        if self.stop_file is None:
            return False
        if is_local(self.stop_file):
            return _stop_file_exists(self.stop_file)
        if self._look is None or not self._look.is_alive():
            def look() -> None:
                self._seen = _stop_file_exists(self.stop_file)

            self._look = threading.Thread(target=look, name="stop-request-look", daemon=True)
            self._look.start()
        return self._seen

    def poll(self, device: torch.device) -> bool:
        return self.boundary(device)[0]

    def boundary(self, device: torch.device, *, look: bool = True, checkpoint_due: bool = False) -> tuple[bool, bool]:
        """(stop now, checkpoint now), agreed by every rank in one all-reduce under a process group: a stop request
        (the stop file looked for only when `look`), a preemption notice on any rank, and `checkpoint_due` (rank 0's
        clock: CheckpointClock)."""
        local = self.requested or (look and self._stop_file_seen())
        reasons = [n() for n in self.notices]  # every one, every time: a notice may itself be a collective
        notice = next((why for why in reasons if why), None)
        flags = [local or notice is not None, notice is not None, checkpoint_due]
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            t = torch.tensor([float(f) for f in flags], device=device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flags = [bool(v) for v in t.tolist()]
        self.requested = flags[0]
        if flags[1] and self.preempted is None:
            if distributed:  # once per run at most: every rank learns which worker got the notice and what it was
                notices: list[Any] = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(notices, notice)
                notice = next(f"rank {r}: {n}" for r, n in enumerate(notices) if n)
            self.preempted = notice
        return flags[0], flags[2]


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
        evaluate: Callable[[Engine, int], dict[str, float]] | None = None) -> FitResult:
    """Train until engine.step == max_steps (default cfg.train.max_steps).

    train_batches(epoch, start) yields this worker's micro-batches from global sequence `start` of
    `epoch`; the engine's (epoch, cursor) say where to resume, so a restored engine continues at the
    exact next sequence. Each micro-batch advances the cursor by batch_size x world_size sequences.
    `evaluate(engine, max_batches)`, when given, evaluates instead of engine.evaluate(val_batches()) (a mixture:
    one validation split per source, pipeline/eval/sources.py).
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
                bar.set_postfix(loss=f"{result.last_train['train/loss']:.3f}",
                                ppl=f"{result.last_train['train/ppl']:.1f}",
                                tok_s=f"{result.last_train['train/tokens_per_s']:.0f}",
                                lr=f"{result.last_train['train/lr']:.2e}", refresh=False)
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


class LocalCheckpoints:
    """Checkpoints of a plain-process run: <dir>/step_000050, keeping the `keep` newest."""

    def __init__(self, directory: str | Path, keep: int):
        self.directory, self.keep = Path(directory), keep
        self.last_saved: Path | None = None

    def save(self, engine: Engine, extra: dict | None = None) -> Path:
        path = engine.save(self.directory / f"step_{engine.step:06d}", extra=extra)
        self.last_saved = path
        for old in self.all()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for left in self.directory.glob(".step_*.tmp-*"):  # what a crash mid-save left: never a checkpoint
            shutil.rmtree(left, ignore_errors=True)
        return path

    def all(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("step_*") if (p / "meta.json").is_file())

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1] if found else None


def _stop_file_exists(location: str) -> bool:
    from pipeline import storage_faults
    from pipeline.storage import StorageError, exists

    try:
        with storage_faults.retry_window_of(0):  # one look, no waiting: training goes on while the store is away
            return exists(location)
    except (StorageError, OSError):  # a blip of the object store is not a stop request
        return False


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


class AuditLog:
    """Append-only record of the seq_ids each step consumed (one JSON line per step), so a run's data order can
    be checked after the fact: exactly once per epoch, across restarts. Over a mixture each line also has `sources`
    and `passes` beside `seq_ids` (the row's source index in data.mixture and its pass over that source).

    On a local path every line is flushed as it is written. Object storage cannot append: the log is kept in
    memory and the whole object rewritten at `flush` (each checkpoint, and at the end), starting from what an
    earlier attempt of the same rank left; lines after the last flush belong to steps that a restart redoes."""

    def __init__(self, path: str | Path, extra: dict | None = None):
        from pipeline.storage import is_local, read_bytes, resolve

        self.path, self.extra = str(path), dict(extra or {})
        self._f, self._lines, self._dirty = None, [], False
        if is_local(self.path):
            local = Path(resolve(self.path)[1])
            local.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(local, "a", buffering=1)
        else:
            try:
                self._lines.append(read_bytes(self.path).decode())
            except FileNotFoundError:
                pass

    def write(self, engine: Engine, outcome: StepOutcome, micro: list[dict[str, torch.Tensor]]) -> None:
        import json
        import os

        ids = [int(i) for b in micro for i in b["seq_id"]]
        # A mixture's rows: seq_ids are per source dataset, so each row also names its source and pass
        mixed = {k: [int(i) for b in micro for i in b[k]] for k in ("source", "pass") if k in micro[0]}
        line = json.dumps({"step": engine.step, "time": time.time(), "skipped": outcome.skipped, "epoch": engine.epoch,
                           "phase": engine.phase, "pid": os.getpid(), **self.extra, "seq_ids": ids,
                           **({"sources": mixed["source"], "passes": mixed["pass"]} if mixed else {})}) + "\n"
        if self._f is not None:
            self._f.write(line)
        else:
            self._lines.append(line)
            self._dirty = True

    def flush(self) -> None:
        if self._f is None and self._dirty:
            from pipeline.storage import write_text

            write_text(self.path, "".join(self._lines))
            self._dirty = False

    def close(self) -> None:
        self.flush()
        if self._f is not None:
            self._f.close()


def standard_hooks(tracker=None, audit: AuditLog | None = None,
                   on_checkpoint: Callable[[Engine, dict[str, float]], None] | None = None,
                   on_eval_extra: Callable[[Engine, dict[str, float]], None] | None = None) -> Hooks:
    """The hooks every launcher wants: metrics to the tracker (rank 0 passes one), the data audit,
    and the launcher's own checkpoint writer."""

    def log(engine: Engine, metrics: dict[str, float]) -> None:
        if tracker is not None:
            tracker.log_metrics(metrics, step=engine.step)

    def on_eval(engine: Engine, metrics: dict[str, float]) -> None:
        log(engine, metrics)
        if tracker is not None and any("/pos_loss/" in k for k in metrics):  # train.eval_by_position
            tracker.log_position_plot(title=f"{engine.cfg.model.tier} {engine.cfg.model.mixer}")
        if tracker is not None and engine.moe is not None:  # a mixture of experts: its load over the steps
            tracker.log_expert_load(engine.moe.history, engine.moe.block_index, title=engine.cfg.model.tier)
        if on_eval_extra is not None:
            on_eval_extra(engine, metrics)

    return Hooks(on_step=audit.write if audit is not None else None, on_log=log, on_eval=on_eval,
                 on_checkpoint=on_checkpoint)
