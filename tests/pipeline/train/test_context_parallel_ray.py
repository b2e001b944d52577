"""Context parallelism under Ray Train: four workers as data 2 x context 2 with FSDP train 4 steps, stop, and are
resumed by Ray Train to step 8; they end where data 2 x context 1 ends after 8 steps without stopping: one process
with the global batch (2 data ranks x 2 rows: the same rows at every step as two data ranks read, checked in
`one_process_reference`), the reference tests/pipeline/train/test_fsdp_ray.py and test_fsdp.py use too. Two Ray
Train runs (the exactness of every degree against one process, in seconds and without Ray, is
tests/pipeline/train/test_context_parallel.py).

    .venv/bin/python -m pytest -q tests/pipeline/train/test_context_parallel_ray.py      (~1-3 min on 2 idle cores)

Tolerance: as tests/pipeline/train/test_fsdp.py states for a change of worker count (the order of floating-point sums
changes, nothing else): the mean training loss of steps 5-8 and the validation loss rel 1e-5, weights 1e-4 absolute
(tests/pipeline/train/test_context_parallel.py says why).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.data.synthetic import write_synthetic_dataset

pytestmark = pytest.mark.system

SEQ, VOCAB = 32, 128
WEIGHT_TOL = dict(rtol=0, atol=1e-4)  # as tests/pipeline/train/test_context_parallel.py says why


def cfg_for(tmp_path: Path, **over):
    base = {"model.tier": "nano", "data.seq_len": SEQ, "data.vocab_size": 256, "train.batch_size": 2,
            "train.max_steps": 8, "train.warmup_steps": 2, "train.log_every": 4, "train.eval_every": 4,
            "train.eval_batches": 2, "train.checkpoint_every": 4, "train.sample_tokens": 0, "train.parallel": "fsdp",
            "model.compile": "off", "run.root": str(tmp_path), "tracking.enabled": False, "ray.max_failures": 0,
            "ray.cpus_per_worker": 1, "eval.tasks": ""}  # the cpu preset's downstream task: not what is checked
    return load_config("cpu", {**base, **over})


def one_process_reference(tmp_path: Path, ds: Path):
    """Data 2 x context 1 as one process reads and trains it: the global batch of 4 rows (2 data ranks x 2) for 8
    steps, evaluated on the validation rows both data ranks read (train.eval_batches of 2 rows each: 2 of 4 here).
    Returns (the loop's last training and evaluation metrics, the rows of each step, the engine)."""
    from pipeline.data.shards import ShardReader, eval_reader, load_manifest
    from pipeline.train.engine import Engine
    from pipeline.train.loop import Hooks, fit

    cfg = cfg_for(tmp_path, **{"train.batch_size": 4})
    t = cfg.train
    # every step reads what the two data ranks read together (ShardReader's rank r takes its slice of the global
    # batch; the same holds for eval_reader's validation rows)
    two = [ShardReader(ds, "train", 2, seed=t.seed, rank=r, world_size=2) for r in (0, 1)]
    assert [sorted([*a["seq_id"].tolist(), *b["seq_id"].tolist()]) for _, a, b in zip(range(8), *two)] == \
        [sorted(b["seq_id"].tolist()) for _, b in zip(range(8), ShardReader(ds, "train", 4, seed=t.seed))]
    engine = Engine(cfg, load_manifest(ds).vocab_size, torch.device("cpu"), parallel="none")
    rows: dict[int, list[int]] = {}

    def on_step(e, outcome, micro) -> None:  # what pipeline/train/audit_log.py AuditLog records
        rows[e.step] = sorted(int(i) for b in micro for i in b["seq_id"])

    result = fit(engine, lambda e, s: ShardReader(ds, "train", t.batch_size, seed=t.seed, epoch=e, start=s),
                 lambda: eval_reader(ds, t.batch_size), Hooks(on_step=on_step), max_steps=8, progress=False)
    return {**result.last_train, **result.last_eval}, rows, engine


def audit(run_dir: Path) -> dict[int, list[dict]]:
    return {int(f.stem.split("_")[1]): [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            for f in sorted((run_dir / "data_audit").glob("rank_*.jsonl"))}


@pytest.mark.timeout(1800)
def test_data2_context2_with_fsdp_trains_resumes_and_ends_where_data2_context1_ends(ray_session, tmp_path, capfd):
    from pipeline.storage import local_copy
    from pipeline.train.checkpoints.state import load_model_state, read_checkpoint_meta
    from pipeline.train.ray_train import run_training

    ds = tmp_path / "ds"
    write_synthetic_dataset(ds, n_train=160, n_val=16, seq_len=SEQ, vocab_size=VOCAB, seed=3, rows_per_shard=48)
    cp2 = cfg_for(tmp_path, **{"ray.num_workers": 4, "train.context_parallel_degree": 2})
    run_dir = tmp_path / "cp2"
    first = run_training(cp2, ds, run_dir, max_steps=4, audit_data=True)
    out = capfd.readouterr().out
    second = run_training(cp2, ds, run_dir, max_steps=8, audit_data=True)  # Ray Train restores it by name
    out += capfd.readouterr().out
    cp1, want_rows, reference = one_process_reference(tmp_path, ds)

    # trains and resumes: steps 1-4, then 5-8 from the step-4 checkpoint, on the mesh the console names
    assert first.metrics["step"] == 4 and second.metrics["step"] == 8 and reference.step == 8
    assert "parallel: fsdp over 4 workers, data 2 x context 2 (4 worker(s))" in out, out[-3000:]
    assert ("context: degree 2, data 2 x context 2 (4 worker(s)): attention all-gathers every rank's K and V per "
            "layer (SDPA, a dense boolean mask from the row's global positions and documents)") in out
    meta = read_checkpoint_meta(second.checkpoint)
    assert (meta["layout"], meta["world_size"], meta["config"]["train"]["context_parallel_degree"]) == ("sharded", 4, 2)

    # the rows: one record per context group (ranks 0 and 2), each its data rank's rows: every step the rows data 2 x
    # context 1 read at that step, every row once
    def rows_by_step(records):
        by_step: dict[int, list[int]] = {}
        for lines in records.values():
            for line in lines:
                by_step.setdefault(line["step"], []).extend(line["seq_ids"])
        return {step: sorted(ids) for step, ids in by_step.items()}

    records = audit(run_dir)
    assert sorted(records) == [0, 2]
    got_rows = rows_by_step(records)
    assert sorted(got_rows) == list(range(1, 9)) and got_rows == want_rows
    seen = [i for ids in got_rows.values() for i in ids]
    assert len(seen) == len(set(seen)) == 8 * 4  # 2 rows x 2 data ranks per step

    # ... and ends where data 2 x context 1 ends: losses and weights within tolerance
    for key in ("train/loss", "val/loss"):  # the mean over steps 5-8; the evaluation at step 8
        assert second.metrics[key] == pytest.approx(cp1[key], rel=1e-5), key
    with local_copy(second.checkpoint) as local:
        got = load_model_state(local)
    want = reference.module.decoder.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **WEIGHT_TOL, msg=name)
