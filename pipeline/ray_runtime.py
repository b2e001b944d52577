"""Joining or starting Ray, the same way for every stage (prepare, train, tune).

    ensure_ray("auto")    # join the running cluster (also what `ray job submit` jobs do via RAY_ADDRESS)
    ensure_ray("")        # start a local Ray sized so Ray Data keeps CPUs while training workers hold theirs

A Ray Train worker gets `worker_cpus(cfg)` CPUs, and Ray sets its OMP_NUM_THREADS (so torch's thread
count) to that number: on CPU the machine's cores are split among the workers, not one core each.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from pipeline.config import Config

API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"  # where Ray's state API clients (Ray Train's cleaner) look first
# The local Ray does not prestart one idle worker process per logical CPU for its first driver (Ray's default):
# the job's tasks and actors start the processes they use, and the prestarted ones cost CPU while the run starts
# (measured on 2 cores: a local Ray and two short Ray Train runs, 101-110 -> 87-92 CPU-s, each run ~1 s faster).
# A copy per ray.init: Ray adds its own keys (the session's spilling directory) to the dict it is given.
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
# Ray Train's preemption watcher (an actor per Train run, ~2.5 CPU-s to start on 2 cores, and a Ray C++ log line on
# the console) watches for nodes being drained, which a local single-node Ray never is. Off there unless set.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Seconds a local Ray may take to start (its node registering with its GCS). Ray's own wait is a fixed 30 s
# (ray/_private/node.py raylet_start_wait_time_s, not a setting), which a busy machine overruns.
START_WAIT_ENV = "LONGTRAIN_RAY_START_WAIT_S"
DEFAULT_START_WAIT_S = 120.0
# Seconds ensure_ray waits for a named cluster's address to accept a connection (a head that is just starting)
# before it says that nothing is there; Ray itself would retry for minutes.
CONNECT_WAIT_S = 10.0


class RayStartError(RuntimeError):
    """Ray could not be joined or started: one line naming the address or the machine's state, and the fix."""


def ensure_ray(address: str | None = None, cfg: "Config | None" = None) -> None:
    """Connect once per process. `address` (e.g. "auto" or "ray://host:10001") or the RAY_ADDRESS that Ray
    jobs set means an existing cluster, whose resources are its own; otherwise a local instance with
    more logical CPUs than cores: `cfg`'s training workers take theirs (num_workers x worker_cpus), and
    Ray Data's read, tokenize and write tasks still get CPUs (on a 2-core machine, num_cpus=2 with two
    workers would hang)."""
    import ray

    from pipeline.console import quiet_forwarded_ray_lines

    # Ray's harmless lines off the console (pipeline/console.py), also where this process started Ray before
    quiet_forwarded_ray_lines()
    if ray.is_initialized():
        return
    if joins_cluster(address):
        address = address or os.environ["RAY_ADDRESS"]
        check_reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as exc:  # "auto" with no Ray running on this machine, among others
            said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RayStartError(f"could not join the Ray cluster at {address} (ray.address / --address / "
                                f"RAY_ADDRESS): {said}; start one with `ray start --head`, or leave ray.address "
                                f"empty for a local Ray") from None
        return
    train_cpus = cfg.ray.num_workers * worker_cpus(cfg) if cfg is not None else 1
    cpus = max((os.cpu_count() or 1) + 2, train_cpus + 4)
    start_local_ray(cpus, cfg.ray.dashboard_host if cfg is not None else "127.0.0.1")


def check_reachable(address: str, wait_s: float = CONNECT_WAIT_S) -> None:
    """RayStartError when nothing at `address` (host:port, or ray://host:port) accepts a TCP connection within
    `wait_s` seconds: Ray's own connect retries for minutes, printing the node's rewritten address, and does not
    end on SIGTERM. "auto" and other forms are left to Ray."""
    target = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or "/" in target:
        return
    host = host.strip("[]") or "127.0.0.1"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.5, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                said = exc.strerror or type(exc).__name__
                raise RayStartError(f"no Ray cluster answers at {address} (ray.address / --address / RAY_ADDRESS): "
                                    f"nothing accepted a connection there within {wait_s:g} s ({said}); start one "
                                    f"there (`ray start --head --port={port}` on {host}), give the address that "
                                    f"`ray start` printed, or leave ray.address empty for a local Ray") from None
        time.sleep(0.5)


