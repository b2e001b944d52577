"""Shared test fixtures.

`mlflow_server`: ONE real MLflow server on 127.0.0.1 for the session (see the fixture).

`s3_bucket`: ONE real S3 server (SeaweedFS, bench/s3_server.py) on 127.0.0.1 for the session, started on first use
(or, on one pytest process, as the session begins when a collected test will use it: `started_early`). Its endpoint
and key are in this process's environment from the start (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...: the standard AWS
settings), so every Ray worker the session starts inherits them, as the nodes of a configured cluster have theirs.

`fault_proxy`: ONE fault-injecting TCP proxy (bench/fault_proxy.py) in front of the session's S3 server, healthy
until a test makes it misbehave; `through_proxy` points this process's S3 clients at it for one test and clears its
faults afterwards. A subprocess or Ray job reaches the bucket through it with `proxy_env(proxy)`.

`ray_session`: ONE Ray instance for the whole test session (starting Ray takes ~10 s on 2 cores). It
advertises 8 logical CPUs on purpose: with num_cpus=2, tokenizer actors or training workers take every
CPU and Ray Data's read tasks would wait forever. Tests that need Ray depend on this fixture and never call
ray.init/ray.shutdown themselves.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.fault_proxy import FaultProxy
from bench.s3_server import SeaweedS3, free_ports
from pipeline import storage
from pipeline.storage import STORAGE_ENV
from tests import file_order

# Before mlflow is imported anywhere in the test process: no telemetry from tests (there is no network either).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
# Before any Ray starts (the session's, or one a subprocess starts, inherits this environment): Ray Train's
# controller polls its workers every 0.5 s instead of 2 s. Reports, a run's end and a dead worker are noticed at
# a poll, so every Train run and Tune trial waited up to 2 s at each of those; the worker-kill test, which goes
# through two restarts, took 68 s instead of 48. Nothing a test checks depends on the interval (a slow poll keeps
# waiting: a worker is declared dead only after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S, 10 min).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Two Ray Train helpers no test looks at: the preemption watcher, an actor process per Train run and Tune trial
# (~2.5 CPU-s to start on 2 cores, then it polls Ray for node drains; these tests run on one machine that is
# never drained), and the Prometheus metrics of Ray Train's controller and workers. Runs outside the tests keep
# both. (On a whole Ray-path test the saving was within this VM's run-to-run noise.)
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")
# Every local Ray the tests start (the session's, and a command's in a subprocess) may take up to 10 minutes to
# register its node (pipeline/ray_runtime.py; 120 s for users): on a machine shared with other work the session's
# Ray once took longer than 120 s, and every test of a file then failed at set-up. A bound on a hang only;
# tests/pipeline/test_ray_start.py sets its own to test the line.
os.environ.setdefault("LONGTRAIN_RAY_START_WAIT_S", "600")
# Ray's housekeeping in every Ray the tests start (docs/tests.md, "What an idle Ray costs"). A task worker of the
# test process's own runs (an in-process prepare's Ray Data tasks) is ended after 60 s idle: Ray keeps up to one per
# logical CPU idle until the session's Ray ends (8 after a prepare, each ~1 % of a core for the rest of a 75-minute
# run); a run's own workers are still reused within a minute. The log monitor lists the log folder every 0.5 s instead
# of on every 0.1-s pass (it does below 1,000 files; a session's Ray writes ~500) and still reads its open files on
# every pass; the dashboard agent's node report and the dashboard's metrics every 60 s instead of 5 s; the agent's
# event-loop monitor every 5 s instead of 0.25 s. No test checks any of them.
for _name, _value in (("RAY_num_workers_soft_limit", "0"), ("RAY_idle_worker_killing_time_threshold_ms", "60000"),
                      ("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0"), ("REPORTER_UPDATE_INTERVAL_MS", "60000"),
                      ("METRICS_RECORD_INTERVAL_S", "60"), ("RAY_DASHBOARD_AGENT_LOOP_MONITOR_INTERVAL_S", "5")):
    os.environ.setdefault(_name, _value)

# The session's S3 server: its port is chosen now (outside the ephemeral range, so no outgoing connection takes it
# before the server binds it) and its settings exported before any Ray starts; the server starts on first use.
# Settings of a developer's own AWS or longtrain storage stay out of the tests.
for _name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", STORAGE_ENV):
    os.environ.pop(_name, None)
S3 = SeaweedS3(Path(tempfile.gettempdir()) / f"longtrain-s3-{os.getpid()}", port=free_ports(1, 20000, 32000)[0])
os.environ.update(S3.env)
S3_BUCKET = "longtrain-test"


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", metavar="PATH", default=None,
                     help="write each test file's seconds to PATH (the table of tests/file_order.py, "
                          "tests/slow_files.json, that orders the files under -n 2)")


def pytest_configure(config):
    path = config.getoption("--record-file-seconds")
    if path and not hasattr(config, "workerinput"):  # where every report arrives: the controller under xdist
        config.pluginmanager.register(file_order.FileSeconds(Path(path)), "file-seconds")


def pytest_collection_modifyitems(config, items):
    """On each xdist worker: the longest files first (tests/file_order.py); xdist hands them out in this order."""
    if hasattr(config, "workerinput"):
        items[:] = file_order.longest_first(items, file_order.load_table())


def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadfile`: whole files, and the files that share a costly session fixture together
    (tests/file_order.py GROUPS), to one process."""
    if config.getvalue("dist") == "loadfile":
        return file_order.GroupedFiles(config, log)
    return None


