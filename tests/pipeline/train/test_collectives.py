"""Every rank runs the same collectives, and a collective that never completes ends in one line.

Two gloo workers (pipeline/train/distributed/process_group.py) run the training loop every launcher uses:
- with the eval-time text samples on under FSDP, for both model families, as Ray Train's workers run them (rank 0
  generates inside the whole-weight gather of Engine.full_model, through ray_train's `_gathered` hook): training
  goes on past every evaluation to the last step;
- with one rank leaving the loop early (it skips every collective after its last step): the other ends within
  seconds of the process group's timeout with CollectiveTimeoutError, one line naming the rank, the step and the
  collective, instead of waiting forever.
The NCCL watchdog's line is checked without a GPU: a region held past the timeout prints it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.data.synthetic import write_synthetic_dataset

SEQ, VOCAB = 64, 512
TIMEOUT_S = 3.0  # the skipped-collective test's process-group timeout
SAMPLES_TIMEOUT_S = 60.0  # the samples test's: a hang fails it in a minute instead of never


def cfg_for(**over):
    base = {"model.tier": "nano", "data.seq_len": SEQ, "data.vocab_size": VOCAB, "train.batch_size": 4,
            "train.warmup_steps": 2, "train.log_every": 2, "model.compile": "off", "tracking.enabled": False,
            "train.eval_every": 3, "train.eval_batches": 1, "train.checkpoint_every": 100}
    return load_config("test", {**base, **over})


def _fit(rank: int, world: int, dataset: str, over: dict, parallel: str, on_eval=None, on_step=None):
    from pipeline.data.shards import ShardReader, eval_reader
    from pipeline.train.engine import Engine
    from pipeline.train.loop import Hooks, fit

    cfg = cfg_for(**over)
    engine = Engine(cfg, VOCAB, torch.device("cpu"), rank=rank, world_size=world, parallel=parallel)
    t = cfg.train
    losses: list[float] = []
    result = fit(engine, lambda epoch, start: ShardReader(dataset, "train", t.batch_size, seed=t.seed, epoch=epoch,
                                                          start=start, rank=rank, world_size=world),
                 lambda: eval_reader(dataset, t.batch_size, rank, world),
                 Hooks(on_log=lambda e, m: losses.append(m["train/loss"]), on_eval=on_eval, on_step=on_step),
                 progress=False)
    return result, losses


def samples_under_fsdp(rank: int, world: int, dataset: str) -> dict:
    """Both families under FSDP with rank-0 samples at every evaluation: the steps reached and what was generated."""
    from model.decode_loop import generate_ids
    from pipeline.train.ray_train import _gathered

    out = {}
    for mixer in ("resonance", "attention"):
        generated: list[list[int]] = []

        def samples(engine, metrics, decoder) -> None:  # what eval_samples_hook does on rank 0, minus the tracker
            generated.append(generate_ids(decoder, [[5, 17, 42]], max_new_tokens=6, temperature=0.0)[0].tolist())

        over = {"model.mixer": mixer, "train.max_steps": 9, "train.collective_timeout_s": SAMPLES_TIMEOUT_S,
                **({"model.tie_embeddings": False} if mixer == "resonance" else {})}
        result, losses = _fit(rank, world, dataset, over, "fsdp", on_eval=_gathered(samples if rank == 0 else None))
        out[mixer] = {"step": result.step, "losses": losses, "generated": generated}
    return out


class _Left(Exception):
    pass


def leaves_early(rank: int, world: int, dataset: str, rank0_done: str) -> dict:
    """Rank 1 leaves the loop right after step 2's update, skipping that log step's metrics all-reduce and every
    collective after it, and then stays alive (its connections open) until rank 0 has ended (the file `rank0_done`
    appears), so that rank 0 meets a collective nobody joins, not a closed connection."""
    from pipeline.train.distributed.collectives import CollectiveTimeoutError

    def leave(engine, outcome, micro) -> None:
        if rank == 1 and engine.step == 2:
            raise _Left

    over = {"train.max_steps": 5, "train.collective_timeout_s": TIMEOUT_S}
    error, step = None, None
    try:
        step = _fit(rank, world, dataset, over, "ddp", on_step=leave)[0].step
    except CollectiveTimeoutError as exc:
        error = str(exc)
    except _Left:
        step = 2
    finally:
        if rank == 0:
            Path(rank0_done).touch()
    if rank == 1:  # gone quiet, not gone, for as long as rank 0 runs (the test's timeout bounds a hang)
        while not os.path.exists(rank0_done):
            time.sleep(0.05)
    return {"error": error, "step": step}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    ds = str(tmp_path_factory.mktemp("collectives") / "ds")
    write_synthetic_dataset(ds, n_train=160, n_val=16, seq_len=SEQ, vocab_size=VOCAB, seed=5, rows_per_shard=48)
    return ds


@pytest.mark.system
def test_eval_samples_under_fsdp_do_not_hang_either_family(dataset):
    from pipeline.train.distributed.process_group import run_workers

    got = run_workers(samples_under_fsdp, 2, dataset, timeout_s=SAMPLES_TIMEOUT_S)
    for mixer in ("resonance", "attention"):
        r0, r1 = got[0][mixer], got[1][mixer]
        assert r0["step"] == r1["step"] == 9, mixer  # past the evaluations at 3, 6 and 9
        assert len(r0["generated"]) == 3 and r1["generated"] == [], mixer  # rank 0 alone generated
        assert all(len(g) == 6 for g in r0["generated"])
        assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6), mixer  # the ranks stayed in step


@pytest.mark.system  # a hang (rank 0 waiting forever) fails at the suite's timeout (pyproject.toml), naming this test
def test_a_rank_that_skips_collectives_ends_the_others_in_seconds_with_one_line(dataset, tmp_path):
    from pipeline.train.distributed.process_group import run_workers

    got = run_workers(leaves_early, 2, dataset, str(tmp_path / "rank0_done"), timeout_s=TIMEOUT_S)
    r0, r1 = got
    assert r1["error"] is None and r1["step"] == 2
    line = r0["error"]
    assert line is not None and "\n" not in line
    assert line.startswith("rank 0 of 2: step 2: the training-metrics all-reduce (at a log step) did not complete "
                           "within 3 s"), line
    assert "train.collective_timeout_s" in line  # the process group's timeout ended it: "did not complete within"


def test_the_nccl_watchdog_prints_the_line_before_the_process_is_ended(capsys, monkeypatch):
    """Under NCCL the process may be killed at the timeout before Python sees an exception: the watchdog thread
    prints the line when a region outlives the timeout less a short lead (a tenth of it, at most 5 s), so before
    NCCL ends the process, and once. The watch's clock is the test's (CollectiveWatch.clock), and the test waits for
    the watchdog's looks, not for time: at 10 s, the line comes at 9 s into the region, not at 8.75."""
    from pipeline.train.distributed.collectives import CollectiveWatch

    now = [0.0]
    monkeypatch.setattr(CollectiveWatch, "clock", staticmethod(lambda: now[0]))
    watch = CollectiveWatch(rank=1, world_size=4, timeout_s=10.0, backend="nccl")

    def after_two_looks() -> str:
        """What the watchdog printed by its second look from now (the first may have begun before)."""
        seen = watch.looks
        deadline = time.monotonic() + 120  # a bound on a hang only: it looks every half second
        while watch.looks < seen + 2:
            assert time.monotonic() < deadline, "the watchdog stopped looking"
            time.sleep(0.02)
        return capsys.readouterr().err

    try:
        with watch.region("the training-metrics all-reduce (at a log step)", step=40):
            now[0] = 8.75
            assert after_two_looks() == ""  # not yet
            now[0] = 9.0  # the timeout less its lead
            err = after_two_looks().strip().splitlines()
            now[0] = 60.0
            assert after_two_looks() == ""  # once per region
    finally:
        watch.close()
    assert err == ["error: rank 1 of 4: step 40: the training-metrics all-reduce (at a log step) did not complete "
                   "within 10 s: another rank did not join it (every rank must run the same collectives in the same "
                   "order; a rank that crashed or hangs elsewhere says so in its own log). If a step may legitimately "
                   "take longer, raise train.collective_timeout_s"]


def test_a_failure_outside_torch_distributed_keeps_its_own_type():
    from pipeline.train.distributed.collectives import CollectiveWatch

    watch = CollectiveWatch(rank=0, world_size=2, timeout_s=5.0)
    with pytest.raises(ZeroDivisionError):
        with watch.region("the logging hook", step=3):
            1 / 0
