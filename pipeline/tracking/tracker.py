"""MLflow tracking from rank 0: one run per training job, one parent run per sweep with a child per trial.

    from pipeline.tracking.names import PARAM_MODEL_PARAMS, PARAM_WORLD_SIZE, TRAIN_LOSS, TRAIN_LR
    from pipeline.tracking.tracker import check_tracking_uri, open_tracker, pin_tracking_uri
    cfg = pin_tracking_uri(cfg)                             # driver: one store for every worker, any cwd/node
    check_tracking_uri(cfg.tracking.tracking_uri)           # before any worker starts: fail fast, clearly
    with open_tracker(cfg, rank=rank, run_name="nano-lr3e-3") as tracker:   # NullTracker off rank 0
        tracker.log_config({PARAM_WORLD_SIZE: 2, PARAM_MODEL_PARAMS: n_params})
        tracker.log_metrics({TRAIN_LOSS: 3.2, TRAIN_LR: 3e-3}, step=10)
    print(tracker.ui_command())   # mlflow ui --backend-store-uri sqlite:////abs/runs/mlflow.db --host 127.0.0.1 ...

Where runs go: `tracking.tracking_uri`, else the env var MLFLOW_TRACKING_URI (a server), else the embedded
store `sqlite:///<abs run.root>/mlflow.db` with artifacts in `<run.root>/mlartifacts`. An experiment created
here keeps its artifacts at `tracking.artifact_location`, else under the storage root when that is a bucket
(`<run.storage>/mlartifacts`: pipeline/storage.py); a tracking server decides its own
(`--artifacts-destination`; cluster.yaml points it at the same bucket).

The tracker talks to MLflow through an explicit `MlflowClient` and run id, never the fluent
`mlflow.start_run` global state, so it behaves the same in the driver, in a Ray Train worker and in a
Ray Tune trial. `mlflow` is imported inside functions: the engine host (torch, no MLflow) can still import
every pipeline module that refers to tracking only optionally.

The stable names of the params, metrics and tags it logs (the MLflow UI compares runs and sweep trials
column by column by them) are in pipeline/tracking/names.py.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from pipeline.storage import artifact_location, check, is_uri, scheme
from pipeline.tracking.names import (EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, GIT_COMMIT_TAG, NONFINITE_TAG,
                                     PARAM_GIT_COMMIT, PARENT_RUN_TAG, TIER_TAG)

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger(__name__)

LOCAL_DB_NAME = "mlflow.db"
LOCAL_ARTIFACTS_DIR = "mlartifacts"
# MLflow's own limits (mlflow.utils.validation); copied so this module imports without MLflow.
_MAX_PARAM_VALUE_LEN = 6000
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_STATUSES = ("FINISHED", "FAILED", "KILLED")


class TrackingError(ValueError):
    """The tracking backend cannot be used; the message names the URI and what to do."""


# --- where runs go ----------------------------------------------------------------------------

def resolve_tracking_uri(cfg: "Config") -> str:
    """cfg.tracking.tracking_uri, else $MLFLOW_TRACKING_URI, else sqlite:///<abs cfg.run.root>/mlflow.db."""
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    return "sqlite:///" + str(Path(cfg.run.root).resolve() / LOCAL_DB_NAME)