@pytest.fixture(scope="session")
def ray_session():
    import ray

    started = False
    if not ray.is_initialized():
        from pipeline.ray_runtime import start_local_ray

        start_local_ray(num_cpus=8)  # as the CLI starts it: dashboard and state API on 127.0.0.1
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(autouse=True)
def ray_lines_stay_with_their_test(request):
    """After a test that used the session's Ray: the worker lines Ray's deduplicator still holds are printed now, into
    this test's captured output. The deduplicator prints a held line ("[repeated Nx across cluster]") only when a later
    batch of lines comes, or when the driver disconnects; a command's own driver does that at its end, but the test
    process is one driver for the whole session, so a test's held lines came out in whichever later test next ran Ray
    in this process. Seen once (2026-11-30, the whole suite at 6beacf4): a failed sweep trial's controller traceback,
    held 4 minutes, printed into the next in-process Train run's console and failed that test's "no traceback" check.
    Ray's own flush at disconnect (ray/_private/worker.py) is what runs here."""
    yield
    if "ray_session" not in request.fixturenames:
        return
    import ray

    if not ray.is_initialized():
        return
    from ray._private import worker
    from ray._private.ray_logging import stderr_deduplicator, stdout_deduplicator

    ignore_prefix = worker._should_ignore_worker_log_prefix(worker.global_worker)
    for leftover in stdout_deduplicator.flush():
        worker.print_worker_logs(leftover, sys.stdout, ignore_prefix)
    for leftover in stderr_deduplicator.flush():
        worker.print_worker_logs(leftover, sys.stderr, ignore_prefix)


@pytest.fixture(scope="session")
def ray_address(ray_session) -> str:
    """The session Ray's GCS address: subprocesses (`python pipeline/run.py ... --address ADDR`, benchmarks
    with RAY_ADDRESS) join it instead of starting their own Ray, ~10-20 s each on 2 cores."""
    return ray_session.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def test_runs_root(tmp_path_factory, ray_session):
    """A run root whose `test`-preset built-in dataset is prepared once for the session: commands given
    `--preset test --run.root=<it>` find it in the content-hash cache instead of preparing it again.
    Tests give their runs distinct `--run.name`s."""
    from pipeline.config import load_config
    from pipeline.data.pack import prepare

    root = tmp_path_factory.mktemp("runs")
    prepare(load_config("test", [f"--run.root={root}"]))
    return root


