"""How many CPUs (and so torch threads) a Ray Train worker reserves: `ray.cpus_per_worker`, auto by default."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.ray_runtime import joins_cluster, worker_cpus


@pytest.fixture
def cores(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("pipeline.ray_runtime.os.cpu_count", lambda: 16)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    return 16


def test_auto_splits_the_local_cores_among_cpu_workers(cores):
    assert worker_cpus(load_config("cpu")) == cores  # one worker: the whole machine, as --no-ray would use
    assert worker_cpus(load_config("cpu", {"ray.num_workers": 4})) == 4
    assert worker_cpus(load_config("cpu", {"ray.num_workers": 32})) == 1  # never 0


def test_auto_is_one_cpu_with_gpus_or_on_a_joined_cluster(cores, monkeypatch):
    assert worker_cpus(load_config("cpu", {"ray.use_gpu": "true"})) == 1
    assert worker_cpus(load_config("cpu", {"ray.address": "auto"})) == 1
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert worker_cpus(load_config("cpu")) == 1  # use_gpu=auto with CUDA present
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # inside `ray job submit`
    assert joins_cluster(None) and worker_cpus(load_config("cpu")) == 1


def test_an_explicit_count_is_kept_and_negative_is_refused(cores):
    assert worker_cpus(load_config("cpu", {"ray.cpus_per_worker": 3, "ray.use_gpu": "true"})) == 3
    with pytest.raises(ConfigError, match="ray.cpus_per_worker"):
        load_config("cpu", {"ray.cpus_per_worker": -1})


def test_a_ray_without_its_dashboard_packages_starts_without_the_dashboard(monkeypatch, capsys):
    """ray installed without the `default` extra: the local Ray starts with no dashboard and says how to get
    one, instead of failing in ray.init with "Cannot include dashboard with missing packages"."""
    import sys

    import ray

    from pipeline import ray_runtime

    calls = []
    monkeypatch.setitem(sys.modules, "ray.dashboard.optional_deps", None)  # import raises ImportError
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    assert ray_runtime.start_local_ray(5) == ""
    assert calls == [{"num_cpus": 5, "include_dashboard": False, "logging_level": 30,
                      "_system_config": {"prestart_worker_first_driver": False}}]
    out = capsys.readouterr().out
    assert "5 logical CPUs; no dashboard" in out and "pip install 'ray[default]'" in out


def test_the_local_ray_serves_its_state_api_and_prestarts_no_idle_workers(monkeypatch, capsys):
    """What ray.init is given for the local instance: the dashboard on 127.0.0.1, every process told where its
    state API is, and no idle worker process prestarted per logical CPU (Ray's default for the first driver)."""
    import ray

    from pipeline import ray_runtime

    calls = []
    monkeypatch.setenv(ray_runtime.API_SERVER_ENV, "http://elsewhere:1")  # this process's own, kept
    # The raylet that ray.init starts inherits the environment it sees (and hands it to every worker it starts).
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append((kw, os.environ[ray_runtime.API_SERVER_ENV])))
    api = ray_runtime.start_local_ray(5)
    assert api.startswith("http://127.0.0.1:")
    ((kw, api_seen),) = calls
    assert kw["include_dashboard"] is True and kw["dashboard_host"] == "127.0.0.1" and kw["num_cpus"] == 5
    assert api_seen == api and os.environ[ray_runtime.API_SERVER_ENV] == "http://elsewhere:1"
    assert "runtime_env" not in kw  # a job runtime_env would start each worker through Ray's setup_worker.py
    assert kw["_system_config"] == {"prestart_worker_first_driver": False}
    assert f"dashboard at {api}" in capsys.readouterr().out


def test_a_local_ray_started_with_sigint_ignored_gives_its_processes_sigint_handled(monkeypatch, capsys):
    """A command a script starts in the background (`cmd &`) begins with SIGINT ignored, and the processes of a local
    Ray would inherit that: while ray.init starts them, SIGINT is handled in the starting process (so an exec'd Ray
    process starts at SIG_DFL), and ignored again afterwards, as the caller had it."""
    import signal

    import ray

    from pipeline import ray_runtime

    def callers_own(signum, frame) -> None:
        pass

    seen = []
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(signal.getsignal(signal.SIGINT)))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ray_runtime.start_local_ray(3)
        after = signal.getsignal(signal.SIGINT)
        assert seen == [signal.default_int_handler] and after is signal.SIG_IGN
        seen.clear()
        # a handler the caller set is left alone (one of the test's own: pytest itself may have been started as a
        # background job, with SIGINT ignored)
        signal.signal(signal.SIGINT, callers_own)
        ray_runtime.start_local_ray(3)
        assert seen == [callers_own] and signal.getsignal(signal.SIGINT) is callers_own
    finally:
        signal.signal(signal.SIGINT, before)
    assert "3 logical CPUs" in capsys.readouterr().out


