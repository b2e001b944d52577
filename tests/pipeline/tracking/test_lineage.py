"""Against a real `mlflow server`: a training run (Ray-free path) lists its dataset as an MLflow dataset input
with the manifest digest, samples system metrics while it trains and stops sampling when it ends, registers
its export at the end (tracking.register_model) so that the registered version points at the run and its
artifacts load with transformers; `eval` logs eval/* to the same run, `eval models:/NAME/VERSION --tasks` scores
the registered version and logs to the run that trained it, and `export --register` adds a version."""
from __future__ import annotations

import json
import threading

import pytest
import transformers  # the dev extra installs it (pip install -e '.[dev]')

from pipeline.run import main as cli_main
from pipeline.train.session.train_session import TrainSession, load_phases
from tests.pipeline.train.hf_helpers import build_dataset


MODEL_NAME = "longtrain-lineage-test"


@pytest.fixture(scope="module")
def tracked_run(mlflow_server, tmp_path_factory):
    """(uri, run_dir, run_id, manifest) of one finished training run with every tracking feature on."""
    uri, _ = mlflow_server
    root = tmp_path_factory.mktemp("lineage")
    cfg, ds = build_dataset(root / "data", overrides={
        "tracking.tracking_uri": uri, "tracking.experiment": "lineage-test", "tracking.system_metrics": True,
        "tracking.system_metrics_interval_s": 1.0, "tracking.register_model": MODEL_NAME,
        "train.max_steps": 6, "train.eval_every": 6, "train.checkpoint_every": 6})
    run_dir = root / "runs" / "tracked"
    run_dir.mkdir(parents=True)
    result = TrainSession(cfg, run_dir, load_phases(None, cfg), use_ray=False).run()
    assert result.checkpoint is not None and not result.stopped
    record = json.loads((run_dir / "run.json").read_text())
    manifest = json.loads((ds / "manifest.json").read_text())
    return uri, run_dir, record["mlflow_run_id"], manifest


