"""Everything on object storage, against the session's real S3 server (SeaweedFS, tests/conftest.py `s3_bucket`): a
corpus in the bucket prepared into a dataset in the bucket, validated, trained (stopped with Ctrl+C), resumed,
evaluated, sampled and exported from there with run.storage the one bucket setting; a prepare killed midway and its
rerun; and one clear line for every bad URI and credential, before any worker starts.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline import storage
from pipeline.config import load_config
from pipeline.data.pack import prepare
from pipeline.data.shards import MANIFEST_FILE, ShardReader, load_manifest
from pipeline.data.validate_dataset import validate_dataset
from pipeline.run import main
from tests.pipeline.data.helpers import sample_docs

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def test_the_whole_pipeline_on_object_storage(s3_bucket, s3_dataset, ray_address, capsys, tmp_path):
    """prepare (s3 corpus -> s3 store) -> validate -> train, started as a script's background job and stopped by
    Ctrl+C -> --resume, every sequence seen exactly once -> a larger train.max_steps extending the finished run -> eval
    -> generate -> export, with every dataset, checkpoint, audit and MLflow artifact in the bucket and none of them on
    the driver's disk."""
    dataset, overrides, run_root = s3_dataset.dataset, ["--preset", "test", *s3_dataset.overrides], s3_dataset.run_root
    assert dataset.startswith(f"{s3_bucket}/store/datasets/")
    m = load_manifest(dataset)
    assert m.source["path"].startswith("s3://") and m.counts["documents"] == len(sample_docs(100, 3000))
    assert not (run_root / "datasets").exists()  # nothing of the dataset on this machine

    assert main(["validate", dataset]) == 0
    assert "OK" in capsys.readouterr().out

    # train in a subprocess and stop it with Ctrl+C after a few steps: the driver writes the stop request into
    # <run.storage>/<run>/STOP in the bucket, the workers checkpoint there and stop at the same step. Started as a
    # shell script's background job (`cmd &`) starts it: with SIGINT ignored, which the command undoes.
    steps = 120
    args = [*overrides, "--run.name=s3run", "--train.sample_tokens=4", "--audit-data", f"--train.max_steps={steps}",
            "--train.log_every=1", "--train.checkpoint_every=40", "--train.eval_every=40", "--address", ray_address]
    proc = subprocess.Popen([sys.executable, str(ROOT / "pipeline" / "run.py"), "train", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(rf"step (\d+)/{steps} ", line)
            if m and int(m.group(1)) >= 3:
                proc.send_signal(signal.SIGINT)
                break
        out = "".join(lines) + proc.communicate(timeout=300)[0]
    finally:
        watchdog.cancel()
    assert proc.returncode == 0, out[-4000:]
    run_dir = run_root / "s3run"
    assert "stop requested" in out and "stopped after a checkpoint" in out, out[-4000:]
    assert f"continue with: python pipeline/run.py train --resume {run_dir}\n" in out, out[-4000:]
    record = _record(run_dir)
    first = record["checkpoint"]
    assert record["status"] == "stopped" and record.get("phases_done", 0) == 0, record
    assert first.startswith(f"{s3_bucket}/store/s3run/ray/phase0/checkpoint_") and record["datasets"] == [dataset]
    assert not (run_dir / "ray").exists() and not (run_dir / "data_audit").exists()
    assert not storage.exists(f"{s3_bucket}/store/s3run/STOP"), "the stop request outlived the run"
    with storage.local_copy(first) as local:
        stopped_at = json.loads((local / "meta.json").read_text())["counters"]["step"]
    assert 3 <= stopped_at < steps
    audit_file = f"{s3_bucket}/store/s3run/data_audit/rank_0.jsonl"

    def audit() -> list[dict]:
        return [json.loads(line) for line in storage.read_text(audit_file).splitlines() if line.strip()]

    assert max(r["step"] for r in audit()) == stopped_at, "the checkpoint is not at the step the run stopped"

    # --resume: Ray Train restores the checkpoint from the bucket and the workers go on at the next step,
    # reading the same dataset, to the end
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"==> train: tier nano, steps {stopped_at}..{steps} (resumed at step {stopped_at}), 1 Ray Train" in out
    record = _record(run_dir)
    assert record["status"] == "finished" and record["phases_done"] == 1 and record["checkpoint"] != first
    assert record["datasets"] == [dataset], "the resumed run prepared its dataset again instead of reusing it"
    with storage.local_copy(record["checkpoint"]) as local:
        meta = json.loads((local / "meta.json").read_text())
    assert meta["counters"]["step"] == steps and meta["dataset_dir"] == dataset
    rows = audit()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # before the stop, then after it: none twice
    assert {r["pid"] for r in rows[:stopped_at]}.isdisjoint({r["pid"] for r in rows[stopped_at:]})
    ids = [i for r in rows for i in r["seq_ids"]]
    assert len(ids) == len(set(ids)) == steps * 4  # every sequence exactly once

    # The finished run, extended: Ray Train restores its last checkpoint and trains on, on a stretched schedule
    longer = steps + 4
    assert main(["train", "--resume", str(run_dir), f"--train.max_steps={longer}"]) == 0
    out = capsys.readouterr().out
    assert f"==> train: tier nano, steps {steps}..{longer} (resumed at step {steps}; train.max_steps {steps} -> " \
           f"{longer}: " in out, out[-3000:]
    record = _record(run_dir)
    with storage.local_copy(record["checkpoint"]) as local:
        assert record["status"] == "finished" and \
            json.loads((local / "meta.json").read_text())["counters"]["step"] == longer
    last = {r["step"]: r for r in audit()}  # the latest row of each step
    assert sorted(last) == list(range(1, longer + 1))
    ids = [i for r in last.values() for i in r["seq_ids"]]
    assert len(ids) == len(set(ids)) == longer * 4  # the data cursor went on from where the run had finished

    out = capsys.readouterr().out
    assert main(["eval", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "eval/loss=" in out and "logged to MLflow run" in out
    assert main(["generate", "--resume", str(run_dir), "--prompt", "The", "--max-new-tokens", "4"]) == 0
    assert "generate: batch 1" in capsys.readouterr().out
    assert main(["export", "--resume", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()

    # MLflow's artifacts went to the same bucket: <run.storage>/mlartifacts
    artifacts = storage.glob(f"{s3_bucket}/store/mlartifacts/**")
    names = {a.rsplit("/", 1)[-1] for a in artifacts}
    assert {"manifest.json", "config.json", "training_curves.png", "run.json"} <= names, names
    assert any("/samples/step_" in a for a in artifacts)  # written by rank 0, in its worker


def test_a_sweep_on_object_storage(s3_bucket, s3_dataset, tmp_path, capsys):
    """A Tune sweep with run.storage the bucket: every trial trains on the bucket's dataset and checkpoints into
    the bucket, Tune's experiment state goes there too, and the driver's disk holds only the sweep's report."""
    space = tmp_path / "bs.yaml"
    space.write_text("metric: val/loss\nmode: min\nscheduler: {type: fifo}\n"
                     "resources_per_trial: {num_workers: 1, cpus_per_worker: 1, use_gpu: 'false'}\n"
                     "fixed: {ray.max_failures: 0, train.max_steps: 4, train.eval_every: 2, train.checkpoint_every: 2,"
                     " train.eval_batches: 1, train.sample_tokens: 0}\n"
                     "params: {train.batch_size: {grid: [1, 2]}}\n")
    assert main(["tune", "--space", str(space), "--preset", "test", *s3_dataset.overrides, "--run.name=s3sweep"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "| ok |" in line]
    assert len(rows) == 2, out[-3000:]
    store = f"{s3_bucket}/store/tune/s3sweep"
    last_step: dict[str, int] = {}  # trial -> its latest checkpoint's step, each trial in a storage of its own
    for meta_file in storage.glob(f"{store}/trials/*/ray/**/meta.json"):
        meta = json.loads(storage.read_text(meta_file))
        assert meta["dataset_dir"] == s3_dataset.dataset
        trial = meta_file.split("/trials/")[1].split("/")[0]
        last_step[trial] = max(last_step.get(trial, 0), meta["counters"]["step"])
    assert sorted(last_step.values()) == [4, 4], last_step
    assert storage.glob(f"{store}/ray_tune/s3sweep/experiment_state-*.json"), "Tune's state is not in the bucket"
    local = s3_dataset.run_root / "tune" / "s3sweep"
    assert {p.name for p in local.iterdir()} >= {"sweep_table.md", "best_preset.yaml"}
    assert not list(local.rglob("meta.json")) and not list(local.rglob("*.safetensors"))


def test_an_endpoint_set_only_in_the_aws_config_file_reaches_the_bucket(s3_bucket, s3_dataset, tmp_path,
                                                                        monkeypatch, capsys):
    """No AWS_ENDPOINT_URL: the profile's endpoint_url in ~/.aws/config (AWS_CONFIG_FILE here) names the store."""
    endpoint = storage.endpoint()
    for k in (*storage.ENDPOINT_ENVS, "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    config = tmp_path / "config"
    config.write_text(f"[profile lab]\nendpoint_url = {endpoint}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "lab")
    storage._s3.cache_clear()  # no filesystem made from the environment's endpoint is reused
    try:
        storage.check(f"{s3_bucket}/store", what="run.storage", write=True)
        assert main(["validate", s3_dataset.dataset]) == 0
        assert "OK" in capsys.readouterr().out
    finally:
        storage._s3.cache_clear()


def _held_prepare(args: list[str], ray_address: str, out: str) -> tuple[subprocess.Popen, str]:
    """`prepare` in a subprocess, held after its shards are written (LONGTRAIN_PREPARE_HOLD): (process, marker)."""
    env = {**os.environ, "LONGTRAIN_PREPARE_HOLD": "shards", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.data.stages", "prepare", "test", *args,
                             f"--ray.address={ray_address}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 180
    while True:
        mine = [m for m in storage.glob(f"{out}/build-*/.hold-shards") if storage.read_text(m) == str(proc.pid)]
        if mine:
            return proc, mine[0]
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"prepare never reached the hold point: {proc.stderr.read().decode()[-3000:]}")
        time.sleep(0.3)


def _builds(out: str) -> set[str]:
    return {e.path.rsplit("/", 1)[-1] for e in storage.listdir(out)} - {MANIFEST_FILE}


def test_prepares_killed_midway_or_racing_on_s3_never_publish_a_broken_dataset(s3_bucket, s3_corpus, s3_dataset,
                                                                              ray_address, tmp_path):
    """One prepare is SIGKILLed after writing its shards: no manifest, so no dataset. A second is held at the same
    point while a third (this process) runs start to end: the third removes the killed build (its process is
    gone), keeps the held one (alive), and publishes. Released, the second finds that manifest, drops its own
    build and returns the same dataset. The tokenizer is the session dataset's, given as a URI."""
    dataset = s3_dataset.dataset
    tokenizer = storage.join(dataset, load_manifest(dataset).tokenizer_file)
    out = f"{s3_bucket}/raced"
    args = [f"--run.root={tmp_path}", "--data.source=files", f"--data.path={s3_corpus}",
            f"--data.tokenizer={tokenizer}", f"--data.dataset_dir={out}", "--data.rows_per_shard=64",
            "--data.tokenize_actors=1"]
    killed, _ = _held_prepare(args, ray_address, out)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    killed.stderr.close()
    assert not storage.exists(f"{out}/{MANIFEST_FILE}")
    (dead,) = {b for b in _builds(out) if not b.endswith(".lease")}
    assert storage.glob(f"{out}/{dead}/train-*.parquet")  # shards written, never published
    report = validate_dataset(out)
    assert not report.ok and "manifest.json is missing" in report.errors[0]

    held, marker = _held_prepare(args, ray_address, out)
    try:
        alive = marker.split("/")[-2]
        assert prepare(load_config("test", args)) == out
        published = load_manifest(out).tokenizer_file.split("/")[0]
        assert published not in (dead, alive) and validate_dataset(out).ok
        assert _builds(out) == {published, f"{published}.lease", alive, f"{alive}.lease"}  # the dead one is gone
        storage.delete(marker)  # let the held prepare go on: it finds the manifest and drops its own build
        assert held.wait(timeout=120) == 0, held.stderr.read().decode()[-3000:]
    finally:
        if held.poll() is None:
            os.killpg(held.pid, signal.SIGKILL)
        held.stderr.close()
    assert load_manifest(out).tokenizer_file.split("/")[0] == published and validate_dataset(out).ok
    assert _builds(out) == {published, f"{published}.lease"}
    assert not storage.glob(f"{out}/{published}/_parts/*")


BAD_LOCATIONS = [
    # (what is wrong, CLI arguments after the stage, environment changes, the one line expected)
    ("unreachable endpoint", ["--data.path=s3://longtrain-test/corpus/*.jsonl"], {"AWS_ENDPOINT_URL": "CLOSED"},
     "cannot reach endpoint http://127.0.0.1:"),
    ("missing bucket", ["--data.path=s3://no-such-bucket-here/corpus/*.jsonl"], {},
     "the bucket of data.path s3://no-such-bucket-here/corpus/*.jsonl does not exist; create it"),
    ("denied access", ["--data.path=s3://longtrain-test/corpus/*.jsonl"], {"AWS_SECRET_ACCESS_KEY": "wrong"},
     "access to data.path s3://longtrain-test/corpus/*.jsonl was denied"),
    ("unknown access key", ["--data.path=s3://longtrain-test/corpus/*.jsonl"], {"AWS_ACCESS_KEY_ID": "nobody"},
     "access to data.path s3://longtrain-test/corpus/*.jsonl was denied"),
    ("no matching file", ["--data.path=s3://longtrain-test/corpus/*.parquet"], {},
     "data.path='s3://longtrain-test/corpus/*.parquet' matches no .txt, .jsonl, .json or .parquet files, nor .txt, "
     ".jsonl or .json files compressed as .gz, .bz2, .zst or .zstd; check the URI and the pattern"),
    ("no such prefix", ["--data.path=s3://longtrain-test/nothing-here"], {},
     "data.path='s3://longtrain-test/nothing-here' does not exist"),
    ("store in a missing bucket", ["--data.path=s3://longtrain-test/corpus/*.jsonl",
                                   "--run.storage=s3://no-such-bucket-here/store"], {},
     "the bucket of the dataset store s3://no-such-bucket-here/store/datasets/"),
]


@pytest.mark.parametrize("what, args, env, message", BAD_LOCATIONS, ids=[b[0] for b in BAD_LOCATIONS])
def test_bad_locations_and_credentials_get_one_line_before_any_work(what, args, env, message, s3_corpus, tmp_path,
                                                                   monkeypatch, capsys):
    """`prepare` fails at once with one line naming the URI and the fix; no Ray is started for it (the bucket,
    the credentials and the files are checked before): the build, which starts or joins Ray first, is never
    entered."""
    for name, value in env.items():
        monkeypatch.setenv(name, f"http://127.0.0.1:{_closed_port()}" if value == "CLOSED" else value)
    builds = []

    def build(*args, **kwargs):
        builds.append(args)
        raise RuntimeError("the dataset build began: Ray would start before the location was checked")

    monkeypatch.setattr("pipeline.data.pack._build", build)
    code = main(["prepare", "--preset", "test", "--data.source=files", f"--run.root={tmp_path}", *args])
    err = capsys.readouterr().err
    assert builds == [], err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_train_refuses_a_storage_it_cannot_use_before_any_worker(s3_bucket, tmp_path, monkeypatch, capsys):
    """run.storage in the bucket with a wrong key: train stops at its first check, before data or Ray work."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    code = main(["train", "--preset", "test", f"--run.root={tmp_path}", f"--run.storage={s3_bucket}/store2",
                 "--run.name=denied"])
    err = capsys.readouterr().err
    assert code == 2 and f"access to run.storage {s3_bucket}/store2 was denied" in err, err
    assert not (tmp_path / "datasets").exists()
    monkeypatch.undo()  # the right key again
    assert main(["validate", f"{s3_bucket}/store2/none"]) == 1  # no manifest there: the report says so
    assert "is not a prepared dataset: manifest.json is missing" in capsys.readouterr().out


def test_a_dataset_in_any_fsspec_filesystem_reads_like_a_local_one(test_runs_root):
    """memory:// (fsspec's in-process filesystem) stands for any protocol pyarrow has no filesystem of its own for:
    the session's dataset copied there validates and reads the same batches."""
    local = next((test_runs_root / "datasets").glob("*/manifest.json")).parent
    target = "memory://datasets/copy"
    for f in local.rglob("*"):
        if f.is_file() and not f.name.startswith("."):
            storage.write_bytes(storage.join(target, f.relative_to(local).as_posix()), f.read_bytes())
    assert validate_dataset(target).ok
    a, b = ShardReader(local, "train", 4), ShardReader(target, "train", 4)
    assert all((x["tokens"] == y["tokens"]).all() for x, y in zip(a, b))


def test_workers_on_other_nodes_never_get_a_path_of_this_machine(monkeypatch):
    """On a cluster whose workers run elsewhere, a bare local path for something workers open is refused with the
    fix; a URI (file:// for a filesystem mounted on every node) is fine."""
    from pipeline import ray_runtime
    from pipeline.storage import StorageError

    cfg = load_config("test")
    monkeypatch.setattr(ray_runtime, "workers_may_be_elsewhere", lambda c: True)
    with pytest.raises(StorageError, match=r"the dataset /data/ds is on this machine's disk, .*set run.storage"):
        ray_runtime.require_shared(cfg, {"the dataset": "/data/ds"})
    ray_runtime.require_shared(cfg, {"the dataset": "s3://bucket/ds", "ray.storage_path": "file:///shared/ckpt"})
    monkeypatch.setattr(ray_runtime, "workers_may_be_elsewhere", lambda c: False)
    ray_runtime.require_shared(cfg, {"the dataset": "/data/ds"})  # one machine: its own disk is fine


def _closed_port() -> int:
    from bench.s3_server import free_ports

    return free_ports(1)[0]  # free now: nothing listens there


@pytest.mark.timeout(1200)  # three Ray Train runs: 150 s in the suite on 2 idle cores, past 300 s at a load of ~20
def test_data_wait_bench_smoke(s3_bucket, ray_address, mlflow_server, tmp_path):
    """bench/data_wait.py at its smoke size on the session's S3 server (`--storage`, the way a real bucket is
    given): the three sides measured (local disk, S3, a 3-source mixture), the JSON written with both ratios,
    nothing left in the bucket."""
    # the session's Ray and MLflow server instead of a Ray and a SQLite store of its own (~4 s of migrations)
    env = {**os.environ, "RAY_ADDRESS": ray_address, "MLFLOW_TRACKING_URI": mlflow_server[0]}
    proc = subprocess.run([sys.executable, "bench/data_wait.py", "--smoke", "--storage", f"{s3_bucket}/bench",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("data_wait_*.json")
    res = json.loads(result.read_text())
    assert set(res["summary"]) == {"local", "s3", "mixture"} and res["s3"] == f"{s3_bucket}/bench"
    for side in res["summary"].values():
        assert 0 <= side["steady_data_wait"] < 1 and side["steady_tokens_per_s"] > 0
    assert res["tokens_per_s_ratio_mixture_over_local"] > 0 and "3-source mixture" in proc.stdout
    assert not storage.glob(f"{s3_bucket}/bench/**")
