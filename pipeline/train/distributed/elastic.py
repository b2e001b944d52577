"""Elastic Ray Train runs: a worker range that survives lost nodes, preemption notices, and what a resize cost.

    python pipeline/run.py train --ray.num_workers=2-8      # from 2 up to 8 workers (ray.min_workers=2, num_workers=8)

Ray Train v2 runs `ScalingConfig(num_workers=(MIN, MAX))` elastic: an attempt starts with as many workers as the
cluster has resources for, between MIN and MAX; when a worker's node is lost the attempt fails and the next one
starts on what is left (at least MIN, else it waits for resources), from the latest checkpoint; while it runs, Ray
checks every `ray.resize_check_s` seconds whether more workers would fit (nodes came back, the autoscaler added
some) and restarts the group larger from the latest checkpoint.

The same training across a resize (this module and pipeline/train/ray_train.py):
  - tokens per optimizer step stay constant: the global batch is train.batch_size x train.grad_accum x MAX
    sequences, and each attempt's workers accumulate grad_accum x MAX / world micro-batches (`at_world_size`);
    pipeline/config.py refuses a range with a count that cannot keep it, listing the counts that can;
  - the data cursor counts global sequences and the order is a function of (seed, epoch), so every row is read once
    per epoch whatever the worker counts; the LR schedule continues by step; DDP (full) and FSDP (sharded)
    checkpoints both load on another worker count (pipeline/train/checkpoints/state.py);
  - rank 0 says what changed and why (`event_lines`), logs `train/world_size` at every log step, and on a resume
    the steps redone since the last step any worker logged and the seconds from that step to the first new one
    (`train/steps_redone`, `train/resume_s`), from a small progress record in the run's storage.

Preemption: a SIGTERM to a worker (as a machine being shut down sends it) or Ray draining a worker's node
(`ray drain-node --reason=DRAIN_NODE_REASON_PREEMPTION`, the way Ray's autoscaler and cloud integrations announce
a spot reclaim, seen through Ray Train's preemption watcher) makes every worker checkpoint at the next step
boundary and end the attempt with PreemptionStop; Ray Train then starts the next one on the nodes that remain.

Multi-node process groups on hosts whose hostname resolves to a loopback address: each worker binds Gloo/NCCL to
the interface holding its Ray node IP before the group starts (pipeline/train/distributed/node_network.py).
"""
from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import threading
import math
import time
from dataclasses import dataclass
from typing import Any

from ray.train.torch.config import TorchConfig, _TorchBackend
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
from ray.train.v2._internal.execution.callback import ControllerCallback

from pipeline.config import Config
from pipeline.tracking.names import TRAIN_RESUME_S, TRAIN_STEPS_REDONE, TRAIN_WORLD_SIZE

PROGRESS_FILE = "progress.json"  # <run storage>/progress.json: rank 0's last logged step, for the lost work
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Stable MLflow metric names, listed in pipeline/tracking/names.py.
WORLD_SIZE, STEPS_REDONE, RESUME_S = TRAIN_WORLD_SIZE, TRAIN_STEPS_REDONE, TRAIN_RESUME_S


class PreemptionStop(RuntimeError):
    """Raised in every worker after the checkpoint a preemption notice asked for: the attempt ends, and Ray Train
    starts the next one (from that checkpoint) on the nodes that remain. Its message is `<notice>; checkpointed step
    N` + PREEMPTION_STOP_END; Ray Train's controller says it on the console (ElasticEvents)."""


PREEMPTION_STOP_END = ", stopping this attempt"


# ------------------------------------------------------------------------------------------ the worker count
def worker_count(cfg: Config) -> int | tuple[int, int]:
    """ScalingConfig(num_workers=...): (MIN, MAX) for an elastic range, else the fixed count."""
    r = cfg.ray
    return (r.min_workers, r.num_workers) if r.min_workers else r.num_workers


