"""Ray Train over the shards: exactly-once data across worker kills, the train stage read back from a real
MLflow server with the same losses as the Ray-free engine, and clear errors before any worker starts."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.train.engine import CheckpointError, Engine
from pipeline.train.loop import Hooks, fit
from pipeline.ray_runtime import worker_cpus
from pipeline.data.shards import DatasetError, ShardReader, load_manifest
from pipeline.data.synthetic import write_synthetic_dataset
from pipeline.tracking.tracker import TrackingError

pytestmark = pytest.mark.system

SEQ, VOCAB = 32, 128


@pytest.fixture(scope="module")
def synthetic_dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("synthetic_ds")
    write_synthetic_dataset(d, n_train=160, n_val=16, seq_len=SEQ, vocab_size=VOCAB, seed=3, rows_per_shard=48)
    return d


def cfg_for(tmp_path, **over):
    base = {"model.tier": "nano", "data.seq_len": SEQ, "data.vocab_size": 256, "train.batch_size": 4,
            "train.max_steps": 6, "train.warmup_steps": 2, "train.log_every": 1, "train.eval_every": 3,
            "train.eval_batches": 2, "train.checkpoint_every": 3, "train.sample_tokens": 0,
            "model.compile": "off", "run.root": str(tmp_path), "tracking.enabled": False,
            "eval.tasks": ""}  # the cpu preset's downstream task: not what these runs check
    base.update(over)
    return load_config("cpu", base)


def audit_records(run_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for f in sorted((run_dir / "data_audit").glob("rank_*.jsonl")):
        out[int(f.stem.split("_")[1])] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def test_exactly_once_across_two_worker_kills(ray_session, synthetic_dataset, tmp_path):
    """2 workers, one epoch (160 sequences / 8 per step = 20 steps), checkpoint every 2 steps; a training
    worker is SIGKILLed at two different steps. The run ends at exactly step 20 and, counting for each
    step only the attempt that survived, every seq_id was consumed exactly once."""
    from pipeline.train.ray_train import run_training

    cfg = cfg_for(tmp_path, **{"train.max_steps": 20, "train.checkpoint_every": 2, "train.eval_every": 100,
                               "ray.num_workers": 2, "ray.max_failures": 4})
    run_dir = tmp_path / "run"
    result = {}

    def train():
        try:
            result["out"] = run_training(cfg, synthetic_dataset, run_dir, audit_data=True)
        except BaseException as exc:  # surfaced below
            result["error"] = exc

    thread = threading.Thread(target=train)
    thread.start()
    killed: list[tuple[int, int]] = []
    deadline = time.monotonic() + 420
    for kill_at, rank in ((5, 1), (12, 0)):
        while time.monotonic() < deadline and thread.is_alive():
            recs = audit_records(run_dir).get(rank, [])
            fresh = [r for r in recs if r["pid"] not in {p for p, _ in killed}]
            if fresh and fresh[-1]["step"] >= kill_at:
                os.kill(fresh[-1]["pid"], signal.SIGKILL)
                killed.append((fresh[-1]["pid"], fresh[-1]["step"]))
                break
            time.sleep(0.02)
    thread.join(timeout=max(1, deadline - time.monotonic()))
    assert not thread.is_alive(), "training did not finish in time"
    assert "error" not in result, result.get("error")
    assert len(killed) == 2, f"the run ended before both kills: {killed}"

    out = result["out"]
    assert out.metrics["step"] == 20
    records = audit_records(run_dir)
    assert set(records) == {0, 1}
    # each worker computes with the CPUs it reserved (auto: this machine's cores split between the two)
    assert {r["threads"] for recs in records.values() for r in recs} == {worker_cpus(cfg)}
    for rank, recs in records.items():
        assert len({r["pid"] for r in recs}) >= 3, f"rank {rank} was not restarted twice"
    consumed = []
    for rank, recs in records.items():
        last_attempt = {}
        for r in recs:  # a restart re-runs the steps after the checkpoint: the later record wins
            last_attempt[r["step"]] = r
        assert sorted(last_attempt) == list(range(1, 21)), f"rank {rank} steps {sorted(last_attempt)}"
        consumed += [i for r in last_attempt.values() for i in r["seq_ids"]]
    assert sorted(consumed) == list(range(160)), "a sequence was skipped or seen twice"


def test_session_tracks_to_a_real_mlflow_server_and_matches_the_ray_free_engine(ray_session, mlflow_server, tmp_path):
    """The whole train stage (prepare from local files -> Ray Train -> artifacts) logged to a server; the
    per-step losses it logged (1 worker on CPU) equal the Ray-free engine's for the same seed and data."""
    from mlflow.tracking import MlflowClient

    from pipeline.train.session.train_session import TrainSession, load_phases

    uri, _ = mlflow_server
    corpus = tmp_path / "corpus.jsonl"
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jugglers".split()
    with open(corpus, "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(40 + i % 30))}) + "\n")
    cfg = load_config("test", {"data.source": "files", "data.path": str(corpus), "data.vocab_size": 300,
                               "run.root": str(tmp_path / "runs"), "tracking.tracking_uri": uri,
                               "tracking.experiment": "train-session-test", "model.compile": "off",
                               "train.log_every": 1})
    run_dir = tmp_path / "runs" / "tracked"
    run_dir.mkdir(parents=True)
    result = TrainSession(cfg, run_dir, load_phases(None, cfg)).run()
    assert result.checkpoint is not None and (result.checkpoint / "model.safetensors").is_file()

    client = MlflowClient(tracking_uri=uri)
    record = json.loads((run_dir / "run.json").read_text())
    run = client.get_run(record["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["longtrain.kernels"].startswith("cross_entropy, sampling, resonance_scan, moe_dispatch: reference (the "
                                                         "tensors are on the cpu")
    p = run.data.params
    assert p["train.batch_size"] == "4" and p["model.tier"] == "nano" and int(p["model.params"]) > 0
    assert len(p["tokenizer_sha256"]) == 64 and p["manifest_hash"] and p["world_size"] == "1"
    losses = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in losses] == list(range(1, 9))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [4, 8]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "manifest.json", "training_curves.png", "run.json"} <= names
    samples = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert samples, "no generated text samples at evaluation steps"

    dataset = Path(record["datasets"][0])
    engine = Engine(cfg, load_manifest(dataset).vocab_size, torch.device("cpu"))
    local = []
    fit(engine, lambda e, s: ShardReader(dataset, "train", cfg.train.batch_size, seed=cfg.train.seed, epoch=e, start=s),
        None, Hooks(on_log=lambda e, m: local.append(m["train/loss"])), progress=False)
    assert [m.value for m in losses] == pytest.approx(local, rel=1e-5, abs=1e-6)


def test_bad_input_fails_before_any_worker_starts(ray_session, synthetic_dataset, tmp_path, hang_up_server):
    from pipeline.train.ray_train import run_training

    cfg = cfg_for(tmp_path)
    with pytest.raises(DatasetError, match="manifest.json is missing"):
        run_training(cfg, tmp_path / "no-such-shards", tmp_path / "r1")
    with pytest.raises(DatasetError, match="dataset has seq_len=32 but data.seq_len=64"):
        run_training(cfg.replace({"data.seq_len": 64}), synthetic_dataset, tmp_path / "r2")
    other = Engine(cfg.replace({"model.tier": "A", "data.seq_len": SEQ}), VOCAB, torch.device("cpu"))
    other.save(tmp_path / "ckpt-A")
    with pytest.raises(CheckpointError, match="tier 'A' but model.tier is 'nano'"):
        run_training(cfg, synthetic_dataset, tmp_path / "r3", init_from=tmp_path / "ckpt-A")
    small = Engine(cfg, 64, torch.device("cpu"))
    small.save(tmp_path / "ckpt-v64")
    with pytest.raises(CheckpointError, match="vocab 64 but the dataset's tokenizer has 128"):
        run_training(cfg, synthetic_dataset, tmp_path / "r4", init_from=tmp_path / "ckpt-v64")
    from pipeline.train.session.train_session import TrainSession, load_phases

    # a tracking server that is there but answers nothing: refused after one connection, not MLflow's retries
    bad = cfg.replace({"tracking.enabled": True, "tracking.tracking_uri": hang_up_server.uri})
    (tmp_path / "r5").mkdir()
    with pytest.raises(TrackingError, match="unreachable"):
        TrainSession(bad, tmp_path / "r5", load_phases(None, bad)).run()
    assert hang_up_server.connections == 1
    assert not list(tmp_path.glob("r*/ray")), "Ray Train was started for bad input"
