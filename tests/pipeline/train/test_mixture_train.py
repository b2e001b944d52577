"""Training on a mixture with the Ray-free engine: a resume mid-block is bit for bit the run that never stopped, a
resume from two workers on one reads the same rows, and the train stage (two phases with two mixtures) refuses an
over-demanded source before training, logs each source's validation metrics and dataset to MLflow, keeps the
mixture manifest beside the run, and `eval` prints a table with one row per source.

    .venv/bin/python -m pytest -q tests/pipeline/train/test_mixture_train.py
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline.config import load_config

pytestmark = pytest.mark.system


def audit(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "data_audit" / "rank_0.jsonl").read_text().splitlines()]


def rows_of(lines: list[dict]) -> list[list[tuple[int, int, int]]]:
    """Per step: (source, pass, seq_id) of every row, in order."""
    return [list(zip(x["sources"], x["passes"], x["seq_ids"])) for x in lines]


def test_a_resume_mid_block_is_bit_for_bit_the_run_that_never_stopped(mixture_setup, tmp_path):
    from safetensors.torch import load_file

    from pipeline.train.engine import read_checkpoint_meta
    from pipeline.train.local import train_local

    cfg = mixture_setup.config(**{"data.mixture_block_rows": 12, "train.max_steps": 8, "train.checkpoint_every": 4,
                                  "tracking.enabled": False})
    ds = mixture_setup.dataset
    straight, _ = train_local(cfg, ds, tmp_path / "straight", audit_data=True)
    first, _ = train_local(cfg, ds, tmp_path / "resumed", max_steps=4, audit_data=True)
    counters = read_checkpoint_meta(first)["counters"]
    assert (counters["step"], counters["epoch"], counters["cursor"]) == (4, 0, 16)  # block 1 (12 rows), row 4
    resumed, _ = train_local(cfg, ds, tmp_path / "resumed", audit_data=True)  # a fresh engine from step 4's checkpoint

    assert rows_of(audit(tmp_path / "resumed")) == rows_of(audit(tmp_path / "straight"))
    assert {s for step in rows_of(audit(tmp_path / "straight")) for s, _, _ in step} == {0, 1, 2}
    a, b = load_file(str(Path(straight) / "model.safetensors")), load_file(str(Path(resumed) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(Path(straight) / "train_state.pt", weights_only=True)["optimizer"]["state"]
    sb = torch.load(Path(resumed) / "train_state.pt", weights_only=True)["optimizer"]["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)


def _steps(rank: int, world: int, dataset: str, overrides: dict, steps: int, load: str, save: str) -> dict:
    """Train to `steps` on the mixture (rank of world), from the checkpoint `load` if given, saving to `save`, and
    evaluate every source at the end; the (source, pass, seq_id) rows each step read on this rank, and the metrics."""
    from pipeline.data.mixture import mixture_of, train_batches
    from pipeline.eval.sources import SourceValidation
    from pipeline.train.engine import Engine
    from pipeline.train.loop import Hooks, fit

    cfg = load_config("test", overrides)
    engine = Engine(cfg, 512, torch.device("cpu"), rank=rank, world_size=world)
    if load:
        engine.load(load)
    seen: list = []

    def on_step(e, outcome, micro) -> None:
        seen.append([[int(b[k][i]) for k in ("source", "pass", "seq_id")] for b in micro
                     for i in range(len(b["seq_id"]))])

    evaluate = SourceValidation(mixture_of(dataset, cfg), cfg.train.batch_size, rank, world)
    result = fit(engine, train_batches(dataset, cfg, rank, world), None, Hooks(on_step=on_step), max_steps=steps,
                 progress=False, evaluate=evaluate)  # the last step evaluates: on two ranks, the same collectives
    if save:
        engine.save(save)
    return {"rows": seen, "eval": result.last_eval}


def test_a_resume_from_two_workers_on_one_reads_the_same_rows(mixture_setup, tmp_path):
    """Two workers (micro-batch 2 each) for 3 steps, then one worker (micro-batch 4: the same global batch) from
    their checkpoint to step 6: every step reads the rows one worker reads straight through, in the same order."""
    from pipeline.train.distributed.process_group import run_workers

    over = {**dict(p.lstrip("-").split("=", 1) for p in mixture_setup.overrides),
            "data.mixture_block_rows": 8, "train.max_steps": 6, "model.compile": "off", "train.sample_tokens": 0,
            "tracking.enabled": False}
    ds, ckpt = mixture_setup.dataset, str(tmp_path / "two")
    two = run_workers(_steps, 2, ds, {**over, "train.batch_size": 2}, 3, "", ckpt)
    one = _steps(0, 1, ds, {**over, "train.batch_size": 4}, 6, ckpt, "")
    straight = _steps(0, 1, ds, {**over, "train.batch_size": 4}, 6, "", "")
    # rank 0 reads the first half of each global micro-batch
    merged = [r0 + r1 for r0, r1 in zip(two[0]["rows"], two[1]["rows"])]
    assert merged + one["rows"] == straight["rows"] and len(straight["rows"]) == 6 and len(straight["rows"][0]) == 4
    # every source evaluated on both ranks, all-reduced: the same figures on each
    assert two[0]["eval"] == two[1]["eval"] and {"val/std/bpb", "val/topics/loss", "val/notes/loss"} <= set(two[0]["eval"])
    assert abs(one["eval"]["val/loss"] - straight["eval"]["val/loss"]) < 1e-4  # DDP's sums in another order only


def test_two_phases_with_two_mixtures_log_each_source_and_refuse_an_over_demanded_one(mixture_setup, mlflow_server,
                                                                                      tmp_path, capsys):
    """Phase 0 trains on the built-in corpus alone with `topics` evaluated only (weight 0); phase 1 on the three
    sources at 0.5 / 0.3 / 0.2. The shared tokenizer is given, so every source dataset is the session's (nothing
    is tokenized again), and the run asks for more of `topics` than 4 passes first."""
    from mlflow.tracking import MlflowClient

    from pipeline.data.mixture import MixtureReader, mixture_of
    from pipeline.run import main

    uri, _ = mlflow_server
    phase0 = [{**mixture_setup.mixture[0], "weight": 1.0}, {**mixture_setup.mixture[1], "weight": 0.0}]
    phases = tmp_path / "phases.yaml"
    phases.write_text(yaml.safe_dump([{"steps": 4, "overrides": {"data.mixture": phase0}},
                                      {"steps": 4, "overrides": {"data.mixture": mixture_setup.mixture}}]))
    local = ["--no-ray", "--preset", "test", *mixture_setup.overrides, f"--data.tokenizer={mixture_setup.tokenizer}"]
    base = [*local, f"--tracking.tracking_uri={uri}", "--tracking.experiment=mixtures", "--tracking.system_metrics=false"]

    assert main(["train", *local, "--train.max_steps=3000", "--run.name=too-long", "--tracking.enabled=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the data stage's [data] lines
    assert err.startswith("error: data.mixture source 'topics' (weight 0.3) must supply ")
    assert "; lower its weight, raise its max_repetitions (to " in err and err.endswith(" or more), or add data")

    assert main(["train", *base, "--phases", str(phases), "--audit-data", "--run.name=two-phase"]) == 0
    out = capsys.readouterr().out
    # each phase is 4 steps of 4 rows, shorter than a block of 1,024: blocks of its own 16 rows (8 / 5 / 3)
    assert "mixture: topics       weight   0.0% (trains on   0.0%), 0 of every 16 rows; evaluation only" in out
    assert "mixture: notes        weight  20.0% (trains on  18.8%), 3 of every 16 rows; " in out
    run_dir = mixture_setup.run_root / "two-phase"
    record = json.loads((run_dir / "mixture.json").read_text())
    assert [p["phase"] for p in record["phases"]] == [0, 1]
    assert [(s["name"], s["weight"]) for s in record["phases"][1]["sources"]] == [("std", 0.5), ("topics", 0.3),
                                                                                   ("notes", 0.2)]
    assert record["phases"][1]["sources"][2]["rows_needed"] > 0 and record["phases"][0]["sources"][1]["rows_needed"] == 0
    assert record["phases"][1]["tokenizer_sha256"] == record["phases"][0]["tokenizer_sha256"]
    assert record["phases"][1]["dataset_dir"] == mixture_setup.dataset  # the session's mixture, found by its hash

    # the cursor is per phase: phase 1's first step reads the start of its own stream
    lines = audit(run_dir)
    first_of_phase1 = next(x for x in lines if x["phase"] == 1)
    assert (record["phases"][1]["block_rows"], record["phases"][1]["block_rows_asked"]) == (16, 1024)
    cfg1 = mixture_setup.config(**{"data.mixture": json.dumps(mixture_setup.mixture), "data.mixture_block_rows": 16})
    start = next(iter(MixtureReader(mixture_of(mixture_setup.dataset, cfg1), cfg1.train.batch_size)))
    assert first_of_phase1["seq_ids"] == start["seq_id"].tolist()
    assert first_of_phase1["sources"] == start["source"].tolist()
    assert {s for x in lines if x["phase"] == 0 for s in x["sources"]} == {0}  # topics is never trained on in phase 0

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(json.loads((run_dir / "run.json").read_text())["mlflow_run_id"])
    history = {m: {x.step: x.value for x in client.get_metric_history(run.info.run_id, m)}
               for m in ("val/loss", "val/std/loss", "val/topics/loss", "val/topics/bpb", "val/notes/loss",
                         "val/notes/bpb", "val/notes/ppl")}
    assert sorted(history["val/std/loss"]) == [4, 8] and sorted(history["val/notes/loss"]) == [8]
    assert history["val/loss"][4] == history["val/std/loss"][4]  # phase 0: std is the whole training stream
    assert all(0 < v < 20 for v in history["val/topics/bpb"].values())
    w = {"std": 0.5, "topics": 0.3, "notes": 0.2}
    aggregate = sum(w[s] * client.get_metric_history(run.info.run_id, f"val/{s}/loss")[-1].value for s in w)
    assert abs(run.data.metrics["val/loss"] - aggregate) < 1e-9
    assert abs(history["val/notes/ppl"][8] - np.exp(history["val/notes/loss"][8])) < 1e-6 * history["val/notes/ppl"][8]
    params = run.data.params
    assert (params["mixture/std/weight"], params["mixture/topics/weight"]) == ("1.0", "0.0")
    assert (params["phase1/mixture/notes/weight"], float(params["phase1/mixture/notes/repetitions"]) > 0) == ("0.2", True)
    inputs = {(d.dataset.name, tuple(sorted((t.key, t.value) for t in d.tags))) for d in run.inputs.dataset_inputs}
    sources = {dict(tags)["longtrain.mixture_source"]: dict(tags) for _, tags in inputs}
    assert set(sources) == {"std", "topics", "notes"}
    assert sources["notes"]["longtrain.mixture_weight"] == "0.2" and sources["notes"]["mlflow.data.context"] == "train"
    assert {t["longtrain.tokenizer_sha256"] for t in sources.values()} == {record["phases"][0]["tokenizer_sha256"]}
    assert any(dict(tags).get("mlflow.data.context") == "eval" for _, tags in inputs)  # topics in phase 0

    # eval takes the mixture and its data from the checkpoint: only where the runs are
    assert main(["eval", "--preset", "test", f"--run.root={mixture_setup.run_root}", f"--tracking.tracking_uri={uri}",
                 "--resume", "two-phase"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("source        weight"):].splitlines()
    assert [line.split()[0] for line in table[1:5]] == ["std", "topics", "notes", "mixture"]
    assert table[3].split()[1] == "20.0%" and "eval: eval/loss=" in out
    assert "eval/notes/bpb" in client.get_run(run.info.run_id).data.metrics


def test_a_run_shorter_than_a_block_trains_on_its_weights_and_keeps_its_block_when_extended(mixture_setup, tmp_path,
                                                                                            capsys):
    """0.2 / 0.2 / 0.6 for 8 steps of 4 rows (32 rows, less than a block of 1,024): the run says so, trains on
    7 / 6 / 19 rows (round(w x 32)), not the 4 / 9 / 19 of the first 32 rows of a 1,024-row block, and prints the
    shares asked and trained on. Extended to 12 steps with --resume, it keeps its recorded 32-row block: the steps
    after the resume read the stream the run started."""
    from pipeline.data.mixture import Mixture, MixtureReader, mixture_of
    from pipeline.run import main

    mixture = [{**s, "weight": w} for s, w in zip(mixture_setup.mixture, (0.2, 0.2, 0.6))]
    overrides = [o for o in mixture_setup.overrides if not o.startswith("--data.mixture=")]
    args = ["train", "--no-ray", "--preset", "test", *overrides, f"--data.mixture={json.dumps(mixture)}",
            f"--data.tokenizer={mixture_setup.tokenizer}", "--train.max_steps=8", "--train.sample_tokens=0",
            "--tracking.enabled=false", "--run.name=short-mixture", "--audit-data"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("mixture: the run's 32 rows are fewer than data.mixture_block_rows=1,024, over which the weights are "
            "exact: it uses blocks of 32 rows, so each source's share is as close to its weight as whole rows "
            "allow") in out
    assert "mixture: std          weight  20.0% (trains on  21.9%), 7 of every 32 rows; " in out
    assert "mixture: topics       weight  20.0% (trains on  18.8%), 6 of every 32 rows; " in out
    assert "mixture: notes        weight  60.0% (trains on  59.4%), 19 of every 32 rows; " in out
    run_dir = mixture_setup.run_root / "short-mixture"
    sources = [s for x in audit(run_dir) for s in x["sources"]]
    assert np.bincount(sources, minlength=3).tolist() == [7, 6, 19]
    cfg = mixture_setup.config(**{"data.mixture": json.dumps(mixture)})
    asked = mixture_of(mixture_setup.dataset, cfg)  # the 1,024-row block's first 32 rows: far from 0.2 / 0.2 / 0.6
    assert asked.rows_needed(32).tolist() != [7, 6, 19]

    assert main(["train", "--no-ray", "--resume", str(run_dir), "--train.max_steps=12"]) == 0
    capsys.readouterr()
    record = json.loads((run_dir / "mixture.json").read_text())["phases"][0]
    assert (record["block_rows"], record["block_rows_asked"]) == (32, 1024)
    later = [x for x in audit(run_dir) if x["step"] > 8]
    assert sorted(x["step"] for x in later) == [9, 10, 11, 12]
    mix = Mixture(asked.dataset_dir, asked.manifest, asked.sources, 32, asked.seed)
    reader = iter(MixtureReader(mix, cfg.train.batch_size, start=32))
    for x in sorted(later, key=lambda x: x["step"]):
        batch = next(reader)
        assert (x["sources"], x["seq_ids"]) == (batch["source"].tolist(), batch["seq_id"].tolist())