def local_store_path(uri: str) -> Path | None:
    """The filesystem path behind a sqlite:/// or file: URI or a bare path; None for anything else."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "sqlite":
        # sqlite:///rel/path.db -> "/rel/path.db"[1:]; sqlite:////abs/path.db -> "//abs/path.db"[1:]
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        return None if path in ("", ":memory:") else Path(path)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a bare path (or a Windows drive letter)
        return Path(uri)
    return None


def _unreachable(uri: str, why: str) -> TrackingError:
    return TrackingError(
        f"MLflow tracking server at {uri} is unreachable ({why}); start it with "
        f"`mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///mlflow.db` "
        f"or unset MLFLOW_TRACKING_URI (and tracking.tracking_uri) to use the local store"
    )


def check_tracking_uri(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before any worker starts, if runs cannot be recorded at `uri`.

    http(s): GET <uri>/health must answer 200 within timeout_s (MLflow's own client would instead retry
    for minutes). sqlite / file / bare paths: the store's directory must exist (it is created) and be
    writable. Other schemes (databricks, postgresql, ...) are left to MLflow.
    """
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme in ("http", "https"):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (http(s) only)
                status = resp.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _unreachable(uri, f"{type(exc).__name__}: {reason}") from None
        if status != 200:
            raise _unreachable(uri, f"GET /health answered HTTP {status}; is it an MLflow server?")
        return
    path = local_store_path(uri)
    if path is None:
        return
    # sqlite: the path is the database file; file store / bare path: the path is the store directory.
    directory = path.parent if scheme == "sqlite" else path
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrackingError(f"cannot create the MLflow store directory {directory} for {uri} ({exc.strerror}); "
                            f"set run.root or tracking.tracking_uri to a writable location") from None
    if not os.access(directory, os.W_OK):
        raise TrackingError(f"the MLflow store directory {directory} for {uri} is not writable; "
                            f"set run.root or tracking.tracking_uri to a writable location")


def check_artifact_location(cfg: "Config") -> None:
    """Before any work: the artifact location of a new experiment (tracking.artifact_location, or the storage
    root's mlartifacts/ when run.storage is a bucket) can be written, and MLflow can write there (boto3 for
    s3://). One line naming the location and the fix otherwise. A server decides its own artifacts."""
    location = artifact_location(cfg)
    if not location or not is_uri(location):
        return
    if scheme(location) == "s3":
        try:
            import boto3  # noqa: F401  (MLflow's S3 artifact store)
        except ImportError:
            raise TrackingError(f"MLflow artifacts go to {location}, which needs boto3: pip install boto3") from None
    check(location, what="the MLflow artifact location", write=True)


def pin_tracking_uri(cfg: "Config") -> "Config":
    """cfg with tracking.tracking_uri set to resolve_tracking_uri(cfg), for the config shipped to workers.

    A Ray worker may run in another directory (a relative run.root would name another database) or on another
    node (without the driver's MLFLOW_TRACKING_URI); pinning on the driver makes every process use one store.
    """
    return cfg.replace({"tracking.tracking_uri": resolve_tracking_uri(cfg)})


def ui_command_for(uri: str) -> str:
    """`mlflow ui --backend-store-uri <uri> --host 127.0.0.1 --port 5000` for a local store; the URL for a server."""
    if urllib.parse.urlparse(uri).scheme in ("http", "https"):
        return uri
    return f"mlflow ui --backend-store-uri {shlex.quote(uri)} --host 127.0.0.1 --port 5000"


def git_commit(cwd: str | Path | None = None) -> str | None:
    """`git rev-parse HEAD` of the checkout holding `cwd` (default: this code), with `-dirty` when tracked
    files have uncommitted changes; None when it is not a git checkout or git is missing."""
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=where)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=where).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


# --- the tracker ------------------------------------------------------------------------------

def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= _MAX_PARAM_VALUE_LEN else text[: _MAX_PARAM_VALUE_LEN - 3] + "..."


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i: i + size]