def start_wait_s() -> float:
    """Seconds a local Ray may take to start: $LONGTRAIN_RAY_START_WAIT_S, else 120 (Ray's own 30 s at least)."""
    raw = os.environ.get(START_WAIT_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_START_WAIT_S
    except ValueError:
        raise RayStartError(f"{START_WAIT_ENV}={raw!r} is not a number of seconds; set it to e.g. 300") from None


@contextlib.contextmanager
def _node_start_wait(seconds: float) -> Iterator[None]:
    """While Ray starts: Ray polls its GCS for the new node for a fixed 30 s (ray/_private/node.py); each poll
    that finds no node yet is retried here until `seconds` have passed since the start, so the wait is
    max(30, seconds). Ray looks the function up on its module at every call."""
    from ray._private import services

    get_node, deadline = services.get_node, time.monotonic() + seconds

    def patient_get_node(*args, **kwargs):
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    services.get_node = patient_get_node
    try:
        yield
    finally:
        services.get_node = get_node


def _overloaded(exc: BaseException, waited_s: float) -> RayStartError | None:
    """The one line for Ray's start-up timeout ("The current node timed out during startup ... GCS has become
    overloaded"), or None for another error."""
    if "timed out during startup" not in str(exc):
        return None
    return RayStartError(f"the local Ray did not start within {waited_s:g} s: this machine is overloaded (Ray's node "
                         f"did not register with its GCS in time); give Ray more time with {START_WAIT_ENV}=300 "
                         f"(seconds, now {waited_s:g}), or run when the machine is less busy")


def start_local_ray(num_cpus: int, dashboard_host: str = "127.0.0.1") -> str:
    """A local Ray with its dashboard on `dashboard_host` (8265, or a free port when another Ray has it);
    returns the dashboard URL ("" when Ray was installed without its dashboard packages, ray[default]).

    The dashboard also serves Ray's state API, which Ray Train's placement-group cleaner polls to see
    whether a run's controller is gone. Without it, or when the cleaner auto-detects another Ray instance
    on the same machine, the cleaner fails and a finished run's placement group can outlive the run (on a
    one-GPU machine the next sweep trial then waits forever). So every worker process this Ray starts, for
    any job that joins it, is told where its state API is (RAY_API_SERVER_ADDRESS, inherited from the raylet)."""
    import ray

    with _sigint_for_ray_processes():
        return _start_local_ray(ray, num_cpus, dashboard_host)


@contextlib.contextmanager
def _sigint_for_ray_processes() -> Iterator[None]:
    """While Ray starts its processes: SIGINT handled, not ignored, in this process, so that they do not inherit it
    ignored. A job a shell script starts in the background (`cmd &`, `nohup cmd &`) begins with SIGINT ignored; the
    raylet would pass that on to every worker process it starts, and Ray's task cancellation (Ray Data cancels the
    tasks a `limit` no longer needs) then calls the ignored handler: an "Unhandled error ... TypeError: 'Handlers'
    object is not callable" on the console of a run that worked. This process's own handler is put back after."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if threading.current_thread() is not threading.main_thread() or not ignored:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)  # an exec'd child starts with it at SIG_DFL
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_local_ray(ray, num_cpus: int, dashboard_host: str) -> str:
    wait_s = max(30.0, start_wait_s())
    try:
        import ray.dashboard.optional_deps  # noqa: F401  (what ray[default] adds; Ray checks the same import)
    except ImportError as exc:
        # A minimal Ray (no `default` extra) cannot serve the dashboard: start without it rather than fail.
        try:
            with _node_start_wait(wait_s):
                ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                         _system_config=dict(LOCAL_SYSTEM_CONFIG))
        except Exception as start_exc:  # noqa: BLE001 -- Ray raises a bare Exception for its start-up timeout
            overloaded = _overloaded(start_exc, wait_s)
            if overloaded is None:
                raise
            ray.shutdown()
            raise overloaded from None
        print(f"ray: local instance with {num_cpus} logical CPUs; no dashboard ({exc.name or exc} is missing: "
              f"pip install 'ray[default]')", flush=True)
        return ""
    for attempt in range(3):
        # 8265 when free, else a free port; another Ray starting on this machine at the same moment can take
        # it between the check and the bind, so a failed start is retried on a port the OS hands out.
        port = _free_port(dashboard_host, preferred=8265 if attempt == 0 else 0)
        api = f"http://{'127.0.0.1' if dashboard_host in ('0.0.0.0', '::') else dashboard_host}:{port}"
        try:
            with _environ({API_SERVER_ENV: api, PREEMPTION_WATCHER_ENV: os.environ.get(PREEMPTION_WATCHER_ENV, "0")}), \
                    _node_start_wait(wait_s):
                ray.init(num_cpus=num_cpus, include_dashboard=True, dashboard_host=dashboard_host,
                         dashboard_port=port, logging_level=logging.WARNING, _system_config=dict(LOCAL_SYSTEM_CONFIG))
            break
        except Exception as exc:  # Ray raises a bare Exception/ValueError for a taken dashboard port
            overloaded = _overloaded(exc, wait_s)
            if overloaded is not None:
                ray.shutdown()
                raise overloaded from None
            taken = any(w in str(exc).lower() for w in ("occupied", "address already in use", "dashboard"))
            if not taken or attempt == 2:
                raise
            ray.shutdown()
    print(f"ray: local instance with {num_cpus} logical CPUs; dashboard at {api}", flush=True)
    return api


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment while Ray starts: the raylet inherits them and passes them on to
    every worker process it starts, of any job. Not a job runtime_env (env_vars): a job with a runtime_env has
    each of its worker processes started through Ray's setup_worker.py, one more Python start that imports
    part of Ray before it execs the worker (bench/worker_start.py, 2 cores: 8 worker processes in 8.0 s with it,
    5.0 s without). This process's own environment is left as it was."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _free_port(host: str, preferred: int = 8265) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in (preferred, 0):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port on {host}")


def joins_cluster(address: str | None = None) -> bool:
    """Whether ensure_ray(address) joins an existing cluster rather than starting a local Ray."""
    return bool(address or os.environ.get("RAY_ADDRESS"))


def use_gpu(cfg: "Config") -> bool:
    """Whether Ray Train workers (and the max-batch probe) take a GPU: `ray.use_gpu`, where auto means the
    connected cluster has at least one."""
    if cfg.ray.use_gpu == "auto":
        import ray

        return ray.cluster_resources().get("GPU", 0) >= 1
    return cfg.ray.use_gpu == "true"


def worker_cpus(cfg: "Config") -> int:
    """CPUs each Ray Train worker reserves (and so its torch threads): `ray.cpus_per_worker`, or for 0
    (auto) the local machine's cores split among the workers when training on CPU with a local Ray, and
    1 with GPUs (the GPU computes; Ray Data keeps the other CPUs) or on a joined cluster, whose nodes may
    differ from this one."""
    if cfg.ray.cpus_per_worker > 0:
        return cfg.ray.cpus_per_worker
    if joins_cluster(cfg.ray.address) or cfg.ray.use_gpu == "true":
        return 1
    if cfg.ray.use_gpu == "auto":
        import torch

        if torch.cuda.is_available():
            return 1
    return max(1, (os.cpu_count() or 1) // cfg.ray.num_workers)


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and every exception it wraps, each once.

    Ray wraps what a task or a Train worker raised (RayTaskError, TrainingFailedError with
    worker_failures, ControllerError); the chain followed here is __cause__, __context__, Ray's
    `cause`, and Ray Train's controller and worker failures, so a user-facing error, an OOM or a full
    disk raised deep inside a worker is still found."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__, getattr(e, "cause", None), getattr(e, "controller_failure", None),
                  *(getattr(e, "worker_failures", None) or {}).values()]


def find_cause(exc: BaseException | None, predicate) -> BaseException | None:
    """The first exception in `exc`'s chain (exception_chain) for which predicate(e) is true, or None."""
    return next((e for e in exception_chain(exc) if predicate(e)), None)


def workers_may_be_elsewhere(cfg: "Config") -> bool:
    """Whether Ray workers may run on another machine than this driver: a joined cluster with more than one
    node, or one whose GPUs (when the workers want one) are on no node yet (a CPU head whose GPU nodes the
    autoscaler starts on demand). Needs Ray connected."""
    import ray

    if not joins_cluster(cfg.ray.address):
        return False
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if len(alive) > 1:
        return True
    return use_gpu(cfg) and not any(n.get("Resources", {}).get("GPU", 0) for n in alive)


def require_shared(cfg: "Config", places: dict[str, str]) -> None:
    """StorageError when a place Ray workers open ({what: location}) is a bare path on this machine and the
    workers may run on other nodes: they would read another disk, or nothing."""
    from pipeline.storage import STORAGE_ENV, StorageError, is_uri

    local = {what: loc for what, loc in places.items() if loc and not is_uri(loc)}
    if not local or not workers_may_be_elsewhere(cfg):
        return
    what, loc = next(iter(local.items()))
    raise StorageError(f"{what} {loc} is on this machine's disk, but Ray workers run on other nodes of the cluster "
                       f"and cannot read it; set run.storage (or ${STORAGE_ENV}) to a bucket, e.g. "
                       f"s3://my-bucket/longtrain, so datasets, checkpoints and artifacts live in object storage (a "
                       f"filesystem mounted at the same path on every node: give it as file:///that/path)")
