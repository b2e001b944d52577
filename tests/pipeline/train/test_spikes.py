"""Loss spikes in real runs (system tier: each trains a nano model for ~45 steps; the last one on 2 Ray Train workers).

The data: learnable rows (pipeline/data/synthetic.py counting_row) with two one-step windows of one token repeated, at
the positions attempts 25 and 29 read in epoch 0 (write_spiky_dataset). The model meets the first when it has learned
the pattern: its gradient norm is ~12 against a limit of ~1 (8-step window, 6 deviations), so the step is skipped;
the second, 4 attempts later, makes 2 outliers within 10 steps, and the run rewinds to its checkpoint of step 24,
skips 8 steps' worth of rows from there (positions 192-255, both windows inside), and trains on to step 32. A
checkpoint of step 27 was written between the two outliers: the rewind abandons it.

    .venv/bin/python -m pytest -q tests/pipeline/train/test_spikes.py
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.data.shards import epoch_order
from pipeline.data.synthetic import write_spiky_dataset
from pipeline.tracking.names import TRAIN_SPIKE_REWINDS, TRAIN_SPIKE_SKIPS, VAL_LOSS, spike_tag
from pipeline.train.audit_log import final_lines
from pipeline.train.spike_record import RECORD_FILE, read_events, summary

pytestmark = pytest.mark.system

B, SEQ, VOCAB, N_TRAIN, SEED = 8, 32, 128, 512, 1234
BAD = [(24 * B, 25 * B), (28 * B, 29 * B)]  # the rows attempts 25 and 29 read
SKIPPED = [{"phase": 0, "epoch": 0, "start": 192, "end": 256}]  # from step 24's cursor, 8 steps of 8 rows
STEPS = 32  # the rewind at step 27 goes back to 24; 8 steps more after it
VAL_TOLERANCE = 0.01  # relative: the rewound run's final validation loss against a run that never saw the windows


def cfg_for(root: Path, **over):
    base = {"data.seq_len": SEQ, "data.vocab_size": 256, "train.batch_size": B, "train.max_steps": STEPS,
            "train.seed": SEED, "train.warmup_steps": 5, "train.log_every": 5, "train.eval_every": 1000,
            "train.checkpoint_every": 3, "train.keep_checkpoints": 20, "model.compile": "off",
            "train.sample_tokens": 0, "run.root": str(root), "tracking.enabled": False,
            "train.spike_window": 8, "train.spike_warmup_steps": 8, "train.spike_rewind_outliers": 2,
            "train.spike_rewind_window": 10, "train.spike_skip_steps": 8}
    base.update(over)
    return load_config("test", base)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("spike_data")
    _, bad_ids = write_spiky_dataset(root / "spiky", n_train=N_TRAIN, n_val=32, seq_len=SEQ, vocab_size=VOCAB,
                                     order_seed=SEED, bad=BAD)
    write_spiky_dataset(root / "clean", n_train=N_TRAIN, n_val=32, seq_len=SEQ, vocab_size=VOCAB, order_seed=SEED)
    return {"spiky": root / "spiky", "clean": root / "clean", "bad_ids": bad_ids}


@pytest.fixture(scope="module")
def rewound(datasets, tmp_path_factory):
    """The uninterrupted run on the spiky data, in one process (--no-ray's path): (run directory, last checkpoint)."""
    from pipeline.train.local import train_local

    root = tmp_path_factory.mktemp("rewound")
    checkpoint, stopped = train_local(cfg_for(root), datasets["spiky"], root / "run", None, audit_data=True)
    assert not stopped
    return root / "run", Path(checkpoint)


def audit_lines(run_dir: Path) -> list[dict]:
    lines = []
    for f in sorted((run_dir / "data_audit").glob("rank_*.jsonl")):
        rank = int(f.stem.split("_")[1])
        lines += [{**json.loads(x), "rank": rank} for x in f.read_text().splitlines() if x.strip()]
    return lines


def rows_by_cursor(run_dir: Path, ranges: list[dict]) -> dict[int, list[int]]:
    """The seq_ids each kept step trained on (every rank's), by the cursor after it."""
    out: dict[int, list[int]] = {}
    for line in final_lines(audit_lines(run_dir), ranges):
        out.setdefault(line["cursor"], []).extend(line["seq_ids"])
    return {c: sorted(ids) for c, ids in sorted(out.items())}


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def test_a_spike_is_skipped_then_rewound_past_with_its_rows_skipped_and_recorded(rewound, datasets, capsys):
    """Two outliers skipped, one rewind to step 24 with positions 192-255 skipped, and the run finishes at step 32;
    every row of the epoch up to where it stopped was trained on once, except the recorded skipped rows, which hold
    both bad windows; `validate RUN` lists it all."""
    run_dir, checkpoint = rewound
    events = read_events(str(run_dir))
    assert [(e["kind"], e["step"]) for e in events] == [("skip", 25), ("skip", 28), ("rewind", 27)]
    assert all(e["grad_norm"] > e["grad_norm_limit"] for e in events)
    assert events[2]["rewind"]["to_step"] == 24 and events[2]["rewind"]["checkpoint"].endswith("step_000024")
    assert summary(events)["skipped_rows"] == SKIPPED
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["counters"]["step"] == STEPS and meta["counters"]["spikes"]["rewinds"] == [events[2]["rewind"]]

    order = epoch_order(N_TRAIN, SEED, 0)
    by_cursor = rows_by_cursor(run_dir, SKIPPED)
    assert list(by_cursor) == [8 * i for i in range(1, 25)] + [256 + 8 * i for i in range(1, STEPS - 24 + 1)]
    consumed = [i for ids in by_cursor.values() for i in ids]
    skipped = [int(i) for r in SKIPPED for i in order[r["start"]:r["end"]]]
    assert len(set(consumed)) == len(consumed) and not set(consumed) & set(skipped)
    assert sorted(consumed + skipped) == sorted(int(i) for i in order[:256 + 8 * (STEPS - 24)]), \
        "a row was lost or read twice"
    assert set(datasets["bad_ids"]) <= set(skipped) and not set(datasets["bad_ids"]) & set(consumed)

    from pipeline.run import main
    from pipeline.train.session.run_dir import write_run_file

    cfg = cfg_for(run_dir.parent)
    write_run_file(run_dir, {"config": cfg.flat(), "no_ray": True, "phase": 0, "status": "finished"})
    capsys.readouterr()
    main(["validate", str(run_dir)])
    out = capsys.readouterr().out
    assert "spikes: 2 step(s) skipped, 0 outlier(s) applied, 1 rewind(s); 64 row(s) skipped" in out
    assert "  spike: rewind 1 of at most 3 at step 27, 2 outliers within 10 steps" in out
    assert "  skipped: rows 192-255 of epoch 0 (phase 0)" in out


def test_the_rewound_run_ends_near_a_run_that_never_saw_the_windows_and_detection_changes_nothing_else(
        rewound, datasets, tmp_path):
    """On the same rows without the bad windows, detection on and off train bitwise the same weights (it armed, it
    flagged nothing, no record); the rewound run's final validation loss is within VAL_TOLERANCE of theirs."""
    from pipeline.train.local import train_local

    on, _ = train_local(cfg_for(tmp_path), datasets["clean"], tmp_path / "on", None)
    off, _ = train_local(cfg_for(tmp_path, **{"train.spike_action": "off"}), datasets["clean"], tmp_path / "off", None)
    a, b = weights(Path(on)), weights(Path(off))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "detection changed a run without spikes"
    assert not (tmp_path / "on" / RECORD_FILE).exists()
    meta = json.loads((Path(on) / "meta.json").read_text())
    assert meta["counters"]["spikes"]["detector"]["count"] == STEPS  # it armed and watched every step

    clean_loss = meta["metrics"][VAL_LOSS]
    rewound_loss = json.loads((rewound[1] / "meta.json").read_text())["metrics"][VAL_LOSS]
    assert abs(rewound_loss - clean_loss) <= VAL_TOLERANCE * clean_loss, (rewound_loss, clean_loss)


def test_exact_resume_across_a_rewind_after_a_crash_and_after_a_stop(rewound, datasets, tmp_path, monkeypatch, capsys):
    """The process dies right after the rewind, before any checkpoint: the newest checkpoint on disk (step 27) is one
    the rewind abandoned. The resume replaces it with step 24's, skips the recorded rows, stops at step 29 (a
    checkpoint), and a second resume trains to 32: the same rows per step and bitwise the same weights as the
    uninterrupted run."""
    import pipeline.train.loop as loop
    from pipeline.train.local import train_local

    real = loop.rewind

    def rewind_then_die(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("killed right after the rewind")

    cfg, run_dir = cfg_for(tmp_path), tmp_path / "run"
    monkeypatch.setattr(loop, "rewind", rewind_then_die)
    with pytest.raises(RuntimeError, match="killed right after the rewind"):
        train_local(cfg, datasets["spiky"], run_dir, None, audit_data=True)
    monkeypatch.setattr(loop, "rewind", real)
    assert (run_dir / "checkpoints" / "phase0" / "step_000027").is_dir()
    capsys.readouterr()
    stop, _ = train_local(cfg, datasets["spiky"], run_dir, None, audit_data=True, max_steps=29)
    assert "resume: the checkpoint of step 27 was written before the rewind at step 27 went back to step 24" in \
        capsys.readouterr().out
    assert Path(stop).name == "step_000029"
    end, _ = train_local(cfg, datasets["spiky"], run_dir, None, audit_data=True)

    a, b = weights(rewound[1]), weights(Path(end))
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's weights differ from the uninterrupted run's"
    assert rows_by_cursor(run_dir, SKIPPED) == rows_by_cursor(rewound[0], SKIPPED)
    assert [e["kind"] for e in read_events(str(run_dir))] == ["skip", "skip", "rewind"]  # replays recorded once


def test_two_ray_train_workers_rewind_alike_and_resume_across_it(ray_session, mlflow_server, datasets, rewound,
                                                                 tmp_path):
    """2 workers x 4 rows (the same 8 rows per step): the same skips, the same rewind and skipped rows as one process.
    A worker is killed after the rewind; Ray Train restarts the group from step 24's checkpoint, which knew of no
    rewind: the run's record brings the skipped rows back, and every kept step trains on the rows the one-process run
    did. The events are MLflow tags and metrics of the run."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.tracker import open_tracker
    from pipeline.train.ray_train import run_training

    uri, _ = mlflow_server
    cfg = cfg_for(tmp_path, **{"train.batch_size": B // 2, "ray.num_workers": 2, "train.checkpoint_every": 12,
                               "tracking.enabled": True, "tracking.tracking_uri": uri,
                               "tracking.experiment": "spikes-test", "tracking.system_metrics": False})
    run_dir = tmp_path / "run"
    tracker = open_tracker(cfg, run_name="spikes")
    result: dict = {}

    def train():
        try:
            result["out"] = run_training(cfg, datasets["spiky"], run_dir, audit_data=True,
                                         mlflow_run_id=tracker.run_id)
        except BaseException as exc:  # surfaced below
            result["error"] = exc

    def rewound_in_mlflow() -> bool:  # the rewind's event is in spikes.json first, then in MLflow (rank 0's hook)
        return any(e["kind"] == "rewind" for e in read_events(str(run_dir))) and any(
            m.value == 1.0 for m in client.get_metric_history(tracker.run_id, TRAIN_SPIKE_REWINDS))

    client = MlflowClient(tracking_uri=uri)
    thread = threading.Thread(target=train)
    thread.start()
    killed = None
    deadline = time.monotonic() + 600
    while thread.is_alive() and time.monotonic() < deadline and killed is None:
        if rewound_in_mlflow():
            pids = [line["pid"] for line in audit_lines(run_dir) if line["rank"] == 1]
            os.kill(pids[-1], signal.SIGKILL)
            killed = pids[-1]
        time.sleep(0.1)
    thread.join(timeout=max(1.0, deadline - time.monotonic()))
    tracker.finish("FINISHED")
    assert not thread.is_alive(), "training did not finish in time"
    assert "error" not in result, result.get("error")
    assert killed is not None, "the run ended before the rewind"
    assert result["out"].metrics["step"] == STEPS
    restarted = [line for line in audit_lines(run_dir) if line["rank"] == 1 and line["pid"] != killed]
    assert restarted and (restarted[0]["step"], restarted[0]["cursor"]) == (25, 264), \
        "the restart did not go on from step 24 past the skipped rows"

    events = read_events(str(run_dir))
    assert [(e["kind"], e["step"]) for e in events] == [("skip", 25), ("skip", 28), ("rewind", 27)]
    assert summary(events)["skipped_rows"] == SKIPPED
    assert rows_by_cursor(run_dir, SKIPPED) == rows_by_cursor(rewound[0], SKIPPED)

    tags = client.get_run(tracker.run_id).data.tags
    assert [tags.get(spike_tag(i), "")[:22] for i in range(3)] == ["spike: step 25 skipped", "spike: step 28 skipped",
                                                                   "spike: rewind 1 of at "]
    rewinds = {(m.step, m.value) for m in client.get_metric_history(tracker.run_id, TRAIN_SPIKE_REWINDS)}
    assert {(25, 0.0), (27, 1.0), (STEPS, 1.0)} <= rewinds and max(v for _, v in rewinds) == 1.0
    skips = {(m.step, m.value) for m in client.get_metric_history(tracker.run_id, TRAIN_SPIKE_SKIPS)}
    assert {(25, 1.0), (28, 2.0)} <= skips  # counted along the timeline: the rewind went back to before both
    assert (STEPS, 0.0) in skips


def fsdp_rewinds(rank: int, world: int, dataset: str, folder: str) -> dict:
    """Two FSDP workers (gloo) train the spiky rows with the loop every launcher uses, every worker writing its shards
    of a checkpoint every 3 steps; the rewind's checkpoint is chosen by rank 0 and loaded by both (DCP's collective
    load). Returns the spike events and the final whole weights' path (rank 0 writes them)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from pipeline.data.shards import ShardReader
    from pipeline.train.engine import Engine
    from pipeline.train.loop import Hooks, fit
    from pipeline.train.spike_rewind import Rewinder

    cfg = cfg_for(Path(folder), **{"train.batch_size": B // world})
    engine = Engine(cfg, VOCAB, torch.device("cpu"), rank=rank, world_size=world, parallel="fsdp")
    events: list[dict] = []

    def on_checkpoint(e, metrics) -> None:
        e.save(Path(folder) / "ckpt" / f"step_{e.step:06d}")  # every worker: its shards

    t = cfg.train
    fit(engine, lambda epoch, start: ShardReader(dataset, "train", t.batch_size, seed=t.seed, epoch=epoch, start=start,
                                                 rank=rank, world_size=world),
        None, Hooks(on_checkpoint=on_checkpoint, on_spike=lambda e, ev: events.append(ev)), progress=False,
        rewinder=Rewinder(str(Path(folder) / "ckpt"), epoch_rows=N_TRAIN))
    whole = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True))
    out = str(Path(folder) / "fsdp_final.safetensors")
    if rank == 0:
        save_file({k.removeprefix("decoder."): v.detach().contiguous() for k, v in whole.items()}, out)
    return {"events": [(e["kind"], e["step"]) for e in events], "step": engine.step, "parallel": engine.parallel,
            "layout": json.loads((Path(folder) / "ckpt" / "step_000024" / "meta.json").read_text())["layout"],
            "ranges": engine.spikes.ranges(), "weights": out}


def test_two_fsdp_workers_rewind_to_a_sharded_checkpoint(rewound, datasets, tmp_path):
    """FSDP: the same skips and rewind as one process, back to a sharded checkpoint every worker loads its part of;
    the final weights equal the one-process run's to the order of floating-point sums (tests/pipeline/train/
    test_fsdp.py's tolerance)."""
    from pipeline.train.distributed.process_group import run_workers

    got = run_workers(fsdp_rewinds, 2, str(datasets["spiky"]), str(tmp_path))
    assert got[0] == got[1] | {"weights": got[0]["weights"]}  # both ranks saw and did the same
    r = got[0]
    assert (r["parallel"], r["layout"], r["step"]) == ("fsdp", "sharded", STEPS)
    assert r["events"] == [["skip", 25], ["skip", 28], ["rewind", 27]] and r["ranges"] == SKIPPED
    want, have = weights(rewound[1]), load_file(r["weights"])
    for name, tensor in want.items():
        torch.testing.assert_close(have[name], tensor, rtol=1e-4, atol=1e-5)
