"""How longtrain talks to the console: stage banners that stand out from Ray's lines, progress that is
a live bar in a terminal and a few plain lines in a log file, and Ray's own chatter kept short.

    ==> prepare: builtin corpus, seq_len 256, vocab 2000
    ==> train: tier nano, 200 steps, 1 Ray Train worker(s)

Whether the console is interactive is decided once, by the driver (`sys.stdout.isatty()`), and handed
to Ray workers through LONGTRAIN_INTERACTIVE: their own stdout is a pipe to the driver either way.
"""
from __future__ import annotations

import logging
import os
import sys
import time

INTERACTIVE_ENV = "LONGTRAIN_INTERACTIVE"


def interactive() -> bool:
    """True when a person watches a terminal: live progress bars; False for a log file or a pipe."""
    forced = os.environ.get(INTERACTIVE_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stdout.isatty()


def worker_print(line: str) -> None:
    """A line from a Ray Train worker, once: Ray Train patches print() in its workers so each printed line reaches the
    driver's console twice; the process's own stdout carries it once (as the progress lines do)."""
    out = sys.__stdout__ or sys.stdout
    out.write(line + "\n")
    out.flush()


def plain_worker_prefixes() -> None:
    """In a log file or a pipe, the `(RayTrainWorker pid=...)` prefix Ray puts on every worker line carries no
    colour codes. Ray's driver wraps it in ANSI colours whatever its stdout is, unless RAY_COLOR_PREFIX=0; a person
    at a terminal keeps them. An explicit RAY_COLOR_PREFIX wins."""
    if not interactive():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


PLAIN_PROGRESS_EVERY_S = 30.0  # in a log file, a progress line at least this often (besides each tenth of the work)


def now() -> float:
    """The one clock of every progress line: seconds, monotonic. Tests replace it (monkeypatch) to drive time."""
    return time.monotonic()


class ProgressLines:
    """Progress as plain lines, for a log file or a pipe (a bar written to a file is one line per redraw):

        train nano  step 50/200  loss 5.892  ppl 362.1  tok_s 41210  lr 2.9e-03  elapsed 0m41s  eta 2m03s
        eval 4x  batch 3/12  elapsed 0m41s  eta 2m03s

    `update(n)` counts units done; `set_postfix(**fields)` prints a line with the fields now (training, at its log
    steps); with `tenths`, `update` itself prints at the first unit, at each tenth of the total, at least every
    PLAIN_PROGRESS_EVERY_S and at the end (evaluation). `begin()` says a unit starts (training calls it before each
    step; optional).

    The eta is the mean time of the units after the first, times the units left: the first unit also compiles,
    allocates and warms up (several times a step's time on a GPU), and whatever follows it before the next unit
    starts (training's first metrics logged to MLflow, the first evaluation) is not a step's time either. So the mean
    is taken from when the second unit begins (`begin()`), or, for a caller that never calls it, from when the first
    unit ended. Until a unit after the first is done the eta is `?`; at the end it is 0m00s. Time comes from `now()`
    above."""

    def __init__(self, desc: str, total: int, unit: str = "batch", *, initial: int = 0, tenths: bool = True):
        self.desc, self.total, self.unit, self.tenths = desc, max(1, total), unit, tenths
        self.n = self.start_n = initial
        self.t0 = self.last = now()
        self.first_done: float | None = None  # when the first unit ended
        self.second_began: float | None = None  # when the unit after the first began (begin())
        self.next_at = initial + 1

    def begin(self) -> None:
        if self.second_began is None and self.n - self.start_n == 1:
            self.second_began = now()

    def update(self, n: int = 1) -> None:
        self.n += n
        t = now()
        if self.first_done is None:
            self.first_done = t
        if not self.tenths:
            return
        if self.n < self.next_at and self.n < self.total and t - self.last < PLAIN_PROGRESS_EVERY_S:
            return
        self.next_at = (self.n * 10 // self.total + 1) * self.total / 10  # the next tenth
        self._print(t, "")

    def set_postfix(self, refresh: bool = False, **fields: str) -> None:
        self._print(now(), "  ".join(f"{k} {v}" for k, v in fields.items()))

    def eta(self, t: float) -> str:
        """The eta at time `t` as printed: `1m05s`, `?` before a unit after the first is done, 0m00s at the end."""
        if self.n >= self.total:
            return clock(0)
        after_first = self.n - self.start_n - 1
        since = self.second_began if self.second_began is not None else self.first_done
        if after_first <= 0 or since is None:
            return "?"
        return clock((t - since) / after_first * (self.total - self.n))

    def _print(self, t: float, shown: str) -> None:
        self.last = t
        counted = f"{self.unit} {self.n}/{self.total}"
        line = "  ".join(p for p in (self.desc, counted, shown, f"elapsed {clock(t - self.t0)}", f"eta {self.eta(t)}")
                         if p)
        # The process's own stdout, not print(): Ray Train patches print() in its workers to log each line twice.
        out = sys.__stdout__ or sys.stdout
        out.write(line + "\n")
        out.flush()

    def close(self) -> None:
        pass


class _Bar:
    """A live tqdm bar (on stderr) for a person at a terminal, with ProgressLines' interface."""

    def __init__(self, desc: str, total: int, unit: str, initial: int, enabled: bool):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit=unit, dynamic_ncols=True,
                         leave=False)

    def begin(self) -> None:
        pass

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def set_postfix(self, refresh: bool = False, **fields: str) -> None:
        self._bar.set_postfix(refresh=refresh, **fields)

    def close(self) -> None:
        self._bar.close()


class _Silent:
    """Progress that shows nothing (the ranks other than 0)."""

    def begin(self) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, refresh: bool = False, **fields: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress(desc: str, total: int, unit: str = "batch", *, initial: int = 0, tenths: bool = True,
             enabled: bool = True):
    """Progress of `total` units of work (the training steps, an evaluation's batches): a live tqdm bar in a
    terminal, plain lines (ProgressLines) in a log file or a pipe, nothing when not `enabled`. Call .begin() as a
    unit starts (optional), .update(n) as units end, .set_postfix(**fields) to show figures, .close() at the end.
    `tenths`: plain lines at each tenth of the work by themselves; else only at set_postfix (training's log steps)."""
    if not enabled:
        return _Silent()
    if interactive():
        return _Bar(desc, total, unit, initial, enabled)
    return ProgressLines(desc, total, unit, initial=initial, tenths=tenths)


def size_text(nbytes: float) -> str:
    """'812.0 KiB', '1.7 MiB', '2.41 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}" if unit == "GiB" else f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def clock(seconds: float) -> str:
    """'1m05s', '2h03m00s'."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


_current_stage = ""  # the last banner's stage: what a Ctrl+C interrupts (pipeline/run.py says what was kept)


def current_stage() -> str:
    """The stage of the last banner printed since reset_stage() ("" before the first)."""
    return _current_stage


def reset_stage() -> None:
    """A new command begins (run.py's main; tests call it several times in one process)."""
    global _current_stage
    _current_stage = ""


def stage(name: str, detail: str = "") -> None:
    """A stage banner: `==> train: tier nano, 200 steps` (bold in a terminal)."""
    global _current_stage
    _current_stage = name
    line = f"==> {name}" + (f": {detail}" if detail else "")
    if sys.stdout.isatty():
        line = f"\033[1m{line}\033[0m"
    print("\n" + line, flush=True)


class _DropProgressNotice(logging.Filter):
    """Ray Data's once-per-process notice about disabled progress bars (we disable them on purpose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Progress bars disabled", "Progress will be logged"))


def quiet_ray_data(progress: bool | None = None) -> None:
    """Ray Data in this process: progress bars only when `progress` (default: in a terminal), and its
    console at WARNING (its INFO lines, such as each dataset's execution plan, stay in Ray's log files).

    Call after `import ray.data` (which installs Ray Data's logging) and before executing a dataset."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = interactive() if progress is None else progress
    ctx.print_on_execution_start = False
    logger = logging.getLogger("ray.data")
    for handler in logger.handlers:
        if "File" not in type(handler).__name__:  # Ray's session log files keep everything
            handler.setLevel(max(handler.level, logging.WARNING))
            if not any(isinstance(f, _DropProgressNotice) for f in handler.filters):
                handler.addFilter(_DropProgressNotice())


class _DropRayTrainInfo(logging.Filter):
    """Ray Train's INFO lines in a worker ("Reporting training result N: ..." per checkpoint): they log
    under their file path, not under `ray.train`, so its LoggingConfig does not reach them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or f"{os.sep}ray{os.sep}train{os.sep}" not in record.pathname


class _DropPlannedStopTraceback(logging.Filter):
    """Ray Train logs the traceback of any error that ends a training function; a worker ending its attempt on
    purpose after a preemption checkpoint (pipeline/train/distributed/elastic.py PreemptionStop) says so in one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "PreemptionStop:" in record.getMessage())


class _StorageErrorInOneLine(logging.Filter):
    """Ray Train logs the traceback of any error that ends a training function; for a storage error (pipeline/
    storage.py StorageError, whose message names the object, what happened and the fix) the frames add nothing:
    the record becomes its one line."""

    PREFIXES = ("pipeline.storage.StorageError: ", "pipeline.disk_space.DiskFullError: ")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith("Error in training function:"):
            last = record.getMessage().strip().splitlines()[-1]
            prefix = next((p for p in self.PREFIXES if last.startswith(p)), None)
            if prefix is not None:
                ends = "the run ends: another attempt would fill it again" if "DiskFull" in prefix else "this attempt ends"
                record.msg, record.args = f"storage: {last[len(prefix):]} ({ends})", ()
                record.exc_info = record.exc_text = None
        return True


class _DropSafeToIgnore(logging.Filter):
    """A warning Ray itself calls safe to ignore ("Failed to send resource request ... If this only happens
    transiently during network partition or CPU being overloaded, it's safe to ignore this error"), logged with its
    traceback by Ray Train's controller on a busy machine. Ray's log files keep it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno < logging.ERROR and "safe to ignore" in record.getMessage())


# The Ray Train loggers that log such warnings: filtered at the logger itself, so that the filter is in place before
# Ray Train's controller configures its handlers and sends its first resource request (both before any callback of
# ours runs there). Their records then reach no handler, Ray's log files included.
_SAFE_TO_IGNORE_LOGGERS = ("ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client",
                           "ray.train.v2._internal.execution.scaling_policy.elastic")


def quiet_safe_to_ignore() -> None:
    """In this process (a Ray Train controller or worker): the console drops Ray's warnings that say they are safe
    to ignore; its log files keep them (those of the Ray Train loggers above aside)."""
    for name in _SAFE_TO_IGNORE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropSafeToIgnore) for f in logger.filters):
            logger.addFilter(_DropSafeToIgnore())
    for name in ("ray.train", "ray", ""):
        for handler in logging.getLogger(name).handlers:
            if "File" not in type(handler).__name__ and not any(isinstance(f, _DropSafeToIgnore)
                                                                for f in handler.filters):
                handler.addFilter(_DropSafeToIgnore())


# Lines Ray's GCS forwards to the driver's console that tell of nothing gone wrong: at a job's end (a successful
# prepare), the GCS kills the job's actors and reports those whose worker had already exited ("Failed to kill actor
# ..., KillActor RPC failed ... Socket closed") as errors, after the command's last line.
_HARMLESS_GCS_LINES = ("Failed to kill actor",)
# Lines of Ray Train's placement-group cleaner (a detached actor) when Ray runs without its dashboard, and so without
# the State API: one a second for the whole run, each saying it goes on (measured: 140 of the 211 console lines of
# the default run on a GPU machine without the dashboard). The driver has already said once that the dashboard is
# missing and how to install it; the cleaner's log file keeps them.
_HARMLESS_WORKER_LINES = ("Failed to query Ray Train Controller actor state. State API may be temporarily "
                          "unavailable. Continuing to monitor.",)


def _drop_sigterm_exit_blocks(lines: list[str]) -> tuple[list[str], list[str]]:
    """`lines` less each block "Exception ignored in: ..." through "SystemExit: 1" raised by Ray's own SIGTERM handler
    (a frame `in sigterm_handler` of ray/_private/worker.py), and apart from them the block still open at the end of
    `lines` (its exception line not come yet: Python writes a block line by line, and Ray's log monitor may send it
    in two batches). As a worker ends (a Tune trial's actor once the trial has reported), the raylet sends its process
    group SIGTERM, and then SIGKILL; Ray's handler raises SystemExit(1) wherever the main thread is, and where that is
    a finalizer (`__del__`, a weakref callback) Python can only print the exception as ignored. The trial's results
    are in by then and the process is ending anyway. Any other "Exception ignored" block, and every other traceback,
    is kept. Returns (kept lines, open block)."""
    kept: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("Exception ignored in"):
            # the block's exception line: the first unindented line past its "Traceback (most recent call last):"
            # (an empty line inside the block, as in one CI run's printed block, does not end it)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip()
                        and lines[j][:1] not in (" ", "\t") and not lines[j].startswith("Traceback")), None)
            if end is None:
                return kept, lines[i:]
            if lines[end].strip() == "SystemExit: 1" \
                    and any(ln.rstrip().endswith(" in sigterm_handler") and "ray" in ln for ln in lines[i + 1:end]):
                i = end + 1
                continue
        kept.append(lines[i])
        i += 1
    return kept, []


class _ForwardedLineFilter:
    """Wraps the emit of Ray's dispatcher of forwarded worker lines, ahead of its deduplicator (which, with several
    workers printing the same block, would otherwise cut blocks apart and print their lines later as "[repeated Nx
    across cluster]"). A block still open at the end of a batch waits for the rest of it from the same process, for
    `hold_s` at most, and is then printed as it came; at the driver's exit, whatever is still held is printed.

    The hold is 10 s, was 3: a worker that Ray is ending runs at nice 15, and on a loaded machine (a sweep of 3
    trials on 2 cores, load average ~10) one CI run printed a trial actor's whole SIGTERM block, with an empty line
    inside it. Either its end came more than 3 s after its start, or that empty line ended the block early
    (_drop_sigterm_exit_blocks now reads past one); both are handled."""

    def __init__(self, emit, hold_s: float = 10.0, timer=None):
        import threading

        self._emit = emit
        self._hold_s = hold_s
        self._timer = timer or threading.Timer  # (seconds, function, args=...) -> a started-later timer; tests inject
        self._held: dict[tuple, tuple[dict, list[str], object]] = {}
        self._lock = threading.Lock()
        self.longtrain_quiet = True

    def flush(self) -> None:
        """Prints every block still held, as it came (at the driver's exit)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for data, lines, timer in held:
            timer.cancel()
            self._emit({**data, "lines": lines})

    def _release(self, source: tuple) -> None:
        with self._lock:
            held = self._held.pop(source, None)
        if held is not None:
            self._emit({**held[0], "lines": held[1]})

    def __call__(self, data: dict) -> None:
        source = (data.get("ip"), data.get("pid"), data.get("is_err"))
        lines = list(data.get("lines") or [])
        with self._lock:
            held = self._held.pop(source, None)
        if held is not None:
            held[2].cancel()
            lines = held[1] + lines
        harmless = _HARMLESS_GCS_LINES if data.get("pid") == "gcs_server" else _HARMLESS_WORKER_LINES
        lines = [ln for ln in lines if not any(h in ln for h in harmless)]
        if any(ln.startswith("Exception ignored in") for ln in lines):
            lines, still_open = _drop_sigterm_exit_blocks(lines)
            if still_open:
                timer = self._timer(self._hold_s, self._release, args=(source,))
                timer.daemon = True
                with self._lock:
                    self._held[source] = (data, still_open, timer)
                timer.start()
        if lines or not data.get("lines"):
            self._emit({**data, "lines": lines})


def quiet_forwarded_ray_lines() -> None:
    """In the driver, before or once Ray is connected: the harmless GCS and worker lines above, and a worker's
    SystemExit from Ray's SIGTERM handler as it ends (_drop_sigterm_exit_blocks), stay in Ray's log files
    (gcs_server.err, worker-*.err), off the console. Every batch of lines Ray forwards to the driver passes through
    its one dispatcher (ray._private.ray_logging.global_worker_stdstream_dispatcher) before its deduplicator and
    printer; the wrapper there drops those lines and passes everything else on unchanged."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    if getattr(dispatcher.emit, "longtrain_quiet", False):
        return
    import atexit

    dispatcher.emit = _ForwardedLineFilter(dispatcher.emit)
    atexit.register(dispatcher.emit.flush)


def quiet_ray_train_worker() -> None:
    """In a Ray Train worker: Ray Train's own INFO lines stay in its log files, off the console."""
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _DropRayTrainInfo) for f in handler.filters):
            handler.addFilter(_DropRayTrainInfo())
    for name in ("ray.train", "ray", ""):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropPlannedStopTraceback) for f in handler.filters):
                handler.addFilter(_DropPlannedStopTraceback())
            if not any(isinstance(f, _StorageErrorInOneLine) for f in handler.filters):
                handler.addFilter(_StorageErrorInOneLine())
    quiet_safe_to_ignore()


def quiet_mlflow() -> None:
    """MLflow's system-metrics monitor announces every start and stop at INFO, and a new local store announces
    its tables being created; keep their warnings only."""
    for name in ("mlflow.system_metrics", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
