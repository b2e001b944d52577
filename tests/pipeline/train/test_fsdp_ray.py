"""FSDP under Ray: a Ray Tune sweep whose trial trains on two Ray Train workers sharding the model (each worker
reports its own shards, Ray merges them into one checkpoint; a batch size the memory model says cannot fit is
recorded as oom without running), then the trial's run resumed on one worker from that checkpoint (resharded),
ending where a run that never stopped ends; and the two workers' checkpoint exported to a Hugging Face directory
that transformers loads, with the model's logits. The run's storage is the session's S3 bucket (a cluster's
setting): the shards go there, and the resumed worker reads them in place with ranged GETs. The exactness checks beside it (FSDP against DDP, bitwise
resume, 1 -> 2) run the same engine without Ray, in seconds: tests/pipeline/train/test_fsdp.py."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.pipeline.train.hf_helpers import assert_same_model, build_dataset
from tests.pipeline.train.test_fsdp import WEIGHT_TOL

pytestmark = pytest.mark.system

SPACE = {
    "metric": "val/loss", "mode": "min", "num_samples": 1, "max_concurrent_trials": 1, "skip_unfit_batch": True,
    "scheduler": {"type": "fifo"},
    "resources_per_trial": {"num_workers": 2, "cpus_per_worker": 1, "use_gpu": "false"},
    "fixed": {"ray.max_failures": 0, "train.parallel": "fsdp", "train.memory_limit_gib": 0.05, "train.max_steps": 4,
              "train.checkpoint_every": 4, "train.eval_every": 4, "train.log_every": 4},
    "params": {"train.batch_size": {"grid": [4, 4096]}},
}


def test_fsdp_sweep_trial_resumed_on_one_worker_and_exported(ray_session, s3_bucket, tmp_path, capfd):
    from pipeline import storage
    from pipeline.data.shards import ShardReader, load_manifest
    from pipeline.sweep.report import OK, OOM
    from pipeline.sweep.tune import run_sweep
    from pipeline.train.checkpoints.state import load_model_state, read_checkpoint_meta
    from pipeline.train.engine import Engine
    from pipeline.train.handoff.hf_export import export_checkpoint
    from pipeline.train.loop import fit
    from pipeline.train.ray_train import run_training

    store = f"{s3_bucket}/fsdp-ray-{tmp_path.name}"
    cfg, ds = build_dataset(tmp_path / "data", overrides={"tracking.enabled": False, "run.name": "fsdp-sweep",
                                                          "run.storage": store})
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    sweep = run_sweep(cfg, space)
    rows = {r.batch_size: r for r in sweep.rows}
    assert rows[4096].status == OOM and "largest batch that fits" in rows[4096].reason  # by the memory model
    trial = rows[4]
    assert trial.status == OK and trial.steps == 4
    run_dir = sweep.sweep_dir / "trials" / trial.trial_id
    assert not (run_dir / "ray").exists()  # the checkpoints are in the bucket
    (meta_file,) = storage.glob(f"{store}/tune/fsdp-sweep/trials/{trial.trial_id}/ray/phase0/checkpoint_*/meta.json")
    ckpt_uri = meta_file.rsplit("/", 1)[0]
    meta = read_checkpoint_meta(ckpt_uri)
    assert (meta["layout"], meta["world_size"], meta["counters"]["step"]) == ("sharded", 2, 4)
    shards = sorted(storage.basename(p) for p in storage.glob(f"{ckpt_uri}/sharded/*"))
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], "Ray did not merge both workers' shards"
    ckpt = storage.download(ckpt_uri, tmp_path / "ckpt")
    hf_dir = export_checkpoint(ckpt, tmp_path / "hf").out_dir  # consolidated on load

    # the trial's run continued to step 8 on one worker with the same global batch (its schedule still the trial's
    # train.max_steps=4: the rate stays at its floor): Ray Train restores the run by name, resharded 2 -> 1
    trial_cfg = cfg.replace({**yaml.safe_load(space.read_text())["fixed"], "ray.num_workers": 1,
                             "ray.cpus_per_worker": 1, "ray.use_gpu": "false", "train.batch_size": 8})
    second = run_training(trial_cfg, ds, run_dir, max_steps=8)
    out = capfd.readouterr().out
    assert "parallel: fsdp over 2 worker(s) (train.parallel=fsdp)" in out
    assert "resume: checkpoint written by 2 worker(s) (sharded layout), resumed on 1" in out
    assert "global batch changes" not in out
    # one worker holds the whole state: it read all of the shards, in place
    assert f"of shards from {ckpt_uri} (this worker's part)" in out, out[-3000:]
    assert read_checkpoint_meta(second.checkpoint)["counters"]["step"] == 8 and second.metrics["step"] == 8

    # a run that never stopped: the one-process engine over the same rows
    ref_cfg = trial_cfg.replace({"train.memory_limit_gib": 0.0})
    ref = Engine(ref_cfg, load_manifest(ds).vocab_size, torch.device("cpu"))
    t = ref_cfg.train
    last = fit(ref, lambda e, s: ShardReader(ds, "train", t.batch_size, seed=t.seed, epoch=e, start=s), None,
               max_steps=8, progress=False).last_train
    assert second.metrics["train/loss"] == pytest.approx(last["train/loss"], rel=1e-5)  # the mean over steps 5-8
    with storage.local_copy(second.checkpoint) as local:
        got = load_model_state(local)
    for name, want in ref.module.decoder.state_dict().items():
        torch.testing.assert_close(got[name], want, **WEIGHT_TOL, msg=name)

    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert_same_model(ckpt, hf_dir)


@pytest.mark.parametrize("mixer", ["resonance", "attention"])
def test_fsdp_run_with_eval_samples_finishes(mixer, ray_session, test_runs_root, capsys):
    """The command that once hung after its first evaluation (rank 0 generated through the sharded resonance mixer
    alone, and its next backward prefetched a gather the other worker never joined), through the CLI on two Ray
    Train workers: it finishes, with samples logged at every evaluation. A regression ends within the collective
    timeout with one line instead of hanging."""
    from mlflow.tracking import MlflowClient

    from pipeline.run import main

    name = f"fsdp-samples-{mixer}"
    code = main(["train", "--preset", "test", f"--model.mixer={mixer}", "--train.parallel=fsdp",
                 "--ray.num_workers=2", "--train.sample_tokens=16", "--train.eval_every=5", "--train.max_steps=20",
                 "--train.collective_timeout_s=120", "--model.compile=off", f"--run.root={test_runs_root}",
                 f"--run.name={name}"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    record = json.loads((test_runs_root / name / "run.json").read_text())
    assert record["status"] == "finished"
    client = MlflowClient(tracking_uri=f"sqlite:///{test_runs_root / 'mlflow.db'}")
    run = client.get_run(record["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["longtrain.parallel"].startswith("fsdp")
    samples = sorted(a.path for a in client.list_artifacts(run.info.run_id, "samples"))
    assert samples == [f"samples/step_{s:06d}.txt" for s in (5, 10, 15, 20)]
