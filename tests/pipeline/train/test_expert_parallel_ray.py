"""Expert parallelism under Ray Train: four workers as data 2 x experts 2 (replica 2 x expert 2: every worker reads
its own rows, each pair of an expert group splits the 8 experts of nano-moe 4 + 4) with FSDP train 4 steps and stop;
Ray Train resumes the run at expert degree 4 (2 experts a worker) to step 8. It ends where one process holding every
expert ends after 8 steps over the same global batch of 8 rows. Two Ray Train runs (the exactness of every degree,
DDP and FSDP, both families, without Ray, is tests/pipeline/train/test_expert_parallel.py).

    .venv/bin/python -m pytest -q tests/pipeline/train/test_expert_parallel_ray.py      (~1-2 min on 2 idle cores)

Tolerance: as tests/pipeline/train/test_context_parallel_ray.py states (the order of floating-point sums changes,
nothing else): the mean training loss of steps 5-8 and the validation loss rel 1e-5, weights 1e-4 absolute.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.data.synthetic import write_synthetic_dataset

pytestmark = pytest.mark.system

SEQ, VOCAB = 32, 128
WEIGHT_TOL = dict(rtol=0, atol=1e-4)


def cfg_for(tmp_path: Path, **over):
    base = {"model.tier": "nano-moe", "data.seq_len": SEQ, "data.vocab_size": 256, "train.batch_size": 2,
            "train.max_steps": 8, "train.warmup_steps": 2, "train.log_every": 4, "train.eval_every": 4,
            "train.eval_batches": 2, "train.checkpoint_every": 4, "train.sample_tokens": 0, "train.parallel": "fsdp",
            "model.compile": "off", "run.root": str(tmp_path), "tracking.enabled": False, "ray.max_failures": 0,
            "ray.cpus_per_worker": 1, "eval.tasks": ""}
    return load_config("cpu", {**base, **over})


def one_process_reference(tmp_path: Path, ds: Path):
    """Every expert in one process, the global batch of 8 rows (4 workers x 2) for 8 steps, evaluated on the
    validation rows the 4 workers read (2 batches of 2 each: 2 of 8 here)."""
    from pipeline.data.shards import ShardReader, eval_reader, load_manifest
    from pipeline.train.engine import Engine
    from pipeline.train.loop import Hooks, fit

    cfg = cfg_for(tmp_path, **{"train.batch_size": 8})
    t = cfg.train
    engine = Engine(cfg, load_manifest(ds).vocab_size, torch.device("cpu"), parallel="none")
    result = fit(engine, lambda e, s: ShardReader(ds, "train", t.batch_size, seed=t.seed, epoch=e, start=s),
                 lambda: eval_reader(ds, t.batch_size), Hooks(), max_steps=8, progress=False)
    return {**result.last_train, **result.last_eval}, engine


@pytest.mark.timeout(1800)
def test_data2_experts2_with_fsdp_resumes_at_expert_degree_4_and_ends_where_one_process_ends(ray_session, tmp_path,
                                                                                              capfd):
    from pipeline.storage import local_copy
    from pipeline.train.checkpoints.state import load_model_state, read_checkpoint_meta
    from pipeline.train.ray_train import run_training

    ds = tmp_path / "ds"
    write_synthetic_dataset(ds, n_train=160, n_val=16, seq_len=SEQ, vocab_size=VOCAB, seed=3, rows_per_shard=48)
    run_dir = tmp_path / "ep"
    ep2 = cfg_for(tmp_path, **{"ray.num_workers": 4, "train.expert_parallel_degree": 2})
    first = run_training(ep2, ds, run_dir, max_steps=4)
    out = capfd.readouterr().out
    ep4 = cfg_for(tmp_path, **{"ray.num_workers": 4, "train.expert_parallel_degree": 4})
    second = run_training(ep4, ds, run_dir, max_steps=8)  # Ray Train restores it by name, at another degree
    out += capfd.readouterr().out
    want, reference = one_process_reference(tmp_path, ds)

    assert first.metrics["step"] == 4 and second.metrics["step"] == 8 and reference.step == 8
    assert "parallel: fsdp over 4 worker(s)" in out, out[-3000:]
    assert "experts: expert 2: 8 experts over 2 ranks (4 each, all-to-all per MoE layer), 2 replica(s)" in out
    assert "experts: expert 4: 8 experts over 4 ranks (2 each" in out
    assert "expert parallel degree 2 -> 4 (the checkpoint holds every expert whole)" in out, out[-3000:]
    meta = read_checkpoint_meta(second.checkpoint)
    assert (meta["layout"], meta["world_size"], meta["config"]["train"]["expert_parallel_degree"]) == ("sharded", 4, 4)

    for key in ("train/loss", "val/loss"):  # the mean over steps 5-8; the evaluation at step 8
        assert second.metrics[key] == pytest.approx(want[key], rel=1e-5), key
    with local_copy(second.checkpoint) as local:
        got = load_model_state(local)  # consolidated in one process: every expert whole
    ref = reference.module.decoder.state_dict()
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        torch.testing.assert_close(got[name], tensor, **WEIGHT_TOL, msg=name)
