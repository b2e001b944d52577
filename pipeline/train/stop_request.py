"""A request to checkpoint and stop after the current step: a Ctrl+C or SIGTERM in a plain process, a stop file the
driver creates for Ray Train workers, or a preemption notice; agreed by every rank at the same step. Ray-free.

    with StopRequest(stop_file="s3://b/run/STOP", notices=[elastic.NOTICE]) as stop:
        fit(engine, ..., stop=stop)           # pipeline/train/loop.py asks stop.boundary(...) at each step
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

import torch


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


def _stop_file_exists(location: str) -> bool:
    from pipeline import storage_faults
    from pipeline.storage import StorageError, exists

    try:
        with storage_faults.retry_window_of(0):  # one look, no waiting: training goes on while the store is away
            return exists(location)
    except (StorageError, OSError):  # a blip of the object store is not a stop request
        return False