def at_world_size(cfg: Config, world: int) -> Config:
    """The config one attempt's workers train with: grad_accum re-derived so that `world` workers take the global
    batch of ray.num_workers workers (train.batch_size x train.grad_accum x ray.num_workers sequences per step, over
    train.context_parallel_degree: a context group shares its rows), and ray.num_workers = world (that is what this
    attempt runs). pipeline/config.py already refused any count of the range that cannot keep the global batch, and
    `keeping_context_groups` starts only whole context groups."""
    r, t = cfg.ray, cfg.train
    if world == r.num_workers:
        return cfg
    cp = t.context_parallel_degree
    per_step = t.grad_accum * (r.num_workers // cp)  # micro-batches per step over all data ranks
    if world % (cp * t.expert_parallel_degree) or per_step % (world // cp):  # whole context and expert groups
        raise ValueError(f"{world} workers cannot keep the global batch of {t.batch_size * per_step} sequences "
                         f"(ray.num_workers={r.num_workers}, train.grad_accum={t.grad_accum}, "
                         f"train.context_parallel_degree={cp}, train.expert_parallel_degree="
                         f"{t.expert_parallel_degree})")
    return cfg.replace({"ray.min_workers": 0, "ray.num_workers": world,
                        "train.grad_accum": per_step // (world // cp)})


class WholeContextGroups(ElasticScalingPolicy):
    """Ray Train's elastic policy, starting or resizing to whole context groups only: the workers it counts room for,
    rounded down to a multiple of the context-parallel degree (below ray.min_workers it waits, as Ray's does). With
    split experts `degree` is the context degree x the expert-parallel degree (pipeline/config.py worker_group):
    whole expert groups, each holding every expert once."""

    def __init__(self, scaling_config, degree: int):
        super().__init__(scaling_config)
        self.degree = degree

    def _count_possible_workers(self, reserved_resources) -> int:
        n = super()._count_possible_workers(reserved_resources)
        return n - n % self.degree


@functools.cache
def keeping_context_groups(base: type, degree: int) -> type:
    """`base` (a TorchTrainer class) whose elastic scaling policy is WholeContextGroups(degree); `base` itself for
    degree 1 (or a fixed worker count, which pipeline/config.py checked)."""
    if degree == 1:
        return base

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if self.scaling_config.elasticity_enabled:
            controller_init_kwargs["scaling_policy"] = WholeContextGroups(self.scaling_config, degree)
        return base._initialize_and_run_controller(self, **controller_init_kwargs)

    return type(base.__name__, (base,), {"_initialize_and_run_controller": _initialize_and_run_controller,
                                         "__module__": __name__})


# ------------------------------------------------------------------------------------------ preemption notices
class PreemptionNotice:
    """A worker's preemption notices, one callable for StopRequest: a SIGTERM this worker process received, and
    (when Ray Train's preemption watcher runs) Ray draining a node of the group. Call it at the same steps on every
    rank: Ray's drain information comes through a Ray Train collective."""

    def __init__(self) -> None:
        self.signal_reason: str | None = None
        self.watch_drains = False
        self.training = False  # set while the training loop runs; a SIGTERM outside it ends the process as before
        self._previous: Any = None

    def install(self) -> None:
        """On the worker process's main thread (where Python runs signal handlers): SIGTERM during training becomes
        a notice instead of Ray's default of exiting the process at once."""
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            if previous is not self._on_sigterm:
                self._previous = previous
        self.watch_drains = os.environ.get(PREEMPTION_WATCHER_ENV, "1") not in ("0", "false", "False")

    def _on_sigterm(self, signum, frame) -> None:
        if not self.training and callable(self._previous):  # Ray stopping an idle worker: its own handler
            self._previous(signum, frame)
            return
        self.signal_reason = f"SIGTERM to the worker on {socket.gethostname()} (pid {os.getpid()})"

    def __call__(self) -> str | None:
        drain = None
        if self.watch_drains:
            import ray.train

            info = ray.train.get_preemption_info()
            if info is not None:
                nodes = ", ".join(n[:12] for n in info.preempted_node_ids)
                drain = f"Ray is draining node(s) {nodes} for preemption (ranks {info.preempted_ranks})"
        return self.signal_reason or drain


NOTICE = PreemptionNotice()  # this worker process's; installed by the backend before the process group starts
_EVENT: dict[str, Any] = {}  # this worker process's: why its attempt started (set by the backend, read by rank 0)


def _setup_worker(event: dict[str, Any]) -> None:
    """On every worker's main thread before its process group starts: bind the group to the node's interface where
    the hostname is loopback, take SIGTERM as a preemption notice, and keep why this attempt started."""
    import ray

    from pipeline.train.distributed.node_network import bind_process_group

    bind_process_group(ray.util.get_node_ip_address())
    NOTICE.signal_reason = None
    NOTICE.install()
    _EVENT.clear()
    _EVENT.update(event)


def raise_setup_error(exc: BaseException) -> None:
    """On the driver: when Ray Train failed because a worker's set-up refused its node (ProcessGroupNetworkError,
    raised inside Ray's worker group start), raise that one line instead of Ray's wrapped traceback."""
    from pipeline.ray_runtime import find_cause
    from pipeline.train.distributed.node_network import ProcessGroupNetworkError

    found = find_cause(exc, lambda e: isinstance(e, ProcessGroupNetworkError))
    if found is not None:
        original = getattr(found, "cause", None) or found  # Ray's RayTaskError keeps the worker's own exception
        raise ProcessGroupNetworkError(str(original).strip().splitlines()[-1]) from None


class _WorkerSetupBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config) -> None:
        worker_group.execute(_setup_worker, dict(_PENDING))
        _PENDING.clear()
        super().on_start(worker_group, backend_config)


@dataclass
class WorkerSetupTorchConfig(TorchConfig):
    """TorchConfig whose backend sets each worker up (`_setup_worker`) before the process group starts."""

    @property
    def backend_cls(self):
        return _WorkerSetupBackend


def torch_config(timeout_s: float = 1800) -> WorkerSetupTorchConfig:
    """`timeout_s` bounds every collective's wait (gloo and NCCL): a rank that never joins one ends the attempt with
    one line instead of a silent hang (train.collective_timeout_s, pipeline/train/distributed/collectives.py)."""
    return WorkerSetupTorchConfig(timeout_s=math.ceil(timeout_s))


# ------------------------------------------------------------------------------------------ why a group changed
# Ray Train's controller process: why the next attempt starts, from ElasticEvents to _WorkerSetupBackend (both run
# there; the callback itself arrives as a copy, so they share this module's state, not an object).
_PENDING: dict[str, Any] = {}


class ElasticEvents(ControllerCallback):
    """In Ray Train's controller: remembers why the next attempt starts (the failure that ended the last running
    group, or a resize check that found room for more workers) for `_WorkerSetupBackend` to hand to the workers,
    whose rank 0 says it; and after a failure, refreshes the cluster view the next attempt is sized from."""

    def __init__(self, resize_check_s: float | None = None) -> None:
        self.size: int | None = None  # workers of the group that ran last
        self.requester: str | None = None
        self.resize_check_s = resize_check_s  # None: a fixed worker count, whose policy sizes nothing
        self._refreshed = time.monotonic()

    def after_controller_start(self, train_run_context) -> None:
        if self.resize_check_s is not None:  # how Ray Train's elastic policy names its requests
            self.requester = f"train-{train_run_context.run_id}"

    def after_controller_state_update(self, previous_state, current_state) -> None:
        name = type(current_state).__name__
        if name in ("RestartingState", "ReschedulingState"):
            if "why" not in _PENDING:  # the first failure since a group ran, not a failed start after it
                error = getattr(current_state, "training_failed_error", None)
                _PENDING.update(why=describe_failure(error), before=self.size)
                notice = preemption_notice(error)
                if notice:  # said here: the ending attempt's workers are torn down as soon as one of them raises
                    say(f"preemption: {notice}, this attempt stops and the next starts on the nodes that remain")
            _refresh_reservations(self.requester)
        elif name == "ResizingState":
            n = current_state.scaling_decision.num_workers
            _PENDING.update(why=f"a resize check found resources for {n} workers (nodes joined the cluster)"
                                if self.size is None or n > self.size else
                                f"a resize check found resources for only {n} workers", before=self.size)
        elif name == "RunningState" and type(previous_state).__name__ == "SchedulingState":
            self.size = previous_state.scaling_decision.num_workers
            _PENDING.clear()  # the workers have it
        elif (name == "RunningState" and self.requester is not None
              and time.monotonic() - self._refreshed >= self.resize_check_s):
            # The elastic policy's next resize check sees nodes that joined since the last one, not since the
            # coordinator's last tick.
            self._refreshed = time.monotonic()
            _refresh_reservations(self.requester)


def _refresh_reservations(requester: str | None) -> None:
    """Best effort: make Ray's autoscaling coordinator, whose per-node view Ray Train's elastic policy sizes the
    worker group from, look at the cluster now instead of at its next tick (every 20 s). Without it, right after a
    node is lost the next attempt may still count the dead node's resources, ask for too many workers and spend a
    whole start timeout (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S) before the count is right; and a node that joined
    waits for a tick on top of the resize check."""
    if requester is None:
        return
    try:
        import ray
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)

        ray.get(get_or_create_autoscaling_coordinator().get_reserved_resources.remote(requester, recompute=True),
                timeout=10)
    except Exception:  # noqa: BLE001 -- an older or newer Ray without it: the coordinator's own tick catches up
        pass


_LOST = ("ActorDied", "ActorUnavailable", "NodeDied", "WorkerCrashed", "HealthCheck", "OwnerDied")


def describe_failure(error: BaseException | None) -> str:
    """One line on why an attempt ended: a preemption notice, a worker whose node was lost, or the first error."""
    if error is None:
        return "the previous attempt ended"
    notice = preemption_notice(error)
    if notice:
        return f"a preemption notice: {notice}, stopping this attempt"
    failures = dict(sorted((getattr(error, "worker_failures", None) or {}).items()))
    for rank, e in failures.items():
        inner = getattr(e, "health_check_failure", None) or e  # a failed poll of a worker wraps why it failed
        text = f"{e}\n{inner}"
        if any(w in type(e).__name__ + type(inner).__name__ for w in _LOST) or "node has died" in text:
            ip = re.search(r"\bip: ([0-9A-Fa-f.:]+)", text)
            node = next((ln.strip() for ln in text.splitlines() if "node" in ln and ("died" in ln or "terminated" in ln)
                         ), _first_line(inner))
            return f"rank {rank}'s worker{f' on {ip.group(1)}' if ip else ''} was lost: {node[:200]}"
    if failures:
        rank, e = next(iter(failures.items()))
        return f"rank {rank} failed: {_first_line(e)[:200]}"
    if type(error).__name__ == "PreemptionError":
        return f"Ray preempted node(s) of the group: {_first_line(error)[:200]}"
    return _first_line(getattr(error, "controller_failure", None) or error)[:200]


def preemption_notice(error: BaseException | None) -> str | None:
    """What the PreemptionStop that ended an attempt says (`rank 1: SIGTERM to the worker on lt-h2 (pid 501);
    checkpointed step 11`), from the lowest rank that raised one; None when no rank did."""
    failures = dict(sorted((getattr(error, "worker_failures", None) or {}).items()))
    for e in failures.values():
        text = str(e)
        if type(e).__name__ == "PreemptionStop" or "PreemptionStop" in text:
            return text.split("PreemptionStop: ")[-1].strip().splitlines()[0].removesuffix(PREEMPTION_STOP_END)
    return None


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    return first if first.startswith(type(e).__name__) else f"{type(e).__name__}: {first}"


def wait_for_checkpoint(timeout_s: float = 300.0) -> None:
    """In every worker after the checkpoint a preemption notice asked for: return once Ray Train has committed it.
    The controller ends an attempt at the first worker error it sees, and a report still in flight then would be
    dropped: the next attempt would resume from the checkpoint before, redoing the steps between."""
    import ray.train

    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED,
                                           timeout_s=timeout_s)


# ------------------------------------------------------------------------------------------ lost work, rank 0
class ResumeReport:
    """Rank 0: the progress record at each log step, and on an attempt's start what changed since the last one."""

    def __init__(self, run_storage: str, phase: int) -> None:
        from pipeline.storage import join

        self.path = join(run_storage, PROGRESS_FILE)
        self.phase = phase
        self.last: dict[str, Any] | None = None  # the record the previous attempt left
        self.redone: int | None = None
        self._pending_resume = False
        from pipeline.tracking.deferred import DeferredArtifacts

        self._writer = DeferredArtifacts(0.0)  # _write_json rides out storage failures itself, and swallows them
        self.full: BaseException | None = None  # a write that found the disk full: raised at the next log step

    def start(self, engine, meta: dict[str, Any] | None) -> list[str]:
        """At the attempt's start, after the checkpoint (if any) was loaded: the lines to print."""
        self.last = _read_json(self.path)
        if self.last is not None and self.last.get("phase") != self.phase:
            self.last = None
        event = dict(_EVENT)
        lines = []
        # the size of the group that trained last: the one that logged the last step (an attempt that failed before
        # its first step does not count), else the checkpoint's writers
        before = (self.last or {}).get("world_size") or (meta or {}).get("world_size") or event.get("before")
        t = engine.cfg.train
        if before and before != engine.world_size:
            lines.append(f"elastic: the worker group {'shrank' if engine.world_size < before else 'grew'} from "
                         f"{before} to {engine.world_size} worker(s) at step {engine.step}: "
                         f"{event.get('why', 'a resumed run')}; train.grad_accum {t.grad_accum} keeps "
                         f"{t.batch_size * t.grad_accum * engine.data_world_size} sequences per step"
                         f"{'' if engine.mesh.degree == 1 else f' (context groups of {engine.mesh.degree} share their rows)'}")
        elif event.get("why"):
            lines.append(f"restart: {engine.world_size} worker(s) again at step {engine.step}: {event['why']}")
        if self.last is not None and meta is not None:
            self.redone = max(0, int(self.last["step"]) - engine.step)
            self._pending_resume = True
            lines.append(f"resume: from the checkpoint of step {engine.step}; the last step logged before was "
                         f"{self.last['step']} ({self.redone} step(s) to redo)")
        return lines

    def logged(self, engine, metrics: dict[str, float]) -> dict[str, float]:
        """At a log step: the progress record, and the metrics to log (train/world_size; after a resume, once, the
        steps redone and the seconds from the last logged step before it to this one)."""
        if self.full is not None:  # the run's storage is full: the run ends here with that line, not at a checkpoint
            raise self.full
        now = time.time()
        extra = {WORLD_SIZE: float(engine.world_size)}
        if self._pending_resume and self.last is not None:
            seconds = now - float(self.last["time"])
            extra.update({STEPS_REDONE: float(self.redone or 0), RESUME_S: seconds})
            say(f"resume: step {engine.step} done {seconds:.1f} s after step {self.last['step']} was logged before "
                f"the restart; {self.redone} step(s) redone")
            self._pending_resume = False
        # Written from a background thread, the newest record only: at every log step a synchronous upload (a
        # multipart PUT of 3 requests on S3) held up training by each request's latency, 2.6x the training time
        # with 50 ms per request (bench/storage_latency.py). A resume that finds the record one write behind reports
        # the lost work from that step instead: nothing else reads it.
        record = {"step": engine.step, "time": now, "world_size": engine.world_size, "phase": self.phase}
        self._writer.submit(PROGRESS_FILE, lambda: self._write(record), latest=True)
        return {**metrics, **extra}

    def _write(self, record: dict[str, Any]) -> None:
        from pipeline.disk_space import RUN_RECORD_FIX, disk_full_error, is_disk_full

        try:
            _write_json(self.path, record)
        except Exception as exc:  # noqa: BLE001 -- only a full disk gets here (_write_json swallows the rest)
            if not is_disk_full(exc):
                raise
            self.full = disk_full_error(self.path, "the run's progress record", RUN_RECORD_FIX, exc=exc)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait up to timeout_s for the last progress record to be written (at the end of an attempt that finished
        its steps); best effort, as every write of it."""
        self._writer.flush(timeout_s)


def say(line: str) -> None:
    """A console line from a worker, once (pipeline/console.py worker_print)."""
    from pipeline.console import worker_print

    worker_print(line)


def announce(lines: list[str], tracker) -> None:
    """Rank 0: the attempt's event lines on the console, and together as the run's MLflow tag."""
    for line in lines:
        say(line)
    if lines and tracker is not None:
        from pipeline.tracking.names import ELASTIC_TAG

        tracker.set_tags({ELASTIC_TAG: " | ".join(lines)[:5000]})


def _read_json(path: str) -> dict[str, Any] | None:
    from pipeline.storage import StorageError, read_bytes

    try:
        return json.loads(read_bytes(path))
    except (FileNotFoundError, StorageError, OSError, ValueError):
        return None


def _write_json(path: str, record: dict[str, Any]) -> None:
    """Best effort: a lost progress record costs the lost-work figures, never the run; a full disk is raised (the
    run's checkpoints would not fit either: ResumeReport ends the run with that line)."""
    from pipeline.disk_space import is_disk_full
    from pipeline.storage import StorageError, write_text

    try:
        write_text(path, json.dumps(record))
    except (StorageError, OSError) as exc:
        if is_disk_full(exc):
            raise