SERVER_START_TIMEOUT_S = 90
SERVER_PORT_ATTEMPTS = 3  # starts of a server whose port another process took between picking and binding


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (all held open together, so none is handed out twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class HangUpServer:
    """A real TCP server on 127.0.0.1 that accepts each connection and closes it at once without a byte, counting
    them: a tracking server that is there but answers nothing. A client that gives up on the first failure makes
    one connection; one that retries (MLflow's own client retries for minutes) makes more. The count proves it
    without a clock."""

    def __init__(self) -> None:
        import threading

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.uri = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._count = 0
        self._thread = threading.Thread(target=self._serve, name="hang-up-server", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return self._count

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._count += 1  # before the close: the client's error comes after this count
            conn.close()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (a close alone may not)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5)


@pytest.fixture
def hang_up_server():
    """A HangUpServer for one test."""
    server = HangUpServer()
    try:
        yield server
    finally:
        server.close()


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 and a free port, its store and artifacts under `root`: `launch` starts the
    process and returns at once, `wait` returns (tracking URI, artifacts destination) once /health answers, `stop`
    ends its whole process group (it forks a uvicorn).

    Artifacts are proxied through it (--serve-artifacts), and MLflow's job runner is off: the server otherwise forks
    one with ~8 huey consumers that poll the store all session long, ~0.33 of a core on an idle server (measured: 20
    CPU-s a minute), which every CPU-bound test beside it pays on 2 cores. No test uses MLflow jobs (GenAI
    evaluation/scorers); tracking and artifacts are the same."""

    def __init__(self, root: Path):
        self.root, self.artifacts, self.log_path = root, root / "artifacts", root / "server.log"
        self.proc: subprocess.Popen | None = None
        self.port, self.starts = 0, 0

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> "MlflowServer":
        self.port, self.starts = _free_port(), self.starts + 1
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}", "--serve-artifacts",
               "--artifacts-destination", str(self.artifacts), "--workers", "1"]
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        env.pop("MLFLOW_TRACKING_URI", None)
        with open(self.log_path, "wb") as log_file:
            # Own session: the server's uvicorn and job-runner children share its process group, killed together.
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=self.root, env=env,
                                         start_new_session=True)
        return self

    def wait(self) -> tuple[str, Path]:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if "address already in use" in self.log_path.read_text().lower() and self.starts < SERVER_PORT_ATTEMPTS:
                # Free when picked, the port was taken before the server bound it (its uvicorn says so and may
                # linger): stopped, and started again on a fresh one.
                self.stop(grace_s=0)
                self.launch()
                deadline = time.monotonic() + SERVER_START_TIMEOUT_S
                continue
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self.uri, self.artifacts
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not ready after {SERVER_START_TIMEOUT_S} s:\n"
                            f"{self.log_path.read_text()[-3000:]}")
            time.sleep(0.25)

    def stop(self, grace_s: float = 5) -> None:
        """SIGTERM, a short grace period (the data is throwaway), then SIGKILL whatever of the group is left, so no
        uvicorn or job runner outlives it."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass


_EARLY: dict[str, MlflowServer] = {}  # the session's MLflow server when started_early started it


@pytest.fixture(scope="session", autouse=True)
def started_early(request, tmp_path_factory):
    """On one pytest process (the quick tier's way): the session's MLflow and S3 servers, when any collected test
    will use them, are started as the session begins and come up while the first tests run (~10 s and ~4 s of
    start-up on 2 cores, where the quick tier keeps about one core busy); `mlflow_server` and `s3_bucket` then wait
    for them. Under xdist a process cannot know which tests it will be handed, so each starts them on first use.
    Whatever was started is stopped after every other session fixture (this one is set up first)."""
    if hasattr(request.config, "workerinput"):
        yield
        return
    needs = set().union(set(), *(item.fixturenames for item in request.session.items))
    if "mlflow_server" in needs:
        _EARLY["mlflow"] = MlflowServer(tmp_path_factory.mktemp("mlflow_server")).launch()
    if "s3_bucket" in needs:
        S3.launch()
    try:
        yield
    finally:
        if "mlflow" in _EARLY:
            _EARLY.pop("mlflow").stop()
        S3.stop()  # nothing when s3_bucket has stopped it, or it never started
        shutil.rmtree(S3.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """(tracking URI, artifacts destination) of a real `mlflow server` on 127.0.0.1 for the whole session
    (MlflowServer; started by `started_early` when it could, else here)."""
    server = _EARLY.get("mlflow") or MlflowServer(tmp_path_factory.mktemp("mlflow_server")).launch()
    try:
        yield server.wait()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_bucket() -> str:
    """s3://<bucket> on the session's S3 server (SeaweedFS, started here on first use, stopped at the end)."""
    S3.start()
    try:
        yield S3.create_bucket(S3_BUCKET)
    finally:
        S3.stop()
        shutil.rmtree(S3.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def fault_proxy(s3_bucket) -> FaultProxy:
    """The session's fault proxy in front of its S3 server (module docstring)."""
    proxy = FaultProxy("127.0.0.1", S3.port).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def through_proxy(fault_proxy, monkeypatch) -> FaultProxy:
    """This process's S3 clients (pyarrow's, and boto3's for MLflow artifacts) go through the fault proxy for one
    test; its faults and request log are cleared before and after."""
    fault_proxy.clear()
    fault_proxy.reset_log()
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    try:
        yield fault_proxy
    finally:
        fault_proxy.clear()


def proxy_env(proxy: FaultProxy, **extra: str) -> dict[str, str]:
    """The environment for a subprocess whose S3 traffic, and that of every Ray worker of the job it starts, goes
    through `proxy`: AWS_ENDPOINT_URL here, and for the workers the job's runtime_env (Ray's
    RAY_JOB_CONFIG_JSON_ENV_VAR, what `ray job submit --runtime-env-json` sets), since Ray's workers inherit the
    raylet's environment, not the driver's."""
    import json

    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint, **extra}
    env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {"env_vars": {"AWS_ENDPOINT_URL": proxy.endpoint,
                                                                                  **extra}}})
    return env