def client_for(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_run_lists_its_dataset_with_the_manifest_digest(tracked_run):
    uri, _, run_id, manifest = tracked_run
    inputs = client_for(uri).get_run(run_id).inputs.dataset_inputs
    assert len(inputs) == 1
    ds = inputs[0].dataset
    assert ds.digest == manifest["settings_hash"][:16] and ds.name == manifest["source"]["path"]
    assert ds.source_type == "local" and json.loads(ds.source)["uri"].endswith("dataset")
    profile = json.loads(ds.profile)
    n_rows = sum(s["rows"] for split in manifest["shards"].values() for s in split)
    assert profile["sequences"] == n_rows and profile["seq_len"] == manifest["seq_len"]
    assert profile["tokens"] == manifest["counts"]["tokens_kept"]
    assert profile["settings_hash"] == manifest["settings_hash"]
    assert "tokens" in ds.schema and {t.key: t.value for t in inputs[0].tags}["mlflow.data.context"] == "train"


def test_system_metrics_are_sampled_and_the_sampler_stops(tracked_run):
    uri, _, run_id, _ = tracked_run
    metrics = client_for(uri).get_run(run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics and "system/system_memory_usage_megabytes" in metrics
    history = client_for(uri).get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert history and [m.step for m in history] == list(range(len(history)))  # one per interval, the last at the end
    assert not [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor"], "the sampler thread lives on"


def test_no_system_metrics_when_off(mlflow_server, tmp_path):
    uri, _ = mlflow_server
    cfg, _ = build_dataset(tmp_path / "data", overrides={
        "tracking.tracking_uri": uri, "tracking.experiment": "lineage-test", "tracking.system_metrics": False,
        "train.max_steps": 2, "train.eval_every": 2, "train.checkpoint_every": 2})
    run_dir = tmp_path / "runs" / "quiet"
    run_dir.mkdir(parents=True)
    TrainSession(cfg, run_dir, load_phases(None, cfg), use_ray=False).run()
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    metrics = client_for(uri).get_run(run_id).data.metrics
    assert "train/loss" in metrics and not [k for k in metrics if k.startswith("system/")]


def test_registered_version_points_at_the_run_and_loads(tracked_run, tmp_path):
    import mlflow.artifacts

    uri, _, run_id, manifest = tracked_run
    client = client_for(uri)
    versions = client.search_model_versions(f"name='{MODEL_NAME}'")
    assert len(versions) == 1
    v = versions[0]
    assert v.run_id == run_id and v.status == "READY"
    assert v.tags["tier"] == "nano" and int(v.tags["tokens_seen"]) > 0 and float(v.tags["val_loss"]) > 0
    assert v.tags["manifest_hash"] == manifest["settings_hash"]
    assert client.get_run(run_id).data.tags["longtrain.registered_model"] == f"{MODEL_NAME}/{v.version}"
    local = mlflow.artifacts.download_artifacts(artifact_uri=client.get_model_version_download_uri(MODEL_NAME, v.version),
                                                dst_path=str(tmp_path), tracking_uri=uri)
    model = transformers.AutoModelForCausalLM.from_pretrained(local)
    tok = transformers.AutoTokenizer.from_pretrained(local)
    assert model.config.model_type == "llama" and tok("The ")["input_ids"][0] == 2


def test_eval_stage_logs_to_the_run_it_evaluated(tracked_run, capsys):
    uri, run_dir, run_id, _ = tracked_run
    assert cli_main(["eval", "--resume", str(run_dir)]) == 0
    assert f"logged to MLflow run {run_id}" in capsys.readouterr().out
    run = client_for(uri).get_run(run_id)
    assert run.info.status == "FINISHED", "logging eval metrics must not reopen the run"
    m = run.data.metrics
    assert {"eval/loss", "eval/ppl", "eval/accuracy"} <= set(m) and m["eval/loss"] > 0
    step = json.loads((run_dir / "run.json").read_text())["checkpoint"].rsplit("_", 1)[-1]
    assert [h.step for h in client_for(uri).get_metric_history(run_id, "eval/loss")] == [int(step)]


def test_cli_export_register_adds_a_version(tracked_run, tmp_path, capsys):
    uri, run_dir, run_id, _ = tracked_run
    out = tmp_path / "hf"
    assert cli_main(["export", "--resume", str(run_dir), "--out", str(out), "--register", MODEL_NAME + "-cli"]) == 0
    assert "registered" in capsys.readouterr().out
    versions = client_for(uri).search_model_versions(f"name='{MODEL_NAME}-cli'")
    assert [v.run_id for v in versions] == [run_id] and (out / "model.safetensors").is_file()


def test_export_register_without_a_tracked_run_writes_nothing(tracked_run, tmp_path, capsys):
    _, run_dir, _, _ = tracked_run
    lone = tmp_path / "ckpt"
    import shutil

    shutil.copytree(json.loads((run_dir / "run.json").read_text())["checkpoint"], lone)
    assert cli_main(["export", "--checkpoint", str(lone), "--out", str(tmp_path / "hf"), "--register", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--register needs the MLflow run" in err[0]
    assert not (tmp_path / "hf").exists()


def test_eval_scores_a_registered_model_on_a_local_task_and_logs_to_its_run(tracked_run, tmp_path, capsys):
    """eval models:/NAME/VERSION --tasks YAML: the registered export is scored by the harness's Hugging Face backend
    and the scores land in the run that trained it, at the step its version records."""
    pytest.importorskip("lm_eval")
    from pipeline.tracking.names import task_metric, task_status_tag

    uri, _, run_id, _ = tracked_run
    docs = tmp_path / "qa.jsonl"
    docs.write_text("".join(json.dumps({"q": f"The {w} is", "c": [" red", " green", " blue"], "a": i % 3}) + "\n"
                            for i, w in enumerate(["sky", "grass", "sea", "rose", "leaf", "night"])))
    task = tmp_path / "qa.yaml"
    task.write_text(f"task: lineage_qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\n"
                    "doc_to_target: a\nmetric_list:\n  - metric: acc\n")
    version = client_for(uri).search_model_versions(f"name='{MODEL_NAME}'")[0]
    assert cli_main(["eval", f"models:/{MODEL_NAME}/{version.version}", "--tasks", str(task),
                     f"--tracking.tracking_uri={uri}"]) == 0
    out = capsys.readouterr().out
    assert "lineage_qa" in out and f"task scores logged to MLflow run {run_id}" in out, out
    run = client_for(uri).get_run(run_id)
    assert run.data.tags[task_status_tag("lineage_qa")].startswith("ok at step ")
    (scored,) = client_for(uri).get_metric_history(run_id, task_metric("lineage_qa", "acc"))
    assert 0 <= scored.value <= 1 and scored.step == int(version.tags["step"]) == 6  # the run's last checkpoint
