"""MLflow tracking against a real `mlflow server` on 127.0.0.1 and against the embedded SQLite store.

    .venv/bin/python -m pytest tests/pipeline/tracking/test_tracking.py -q

The server is tests/conftest.py's `mlflow_server`: one per test session, artifacts proxied through it.
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

# Before mlflow is imported anywhere in this process: no telemetry from tests (there is no network either).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

from tests.conftest import _free_port  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.tracking.curves import plot_training_curves  # noqa: E402
from pipeline.tracking.names import (  # noqa: E402
    NONFINITE_TAG, PARAM_GIT_COMMIT, PARAM_MODEL_PARAMS, PARAM_WORLD_SIZE, PARENT_RUN_TAG, TRAIN_LOSS, TRAIN_LR,
    TRAIN_TOKENS_PER_S, TRAIN_TOKENS_SEEN, VAL_LOSS,
)
from pipeline.tracking.tracker import (  # noqa: E402
    NullTracker, Tracker, TrackingError, check_tracking_uri, git_commit, open_tracker, pin_tracking_uri,
    resolve_tracking_uri, ui_command_for,
)

def _history() -> list[dict]:
    train = [{"step": s, TRAIN_LOSS: 6.0 - 0.25 * s, TRAIN_LR: 1e-3 * min(1.0, s / 4), TRAIN_TOKENS_PER_S: 900.0 + s,
              TRAIN_TOKENS_SEEN: 256 * s} for s in range(1, 13)]
    return train + [{"step": 6, VAL_LOSS: 4.8}, {"step": 12, VAL_LOSS: 3.9}]


def test_server_roundtrip_params_metrics_artifacts(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    uri, artifacts_dir = mlflow_server
    cfg = load_config("test", {"tracking.tracking_uri": uri, "tracking.experiment": "roundtrip",
                               "run.root": str(tmp_path / "runs")})
    long_value = "x" * 10_000  # over MLflow's 6,000-character param limit
    steps = [2, 4, 6, 8]
    losses = [5.5, 5.0, 4.25, 3.875]
    data_file = tmp_path / "sample.txt"
    data_file.write_text("the quick brown fox\n")
    png = plot_training_curves(_history(), tmp_path / "training_curves.png")

    with Tracker(cfg, run_name="roundtrip") as tracker:
        tracker.log_config({PARAM_WORLD_SIZE: 2, PARAM_MODEL_PARAMS: 123456, "note": long_value})
        for step, loss in zip(steps, losses):
            assert tracker.log_metrics({TRAIN_LOSS: loss, TRAIN_LR: step * 1e-4, VAL_LOSS: float("nan")}, step) == 2
        tracker.log_artifact(data_file)
        tracker.log_artifact(png, artifact_path="plots")
        tracker.log_text("sample output: hello", "samples/step_8.txt")
        tracker.log_dict({"a": 1, "b": [1, 2]}, "meta.json")
        tracker.set_tags({"stage": "test"})
        run_id = tracker.run_id
        assert tracker.ui_command() == uri
        assert run_id in tracker.run_url()

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "roundtrip"
    expected = {k: str(v) for k, v in cfg.flat().items()}
    expected.update({PARAM_WORLD_SIZE: "2", PARAM_MODEL_PARAMS: "123456", "note": "x" * 5997 + "..."})
    if git_commit():
        expected[PARAM_GIT_COMMIT] = git_commit()
    assert run.data.params == expected
    assert run.data.tags["stage"] == "test"
    assert run.data.tags[NONFINITE_TAG] == str(len(steps))  # every NaN val/loss skipped and counted

    history = sorted(client.get_metric_history(run_id, TRAIN_LOSS), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == list(zip(steps, losses))
    lr_history = sorted(client.get_metric_history(run_id, TRAIN_LR), key=lambda m: m.step)
    assert [m.step for m in lr_history] == steps
    assert [m.value for m in lr_history] == pytest.approx([s * 1e-4 for s in steps])
    assert client.get_metric_history(run_id, VAL_LOSS) == []

    # Artifacts went through the server's proxy into its artifacts destination, and read back byte-equal.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    top = {f.path for f in client.list_artifacts(run_id)}
    assert top == {"sample.txt", "plots", "samples", "meta.json"}
    assert [f.path for f in client.list_artifacts(run_id, "plots")] == ["plots/training_curves.png"]
    out = tmp_path / "download"
    out.mkdir()
    assert Path(client.download_artifacts(run_id, "sample.txt", str(out))).read_bytes() == data_file.read_bytes()
    got_png = Path(client.download_artifacts(run_id, "plots/training_curves.png", str(out))).read_bytes()
    assert got_png == png.read_bytes() and got_png[:8] == b"\x89PNG\r\n\x1a\n"
    assert Path(client.download_artifacts(run_id, "samples/step_8.txt", str(out))).read_text() == \
        "sample output: hello"
    assert json.loads(Path(client.download_artifacts(run_id, "meta.json", str(out))).read_text()) == \
        {"a": 1, "b": [1, 2]}
    # the session's server also holds other tests' runs: look only under this run's artifact directory
    stored = [p for p in artifacts_dir.rglob("training_curves.png") if run_id in p.parts]
    assert len(stored) == 1 and stored[0].read_bytes() == png.read_bytes()


def test_nested_runs_carry_parent_tag(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    uri, _ = mlflow_server
    cfg = load_config("test", {"tracking.tracking_uri": uri, "tracking.experiment": "sweep",
                               "run.root": str(tmp_path)})
    with Tracker(cfg, run_name="sweep-parent") as parent:
        children = []
        for i in range(2):
            with Tracker(cfg, run_name=f"trial-{i}", parent_run_id=parent.run_id, nested=True) as child:
                child.log_metrics({VAL_LOSS: 3.0 + i}, step=1)
                children.append(child.run_id)
    client = MlflowClient(tracking_uri=uri)
    assert PARENT_RUN_TAG not in client.get_run(parent.run_id).data.tags
    for child_id in children:
        assert client.get_run(child_id).data.tags[PARENT_RUN_TAG] == parent.run_id
    found = client.search_runs([parent.experiment_id], f"tags.`{PARENT_RUN_TAG}` = '{parent.run_id}'")
    assert sorted(r.info.run_id for r in found) == sorted(children)
    with pytest.raises(TrackingError, match="parent_run_id"):
        Tracker(cfg, nested=True)


def test_local_sqlite_store_without_server(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # MLflow's default artifact root would be ./mlruns here; ours is next to the db
    root = tmp_path / "runs"
    cfg = load_config("test", {"run.root": str(root)})
    uri = resolve_tracking_uri(cfg)
    assert uri == f"sqlite:///{root / 'mlflow.db'}"

    tracker = Tracker(cfg, run_name="local")
    tracker.log_config({PARAM_WORLD_SIZE: 1})
    tracker.log_metrics({TRAIN_LOSS: 2.5}, step=1)
    tracker.log_text("hi", "note.txt")
    tracker.finish("FAILED")
    tracker.finish("FINISHED")  # no-op after the first
    assert tracker.ui_command() == f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"

    # Resume the same run (a Ray Train restart): same config logs cleanly, metrics append.
    resumed = Tracker(cfg, run_id=tracker.run_id)
    resumed.log_config({PARAM_WORLD_SIZE: 1})
    resumed.log_metrics({TRAIN_LOSS: 2.0}, step=2)
    resumed.finish()

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.batch_size"] == "4" and run.data.params[PARAM_WORLD_SIZE] == "1"
    assert [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, TRAIN_LOSS),
                                              key=lambda m: m.step)] == [(1, 2.5), (2, 2.0)]
    assert (root / "mlflow.db").is_file()
    assert list((root / "mlartifacts").rglob("note.txt"))
    assert not (cwd / "mlruns").exists()


def test_uri_precedence_and_pinning(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert resolve_tracking_uri(load_config("test", {"run.root": str(tmp_path)})) == "http://127.0.0.1:5999"
    cfg = load_config("test", {"tracking.tracking_uri": "sqlite:///x.db"})
    assert resolve_tracking_uri(cfg) == "sqlite:///x.db"
    assert ui_command_for("http://127.0.0.1:5999") == "http://127.0.0.1:5999"

    # Pinned on the driver, a relative run.root means the same store from a worker in another directory.
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    pinned = pin_tracking_uri(load_config("test", {"run.root": "runs"}))
    assert pinned.tracking.tracking_uri == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    monkeypatch.chdir("/")
    assert resolve_tracking_uri(pinned) == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"


def test_unreachable_server_fails_fast_with_one_clear_line(tmp_path, hang_up_server):
    """One clear line where nothing listens; and fast: one connection, not the minutes of retries MLflow's own
    client makes, counted on a server that hangs up on every connection (tests/conftest.py HangUpServer)."""
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(TrackingError) as err:
        check_tracking_uri(uri)
    message = str(err.value)
    assert uri in message and "unreachable" in message
    assert "mlflow server --host 127.0.0.1 --port 5000" in message and "unset MLFLOW_TRACKING_URI" in message
    assert "\n" not in message
    cfg = load_config("test", {"tracking.tracking_uri": uri, "run.root": str(tmp_path)})
    with pytest.raises(TrackingError, match="unreachable"):
        Tracker(cfg)

    with pytest.raises(TrackingError, match=f"{hang_up_server.uri} is unreachable"):
        check_tracking_uri(hang_up_server.uri)
    assert hang_up_server.connections == 1  # one try, no retry
    with pytest.raises(TrackingError, match="unreachable"):
        Tracker(load_config("test", {"tracking.tracking_uri": hang_up_server.uri, "run.root": str(tmp_path)}))
    assert hang_up_server.connections == 2


def test_local_store_in_unwritable_place_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(TrackingError, match="cannot create the MLflow store directory"):
        check_tracking_uri(f"sqlite:///{blocker / 'sub' / 'mlflow.db'}")
    check_tracking_uri(f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}")  # created and writable: fine
    assert (tmp_path / "new").is_dir()


def test_null_tracker_has_the_tracker_api(tmp_path):
    public = {n: m for n, m in inspect.getmembers(Tracker, inspect.isfunction) if not n.startswith("_")}
    assert public, "Tracker has public methods"
    for name, method in public.items():
        assert inspect.signature(getattr(NullTracker, name)) == inspect.signature(method), name
    cfg = load_config("test", {"run.root": str(tmp_path)})
    assert isinstance(open_tracker(cfg, rank=1), NullTracker)
    assert isinstance(open_tracker(cfg.replace({"tracking.enabled": False})), NullTracker)
    with open_tracker(cfg, rank=3) as null:
        null.log_config({PARAM_WORLD_SIZE: 4})
        assert null.log_metrics({TRAIN_LOSS: 1.0}, step=1) == 0
        assert null.run_id is None and null.ui_command() == ""
    assert not list(tmp_path.iterdir())  # nothing was written


def test_training_curves_png(tmp_path):
    from matplotlib.image import imread

    ragged = _history() + [{"step": 13, TRAIN_LOSS: float("nan")}, {"step": 14, TRAIN_LOSS: None}, {"x": 1}]
    for name, history in (("full", ragged), ("empty", []), ("val_only", [{"step": 3, VAL_LOSS: 2.0}])):
        out = plot_training_curves(history, tmp_path / name / "curves.png")
        assert out == tmp_path / name / "curves.png"
        assert imread(out).shape[:2] == (700, 1100)  # figsize 11x7 in at 100 dpi
        assert [p.name for p in out.parent.iterdir()] == ["curves.png"]  # no temporary file left behind
