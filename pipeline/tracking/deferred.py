"""MLflow artifacts that can wait (evaluation samples, the training curves): logged by a background thread, so an
object store that is away does not hold up training, and retried with capped exponential backoff while its failures
pass (outage, stall, 5xx), for run.storage_retry_s; `flush` at the end of the run waits for what is left.

    queue = DeferredArtifacts(window_s=300)
    queue.submit("samples/step_000040.txt", lambda: client.log_text(run_id, body, "samples/step_000040.txt"))
    queue.submit("progress.json", write_latest, latest=True)   # only the newest of these is written
    left = queue.flush(timeout_s=300)    # [] when everything was logged, else one line per artifact not logged

An upload whose failure does not pass (refused credentials, a bad request) is not retried: flush reports it.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from pipeline import storage_faults as faults


def failure_line(exc: BaseException) -> str:
    """One line for an artifact upload's failure (boto3's and MLflow's messages run to several)."""
    text = str(exc).strip() or type(exc).__name__
    kind = faults.kind(exc)
    first = text.splitlines()[0][:200]
    return f"{kind}: {first}" if kind else first


def upload_retrying(what: str, fn: Callable[[], object], window_s: float) -> None:
    """fn() (an artifact upload), retried while its failure passes, for window_s; after that, or at once for a
    failure that does not pass, a RuntimeError of one line naming the artifact (the caller decides whether the run
    may go on without it)."""
    try:
        faults.call(fn, window_s=window_s)
    except Exception as exc:  # noqa: BLE001 -- boto3, requests and MLflow each raise their own kinds
        waited = getattr(exc, "retried", None)
        extra = f" (retried for {waited[1]:.0f} s)" if waited else ""
        raise ArtifactError(f"{what} was not logged to MLflow: {failure_line(exc)}{extra}") from None


class ArtifactError(RuntimeError):
    """An artifact could not be logged; one line naming it and why."""


class DeferredArtifacts:
    """A background thread that logs the artifacts handed to `submit`, in order, each retried for `window_s`."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._queue: queue.Queue = queue.Queue()
        self._failed: list[str] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._latest: dict[str, Callable[[], object]] = {}  # what -> the newest fn of a `latest` submission waiting

    def submit(self, what: str, fn: Callable[[], object], *, latest: bool = False) -> None:
        """Queue fn (the upload of `what`). latest=True: a record rewritten in place (a progress file): a submission
        of the same `what` still waiting is replaced by this one, so a slow store delays the record but never lets
        a backlog of stale copies build up."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mlflow-deferred-artifacts", daemon=True)
                self._thread.start()
            if latest:
                waiting = what in self._latest
                self._latest[what] = fn
                if waiting:  # its queue entry, not yet taken, will run this fn
                    return
                fn = None
        self._queue.put((what, fn))

    def _run(self) -> None:
        while True:
            what, fn = self._queue.get()
            if fn is None:  # a `latest` entry: the newest fn submitted for it
                with self._lock:
                    fn = self._latest.pop(what)
            try:
                upload_retrying(what, fn, self.window_s)
            except ArtifactError as exc:
                self._failed.append(str(exc))
            finally:
                self._queue.task_done()

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def flush(self, timeout_s: float) -> list[str]:
        """Wait up to timeout_s for every submitted artifact; one line per artifact not logged (failed, or still
        waiting when the time ran out)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self._queue.unfinished_tasks
        out = list(self._failed)
        if left:
            out.append(f"{left} artifact(s) still waiting for storage after {timeout_s:.0f} s were not logged")
        self._failed.clear()
        return out
