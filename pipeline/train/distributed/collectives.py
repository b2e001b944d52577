"""A collective that never completes becomes one line naming the rank, the step and the collective.

    watch = CollectiveWatch(rank, world_size, timeout_s=cfg.train.collective_timeout_s, backend="gloo")
    with watch.region("the gradient all-reduce", step=engine.step + 1):
        engine.train_step(micro)

Every rank runs the same collectives in the same order: the gradient all-reduce (DDP) or FSDP's all-gathers and
reduce-scatters inside a step, the metric all-reduces at log steps, the stop poll, evaluation, and a checkpoint.
When one rank does not (a bug, or a rank stuck elsewhere), the others wait for it. The process group's timeout
(`train.collective_timeout_s`: Ray Train's TorchConfig, and pipeline/train/distributed/process_group.py for Ray-free groups)
bounds that wait: gloo then raises in the waiting rank, and NCCL's watchdog aborts the communicator and ends the
process. The training loop (pipeline/train/loop.py) marks which collective-bearing region each rank is in, so:

- an error torch.distributed raises inside a region becomes CollectiveTimeoutError, whose message is the one line
  (Ray Train ends the attempt on it, and its failure handling takes over; the driver prints the line);
- a watchdog thread prints that line itself when a region outlives the timeout under NCCL, where the process may
  be killed before Python sees an exception.
"""
from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from typing import Iterator

# What torch.distributed's backends say when a collective fails: gloo's "Timed out waiting 5000ms for recv",
# "Connection closed by peer", NCCL's DistBackendError, c10d's store errors.
_COLLECTIVE_FAILURE = re.compile(r"gloo|nccl|c10d|ProcessGroup|timed out|Connection (closed|reset|refused)", re.I)
_WATCHDOG_POLL_S = 0.5


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete on this rank (another rank did not join it, or left); the message is one line
    naming the rank, the step, the collective and the fix."""


def is_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and bool(_COLLECTIVE_FAILURE.search(str(exc)))


class CollectiveWatch:
    """Tracks the collective-bearing region this rank is in (one at a time, nested regions restore the outer one).

    A no-op without a process group of more than one rank. timeout_s: the process group's timeout, for the
    message and the watchdog; backend: "nccl" starts the watchdog thread (gloo raises by itself)."""

    # The regions' clock (seconds, monotonic). tests/pipeline/train/test_collectives.py drives one of its own, and
    # counts the watchdog's looks (`looks`), to check when the watchdog speaks without waiting on real time.
    clock = staticmethod(time.monotonic)

    def __init__(self, rank: int, world_size: int, timeout_s: float, backend: str | None = None):
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.active = world_size > 1
        self.looks = 0  # the watchdog's checks so far
        self._region: tuple[str, int, float] | None = None  # (what, step, monotonic start)
        self._reported: tuple[str, int, float] | None = None
        self._stop = threading.Event()
        self._thread = None
        if self.active and backend == "nccl":
            self._thread = threading.Thread(target=self._watchdog, name="collective-watchdog", daemon=True)
            self._thread.start()

    @classmethod
    def for_engine(cls, engine) -> "CollectiveWatch":
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        return cls(engine.rank, engine.world_size if backend else 1, engine.cfg.train.collective_timeout_s, backend)

    def line(self, what: str, step: int, cause: BaseException | None = None) -> str:
        where = f"rank {self.rank} of {self.world_size}: step {step}: {what}"
        text = str(cause or "")
        if cause is None or re.search(r"timed out", text, re.I):
            return (f"{where} did not complete within {self.timeout_s:g} s: another rank did not join it (every rank "
                    f"must run the same collectives in the same order; a rank that crashed or hangs elsewhere says "
                    f"so in its own log). If a step may legitimately take longer, raise train.collective_timeout_s")
        first = text.strip().splitlines()[0] if text.strip() else type(cause).__name__
        return f"{where} failed: {first[:300]} (another rank failed or left the process group; see its own log)"

    @contextlib.contextmanager
    def region(self, what: str, step: int) -> Iterator[None]:
        """Mark `what` (the collective, in words) at `step` as in progress on this rank."""
        if not self.active:
            yield
            return
        outer, self._region = self._region, (what, step, self.clock())
        try:
            yield
        except CollectiveTimeoutError:
            raise
        except Exception as exc:
            if is_collective_failure(exc):
                raise CollectiveTimeoutError(self.line(what, step, exc)) from None
            raise
        finally:
            self._region = outer

    def _watchdog(self) -> None:
        # NCCL ends the process at the timeout; print a moment before, once per region.
        lead = min(5.0, 0.1 * self.timeout_s)
        while not self._stop.wait(_WATCHDOG_POLL_S):
            region = self._region
            if region is not None and region is not self._reported \
                    and self.clock() - region[2] >= self.timeout_s - lead:
                self._reported = region
                print(f"error: {self.line(region[0], region[1])}", file=sys.stderr, flush=True)
            self.looks += 1

    def close(self) -> None:
        self._stop.set()