def test_workers_of_every_job_find_the_local_rays_state_api(ray_session, ray_address):
    """The session's Ray is started as the CLI starts it (tests/conftest.py): a worker process of this job, and
    one of a job that joins it from another process, know where the dashboard's state API is, with no job
    runtime_env (which would start every worker process through Ray's setup_worker.py)."""
    import subprocess
    import sys

    from ray.util.state import list_nodes

    from pipeline.ray_runtime import API_SERVER_ENV

    @ray_session.remote
    def probe() -> tuple[str | None, str]:
        return os.environ.get(API_SERVER_ENV), ray_session.get_runtime_context().get_runtime_env_string()

    api, runtime_env = ray_session.get(probe.remote())
    assert api and api.startswith("http://127.0.0.1:") and runtime_env in ("", "{}")
    assert len(list_nodes(address=api)) == 1  # the state API answers there, as Ray Train's cleaner asks it
    joined = subprocess.run(
        [sys.executable, "-c", "import os, ray; ray.init(address=os.environ['ADDR'], logging_level='ERROR'); "
         f"print(ray.get(ray.remote(lambda: os.environ.get({API_SERVER_ENV!r})).remote()))"],
        env={**os.environ, "ADDR": ray_address}, capture_output=True, text=True, timeout=120)
    assert joined.returncode == 0, joined.stderr[-2000:]
    assert joined.stdout.strip().splitlines()[-1] == api


class _SlowFinalizer:
    def __init__(self, entered: str):
        self.entered = entered  # a file written once the finalizer runs

    def __del__(self):
        import time

        open(self.entered, "w").close()
        deadline = time.monotonic() + 300  # the test's SIGTERM comes while the main thread is in here
        while time.monotonic() < deadline:
            time.sleep(0.05)


FINALIZER_LEFT = "the finalizer was left"  # the worker's stderr line after the block Python printed


def test_a_worker_ending_by_sigterm_in_a_finalizer_prints_no_traceback(ray_session, capsys, tmp_path):
    """The raylet ends a worker (a Tune trial's actor as its trial ends) with SIGTERM to its process group; Ray's handler
    raises SystemExit(1) in the main thread, and where that thread is in a finalizer Python prints "Exception ignored
    in: ... SystemExit: 1". The driver's console drops that block (pipeline/console.py) and keeps a worker's other
    "Exception ignored" blocks. The worker writes a line of its own after the block, and the test reads the console
    until that line has come: every line before it has come too (Ray forwards a worker's lines in order)."""
    import signal
    import time

    from pipeline.ray_runtime import ensure_ray

    ensure_ray()  # the driver's console filters, on the session's Ray

    @ray_session.remote(num_cpus=0)
    class Ending:
        def pid(self) -> int:
            return os.getpid()

        def real_unraisable(self) -> None:
            import sys

            # what Python prints for any other exception in a finalizer: kept
            print("Exception ignored in: <function Cache.__del__>\nTraceback (most recent call last):\n"
                  '  File "cache.py", line 9, in __del__\nValueError: closed twice', file=sys.stderr, flush=True)

        def finalize(self, entered: str) -> None:
            import sys

            x = _SlowFinalizer(entered)
            del x  # the main thread sits in __del__ until the SIGTERM's SystemExit ends it
            print(FINALIZER_LEFT, file=sys.stderr, flush=True)

    actor = Ending.remote()
    pid = ray_session.get(actor.pid.remote())
    ray_session.get(actor.real_unraisable.remote())
    entered = tmp_path / "in_finalizer"
    left = actor.finalize.remote(str(entered))
    deadline = time.monotonic() + 300  # bounds on a hang only
    while not entered.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entered.exists()
    os.kill(pid, signal.SIGTERM)  # as the raylet ends a worker: SystemExit(1) raised inside __del__
    ray_session.get(left, timeout=300)  # the method went on past the finalizer and returned
    console = ""
    while time.monotonic() < deadline and FINALIZER_LEFT not in console:
        time.sleep(0.1)
        captured = capsys.readouterr()
        console += captured.out + captured.err
    assert FINALIZER_LEFT in console, console
    assert "ValueError: closed twice" in console and "Exception ignored in: <function Cache.__del__>" in console
    assert "SystemExit" not in console and "sigterm_handler" not in console, console
    # ... while the worker did print the block: it is in the worker's own log file, left there
    logs = Path(ray_session._private.worker._global_node.get_logs_dir_path())
    (worker_err,) = logs.glob(f"worker-*-{pid}.err")
    text = worker_err.read_text()
    assert "SystemExit" in text and text.index("SystemExit") < text.index(FINALIZER_LEFT), text[-3000:]
