"""A real Ray Train FSDP run: two workers shard the model and each reports its own shards, Ray merges them into
one checkpoint; the run resumes on one worker from that checkpoint (resharded) and ends where a run that never
stopped ends; the two workers' checkpoint exports to a Hugging Face directory transformers loads, with the
model's logits. The exactness checks beside it (FSDP against DDP, bitwise resume, 1 -> 2) run the same engine
without Ray in seconds: tests/pipeline/train/test_fsdp.py."""
from __future__ import annotations

import json

import pytest
import torch

from tests.pipeline.train.hf_helpers import assert_same_model, build_dataset
from tests.pipeline.train.test_fsdp import WEIGHT_TOL


def test_two_fsdp_workers_checkpoint_resume_on_one_and_export(ray_session, tmp_path, capfd):
    from pipeline.data.shards import ShardReader, load_manifest
    from pipeline.train.checkpoint import load_model_state, read_checkpoint_meta
    from pipeline.train.engine import Engine
    from pipeline.train.export import export_checkpoint
    from pipeline.train.loop import fit
    from pipeline.train.ray_train import run_training

    cfg, ds = build_dataset(tmp_path / "data", overrides={
        "train.parallel": "fsdp", "ray.num_workers": 2, "train.max_steps": 8, "train.checkpoint_every": 4,
        "train.eval_every": 4, "train.log_every": 4, "tracking.enabled": False, "ray.max_failures": 0})
    vocab = load_manifest(ds).vocab_size
    run_dir = tmp_path / "run"
    first = run_training(cfg, ds, run_dir, max_steps=4)
    meta = read_checkpoint_meta(first.checkpoint)
    assert (meta["layout"], meta["world_size"], meta["counters"]["step"]) == ("sharded", 2, 4)
    shards = sorted(p.name for p in (first.checkpoint / "sharded").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], "Ray did not merge both workers' shards"
    hf_dir = export_checkpoint(first.checkpoint, tmp_path / "hf").out_dir  # consolidated on load

    # the same run on one worker with the same global batch: Ray Train restores it by name, resharded 2 -> 1
    second = run_training(cfg.replace({"ray.num_workers": 1, "train.batch_size": 2 * cfg.train.batch_size}), ds,
                          run_dir, max_steps=8)
    out = capfd.readouterr().out
    assert "parallel: fsdp over 2 worker(s) (train.parallel=fsdp)" in out
    assert "resume: checkpoint written by 2 worker(s) (sharded layout), resumed on 1" in out
    assert "global batch changes" not in out
    assert read_checkpoint_meta(second.checkpoint)["counters"]["step"] == 8 and second.metrics["step"] == 8

    # a run that never stopped: the one-process engine over the same rows
    ref_cfg = cfg.replace({"train.batch_size": 2 * cfg.train.batch_size})
    ref = Engine(ref_cfg, vocab, torch.device("cpu"))
    t = ref_cfg.train
    last = fit(ref, lambda e, s: ShardReader(ds, "train", t.batch_size, seed=t.seed, epoch=e, start=s), None,
               progress=False).last_train
    assert second.metrics["train/loss"] == pytest.approx(last["train/loss"], rel=1e-5)  # the mean over steps 5-8
    got = load_model_state(second.checkpoint)
    for name, want in ref.module.decoder.state_dict().items():
        torch.testing.assert_close(got[name], want, **WEIGHT_TOL, msg=name)

    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert_same_model(first.checkpoint, hf_dir)