class Tracker:
    """One MLflow run, driven through an explicit MlflowClient (safe in Ray workers and Tune trials).

    Tracker(cfg)                              a new run in experiment cfg.tracking.experiment
    Tracker(cfg, parent_run_id=p)             a child run of p (tag mlflow.parentRunId); nested=True says so
                                              explicitly and then requires parent_run_id
    Tracker(cfg, run_id=r)                    resume run r (e.g. after a Ray Train restart); status -> RUNNING
    """

    def __init__(self, cfg: "Config", run_name: str | None = None, parent_run_id: str | None = None,
                 nested: bool = False, run_id: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        if nested and not parent_run_id:
            raise TrackingError("Tracker(nested=True) needs parent_run_id: the run id of the sweep's parent run")
        self.cfg = cfg
        self.tracking_uri = resolve_tracking_uri(cfg)
        check_tracking_uri(self.tracking_uri)
        store = local_store_path(self.tracking_uri)
        new_store = store is not None and not store.exists()
        try:
            with self._room("store"):  # a new local store creates its tables here
                self.client = MlflowClient(tracking_uri=self.tracking_uri)
        except Exception:
            if new_store and store is not None:  # half its tables: gone, so that a rerun creates it whole
                store.unlink(missing_ok=True)
            raise
        self.nonfinite_skipped = 0  # metric values dropped because they were NaN/inf
        self.git_commit = git_commit()
        self._finished = False
        self._system_monitor = None
        # Artifact uploads ride out object-store failures that pass for run.storage_retry_s; those that can wait
        # (samples, curves) are logged from a background thread (pipeline/tracking/deferred.py).
        self.storage_retry_s = cfg.run.storage_retry_s
        self._deferred = None
        self._run_id = run_id
        if run_id:
            run = self.client.get_run(run_id)  # raises MlflowException naming the id when it does not exist
            with self._room("run record"):
                self.client.update_run(run_id, status="RUNNING")
            self.experiment_id = run.info.experiment_id
            return
        tags = {TIER_TAG: cfg.model.tier}
        if self.git_commit:
            tags[GIT_COMMIT_TAG] = self.git_commit
        if parent_run_id:
            tags[PARENT_RUN_TAG] = parent_run_id
        with self._room("run record"):
            self.experiment_id = self._experiment_id(cfg.tracking.experiment)
            run = self.client.create_run(self.experiment_id, tags=tags, run_name=run_name or cfg.run.name or None)
        self._run_id = run.info.run_id

    def _experiment_id(self, name: str) -> str:
        """The experiment's id, created when new; either way marked as model training (EXPERIMENT_KIND_TAG) unless
        it says otherwise, so the MLflow UI opens it on its runs table instead of the GenAI overview."""
        exp_id = self._find_or_create_experiment(name)
        found = self.client.get_experiment(exp_id)
        if EXPERIMENT_KIND_TAG not in (found.tags or {}):
            self.client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp_id

    def _find_or_create_experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = artifact_location(self.cfg) or None  # the storage root's, when it is a bucket
        db = local_store_path(self.tracking_uri) if self.tracking_uri.startswith("sqlite:") else None
        if db is not None and location is None:
            # MLflow's default artifact root for a SQL store is ./mlruns under whatever the cwd is; keep the
            # artifacts next to the database instead.
            location = (db.resolve().parent / LOCAL_ARTIFACTS_DIR).as_uri()
        elif location is not None and not is_uri(location):
            location = Path(location).resolve().as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:
            # Another trial created it between our lookup and create: use theirs.
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    @property
    def run_id(self) -> str:
        return self._run_id

    @contextlib.contextmanager
    def _room(self, what: str, artifact: bool = False) -> Iterator[None]:
        """A write to the store (its database, or with `artifact` its artifact folder) that fails for lack of space
        ends in pipeline/disk_space.py's one line naming where; any other failure passes unchanged."""
        from pipeline.disk_space import TRACKING_FIX, disk_full_error, is_disk_full

        try:
            yield
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            try:
                where = (self.client.get_run(self._run_id).info.artifact_uri if artifact
                         else str(local_store_path(self.tracking_uri) or self.tracking_uri))
            except Exception:  # noqa: BLE001 -- the store cannot say: name the tracking URI
                where = self.tracking_uri
            raise disk_full_error(where.removeprefix("file://"), f"MLflow's {what}", TRACKING_FIX, exc=exc) from None

    # -- params, metrics, tags ----------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any], keep_logged: tuple[str, ...] = ()) -> None:
        """Log params as strings (MLflow's value limit: 6,000 chars, longer values are cut with '...').

        MLflow params are write-once: on a resumed run, params already logged with the same value are
        skipped, and a changed value is kept as first logged (with a warning) instead of failing training.
        `keep_logged`: params whose change is expected and recorded elsewhere (a resume's longer train.max_steps:
        the tag longtrain.max_steps), kept as first logged without a warning.
        """
        from mlflow.entities import Param

        values = {str(k): _param_value(v) for k, v in params.items()}
        existing = self.client.get_run(self._run_id).data.params
        for key in [k for k in values if k in existing]:
            if existing[key] != values[key] and key not in keep_logged:
                log.warning("param %s was logged as %r in run %s; keeping it (MLflow params are write-once), "
                            "new value %r not recorded", key, existing[key], self._run_id, values[key])
            del values[key]
        items = [Param(k, v) for k, v in values.items()]
        with self._room("params"):
            for chunk in _chunks(items, _MAX_PARAMS_PER_BATCH):
                self.client.log_batch(self._run_id, params=chunk)

    def log_config(self, extra: Mapping[str, Any] | None = None, keep_logged: tuple[str, ...] = ()) -> None:
        """Every config field path (cfg.flat()) plus extras, e.g. {PARAM_WORLD_SIZE: 2, PARAM_MODEL_PARAMS: n}.

        git_commit is added when known and not given; `keep_logged` as in log_params.
        """
        params: dict[str, Any] = dict(self.cfg.flat())
        if self.git_commit:
            params[PARAM_GIT_COMMIT] = self.git_commit
        params.update(extra or {})
        self.log_params(params, keep_logged)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> int:
        """Log numeric metrics at `step` in one batch; NaN/inf values are skipped and counted.

        Values may be Python numbers, numpy scalars or 0-dim tensors (anything float() accepts); None is
        ignored. Returns how many values were logged.
        """
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = []
        for key, value in metrics.items():
            if value is None:
                continue
            number = float(value)
            if not math.isfinite(number):
                self.nonfinite_skipped += 1
                if self.nonfinite_skipped == 1:
                    log.warning("skipping non-finite metric %s=%r at step %d (further ones are counted only, "
                                "see tag %s)", key, number, step, NONFINITE_TAG)
                continue
            items.append(Metric(str(key), number, now, int(step)))
        with self._room("metrics"):
            for chunk in _chunks(items, _MAX_METRICS_PER_BATCH):
                self.client.log_batch(self._run_id, metrics=chunk)
        return len(items)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(str(k), str(v)) for k, v in tags.items()]
        with self._room("tags"):
            for chunk in _chunks(items, _MAX_PARAMS_PER_BATCH):
                self.client.log_batch(self._run_id, tags=chunk)

    # -- artifacts ----------------------------------------------------------------------------
    # Each upload rides out storage failures that pass (outage, stall, 5xx) for run.storage_retry_s; after that, or at
    # once for one that does not pass (denied), ArtifactError: one line naming the artifact.
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a local file or directory; artifact_path is the folder inside the run's artifacts."""
        from pipeline.tracking.deferred import upload_retrying

        path = Path(path)
        if not path.exists():
            raise TrackingError(f"artifact {path} does not exist; write it before logging it")
        with self._room(f"artifact {path.name}", artifact=True):
            if path.is_dir():
                upload_retrying(path.name, lambda: self.client.log_artifacts(self._run_id, str(path), artifact_path),
                                self.storage_retry_s)
            else:
                upload_retrying(path.name, lambda: self.client.log_artifact(self._run_id, str(path), artifact_path),
                                self.storage_retry_s)

    def log_text(self, text: str, artifact_file: str) -> None:
        from pipeline.tracking.deferred import upload_retrying

        with self._room(f"artifact {artifact_file}", artifact=True):
            upload_retrying(artifact_file, lambda: self.client.log_text(self._run_id, text, artifact_file),
                            self.storage_retry_s)

    def log_position_plot(self, title: str | None = None) -> bool:
        """Redraw position_loss.png from this run's val/pos_loss/* history (pipeline/tracking/long_context_plots.py)."""
        from pipeline.tracking.long_context_plots import log_position_plot

        return log_position_plot(self.client, self._run_id, title=title)

    def log_expert_load(self, history: list, layers: list[int], title: str | None = None) -> bool:
        """Redraw expert_load.png (and expert_load.json) from a mixture of experts' load history
        (pipeline/train/moe_balance.py MoEBalance.history; pipeline/tracking/expert_load_plot.py). False when empty."""
        import tempfile

        from pipeline.tracking.expert_load_plot import write_expert_load

        if not history:
            return False
        with tempfile.TemporaryDirectory(prefix="expert-load-") as tmp:
            for path in write_expert_load(history, layers, tmp, title):
                self.log_artifact(path)
        return True

    def log_dict(self, dictionary: Mapping[str, Any], artifact_file: str) -> None:
        """A .json / .yaml / .yml artifact (format from the file name)."""
        from pipeline.tracking.deferred import upload_retrying

        with self._room(f"artifact {artifact_file}", artifact=True):
            upload_retrying(artifact_file, lambda: self.client.log_dict(self._run_id, dict(dictionary),
                                                                        artifact_file), self.storage_retry_s)

    def log_later(self, artifact_file: str, text: str | None = None, path: str | Path | None = None,
                  artifact_path: str | None = None) -> None:
        """Log `text` as artifact_file (or the local file `path` into artifact_path) from a background thread:
        what can wait for storage does not hold up training. `flush_deferred` (and finish) waits for it."""
        from pipeline.tracking.deferred import DeferredArtifacts

        if self._deferred is None:
            self._deferred = DeferredArtifacts(self.storage_retry_s)
        if text is not None:
            self._deferred.submit(artifact_file, lambda: self.client.log_text(self._run_id, text, artifact_file))
        else:
            self._deferred.submit(artifact_file, lambda: self.client.log_artifact(self._run_id, str(path),
                                                                                  artifact_path))

    def flush_deferred(self, timeout_s: float | None = None) -> list[str]:
        """Wait (up to run.storage_retry_s) for the artifacts log_later queued; one line per artifact not logged,
        also printed as a warning (the run goes on without it)."""
        if self._deferred is None:
            return []
        left = self._deferred.flush(self.storage_retry_s if timeout_s is None else timeout_s)
        for line in left:
            print(f"warning: {line}", flush=True)
        return left

    def log_dataset_input(self, manifest: Any, dataset_dir: str | Path, context: str = "train",
                          tags: Mapping[str, Any] | None = None) -> None:
        """The prepared dataset as an MLflow dataset input (digest = manifest settings hash), and its deduplication's
        settings and counts as params (a mixture's source: under its name); see lineage.py."""
        from pipeline.tracking.lineage import dedup_params, log_dataset_input
        from pipeline.tracking.names import MIXTURE_SOURCE_TAG

        log_dataset_input(self.client, self._run_id, manifest, dataset_dir, context, tags)
        params = dedup_params(manifest, str((tags or {}).get(MIXTURE_SOURCE_TAG, "")))
        if params:
            self.log_params(params, keep_logged=tuple(params))  # a later phase's dataset: the first phase's stay

    # -- system metrics -----------------------------------------------------------------------
    def start_system_metrics(self, interval_s: float = 10.0) -> bool:
        """Sample CPU, memory, disk, network and, with pynvml, GPU utilisation and memory of this machine every
        interval_s seconds into `system/*` metrics of this run (MLflow's SystemMetricsMonitor: one daemon
        thread, stopped by finish()). Returns False when psutil is missing (nothing is started)."""
        if self._system_monitor is not None:
            return True
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(self._run_id, sampling_interval=interval_s, resume_logging=True,
                                           tracking_uri=self.tracking_uri)
        except ImportError as exc:
            log.warning("system metrics are off: %s (pip install psutil; nvidia-ml-py for GPU metrics)", exc)
            return False
        monitor.start()
        self._system_monitor = monitor
        return True

    def stop_system_metrics(self) -> None:
        """Stop the sampling thread (it wakes at once and is joined) and log the window in progress too, which
        MLflow's monitor drops: a run shorter than one interval still gets one sample."""
        monitor, self._system_monitor = self._system_monitor, None
        if monitor is None:
            return
        monitor.finish()
        try:
            last = monitor.aggregate_metrics()  # samples since the last publish (the thread collects first)
            if last:
                monitor.publish_metrics(last)
                monitor.mlflow_logger.flush()
        except Exception as exc:  # noqa: BLE001 - system metrics never fail a run
            log.warning("could not log the last system metrics sample: %s", exc)

    # -- lifecycle ----------------------------------------------------------------------------
    def finish(self, status: str = "FINISHED") -> None:
        """Mark the run FINISHED, FAILED or KILLED; later calls do nothing."""
        if status not in _STATUSES:
            raise ValueError(f"run status {status!r} is not allowed; choose one of: {', '.join(_STATUSES)}")
        self.stop_system_metrics()
        if self._finished:
            return
        self.flush_deferred(0 if status == "FAILED" else None)  # a failed run does not wait for its artifacts
        if self.nonfinite_skipped:
            self.set_tags({NONFINITE_TAG: self.nonfinite_skipped})
        self.client.set_terminated(self._run_id, status=status)
        self._finished = True

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    # -- where to look ------------------------------------------------------------------------
    def ui_command(self) -> str:
        """The exact command that opens the MLflow UI on this store, or the server URL when remote."""
        return ui_command_for(self.tracking_uri)

    def run_url(self) -> str | None:
        """Link to this run in a served UI (None for a local store: run ui_command() first)."""
        if urllib.parse.urlparse(self.tracking_uri).scheme not in ("http", "https"):
            return None
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self._run_id}"