@pytest.fixture(scope="session")
def s3_corpus(s3_bucket, tmp_path_factory) -> str:
    """Three .jsonl files in the bucket; returns the glob naming them."""
    from tests.pipeline.data.helpers import sample_docs, write_jsonl

    local = tmp_path_factory.mktemp("s3corpus")
    docs = sample_docs(100, 3000)
    for i in range(3):
        path = write_jsonl(local / f"part-{i}.jsonl", docs[i::3])
        storage.write_bytes(f"{s3_bucket}/corpus/{path.name}", path.read_bytes())
    storage.write_bytes(f"{s3_bucket}/corpus/notes.md", b"not a corpus file: the glob leaves it out")
    return f"{s3_bucket}/corpus/*.jsonl"


@dataclass
class S3Setup:
    dataset: str  # the prepared dataset's URI
    overrides: list[str]  # the command-line fields that find it again in the cache
    run_root: Path  # run.root: only run.json, curves and the local MLflow database are on this machine


@pytest.fixture(scope="session")
def s3_dataset(s3_bucket, s3_corpus, ray_session, tmp_path_factory) -> S3Setup:
    """The corpus prepared into the bucket's dataset store once per session, with the `test` preset and
    run.storage=<bucket>/store: corpus, datasets, checkpoints and artifacts all in the bucket."""
    from pipeline.config import load_config
    from pipeline.data.pack import prepare

    run_root = tmp_path_factory.mktemp("s3runs")
    overrides = ["--data.source=files", f"--data.path={s3_corpus}", f"--run.root={run_root}",
                 f"--run.storage={s3_bucket}/store"]
    return S3Setup(str(prepare(load_config("test", overrides))), overrides, run_root)


@dataclass
class MixtureSetup:
    dataset: str  # the prepared mixture's directory (pipeline/data/mixture_prepare.py)
    overrides: list[str]  # with --preset test: the command-line fields that find it again in the cache
    mixture: list[dict]  # data.mixture: std 0.5 (built-in), topics 0.3 (local JSONL), notes 0.2 (JSONL in the bucket)
    run_root: Path
    tokenizer: str  # the mixture's shared tokenizer, trained on a weight-proportional sample of the three

    def config(self, **fields):
        """The test preset on this mixture, with `fields` ({"train.max_steps": 4} or train__max_steps=4) on top."""
        from pipeline.config import load_config
        from pipeline.config import parse_overrides

        return load_config("test", {**parse_overrides(self.overrides),
                                    **{k.replace("__", "."): v for k, v in fields.items()}})


@pytest.fixture(scope="session")
def mixture_setup(s3_bucket, ray_session, tmp_path_factory) -> MixtureSetup:
    """Three sources prepared once per session as one mixture: the built-in corpus (60 documents), a local JSONL
    file and a JSONL file in the session's bucket, at weights 0.5 / 0.3 / 0.2, sharing a tokenizer trained for
    them (each source cached as its own dataset)."""
    import json

    from pipeline.config import load_config, parse_overrides
    from pipeline.data.stages import prepare_main
    from tests.pipeline.data.helpers import sample_docs, write_jsonl

    root = tmp_path_factory.mktemp("mixture")
    docs = sample_docs(80, 3000)
    local = write_jsonl(root / "topics.jsonl", docs[:40])
    notes = write_jsonl(root / "notes.jsonl", docs[40:], column="body")
    storage.write_bytes(f"{s3_bucket}/mixture/notes.jsonl", notes.read_bytes())
    mixture = [{"name": "std", "weight": 0.5, "source": "builtin", "max_documents": 60},
               {"name": "topics", "weight": 0.3, "source": "files", "path": str(local)},
               {"name": "notes", "weight": 0.2, "source": "files", "path": f"{s3_bucket}/mixture/*.jsonl",
                "text_column": "body"}]
    overrides = [f"--run.root={root / 'runs'}", f"--data.mixture={json.dumps(mixture)}", "--data.max_documents=0",
                 "--data.rows_per_shard=128", "--data.tokenize_actors=2"]
    dataset = str(prepare_main(load_config("test", parse_overrides(overrides))))
    tokenizer = storage.join(dataset, "tokenizer.model")
    return MixtureSetup(dataset, overrides, mixture, root / "runs", tokenizer)