class NullTracker:
    """The Tracker interface doing nothing: tracking disabled, or a rank other than 0."""

    run_id = None
    experiment_id = None
    tracking_uri = ""
    nonfinite_skipped = 0
    git_commit = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_params(self, params: Mapping[str, Any], keep_logged: tuple[str, ...] = ()) -> None:
        pass

    def log_config(self, extra: Mapping[str, Any] | None = None, keep_logged: tuple[str, ...] = ()) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> int:
        return 0

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_position_plot(self, title: str | None = None) -> bool:
        return False

    def log_expert_load(self, history: list, layers: list[int], title: str | None = None) -> bool:
        return False

    def log_dict(self, dictionary: Mapping[str, Any], artifact_file: str) -> None:
        pass

    def log_later(self, artifact_file: str, text: str | None = None, path: str | Path | None = None,
                  artifact_path: str | None = None) -> None:
        pass

    def flush_deferred(self, timeout_s: float | None = None) -> list[str]:
        return []

    def log_dataset_input(self, manifest: Any, dataset_dir: str | Path, context: str = "train",
                          tags: Mapping[str, Any] | None = None) -> None:
        pass

    def start_system_metrics(self, interval_s: float = 10.0) -> bool:
        return False

    def stop_system_metrics(self) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass

    def __enter__(self) -> "NullTracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass

    def ui_command(self) -> str:
        return ""

    def run_url(self) -> str | None:
        return None


def open_tracker(cfg: "Config", rank: int = 0, **kwargs: Any) -> Tracker | NullTracker:
    """A Tracker on rank 0 with tracking enabled, else a NullTracker. kwargs go to Tracker()."""
    if rank != 0 or not cfg.tracking.enabled:
        return NullTracker()
    return Tracker(cfg, **kwargs)
