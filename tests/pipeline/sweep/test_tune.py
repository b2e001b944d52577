"""Ray Tune sweeps: search-space files, OOM classification, the table and preset, and a real sweep.

    .venv/bin/python -m pytest tests/pipeline/sweep/test_tune.py -q            # ~3 min on 2 cores (the sweep: ~2)

The sweep runs `python pipeline/run.py tune` in-process (the session's Ray, 8 logical CPUs) with 3 trials
of the nano tier at 32 tokens per row, batch sizes 1, 4 and 64, on a simulated 6 MiB device
(train.memory_limit_gib): 64 sequences cannot fit, so that trial's Ray Train worker raises a real
torch.OutOfMemoryError, while the others train to the end. Everything is read back from a real
`mlflow server` on 127.0.0.1: the parent run, its three child runs (params, metric histories, statuses)
and the table artifacts; the best trial's preset is loaded back through the config loader.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config import Config, field_types, load_config
from pipeline.train.engine import STEADY_AFTER_STEPS
from pipeline.sweep.report import FAILED, OK, OOM, STOPPED, TrialRow, best_row, markdown_table, write_best_preset
from pipeline.tracking.names import METRICS, PARENT_RUN_TAG
from pipeline.sweep.trial import TAG_REASON, TAG_STATUS, TAG_SWEEP, TAG_TRIAL, SweepContext, TrialFailed
from pipeline.sweep.trial_failure import is_oom
from pipeline.sweep.space import DISTRIBUTIONS, SpaceError, load_space

ROOT = Path(__file__).resolve().parents[3]
SPACES = sorted((ROOT / "tune_spaces").glob("*.yaml"))


# ------------------------------------------------------------------------------------ space files
@pytest.mark.parametrize("preset", ["cpu", "gpu", "test"])
@pytest.mark.parametrize("path", SPACES, ids=[p.name for p in SPACES])
def test_every_space_file_loads_and_validates(path, preset):
    base = load_config(preset)
    space = load_space(path, base)
    assert space.metric == "val/loss" and space.mode == "min"
    assert space.scheduler["type"] == "asha" and space.scheduler["time_attr"] == "train/tokens_seen"
    assert space.params and all(k in field_types() for k in space.params)
    assert space.resources and space.fixed["ray.max_failures"] == 0
    tuned = space.param_space()
    assert set(tuned) == set(space.params)
    trial = base.replace(space.overrides())  # every finite value forms a valid trial config
    for key, dist in space.params.items():
        for value in dist.values() or dist.args:
            assert trial.replace({key: value}).flat()[key] == value


def test_the_shipped_spaces_search_what_they_say():
    bs_tier = load_space(ROOT / "tune_spaces/bs_tier.yaml")
    assert bs_tier.params["model.tier"].kind == "grid" and bs_tier.params["train.batch_size"].kind == "grid"
    assert bs_tier.skip_unfit_batch and bs_tier.token_budget > 0
    lr = load_space(ROOT / "tune_spaces/lr.yaml")
    assert lr.params["train.lr"].kind == "loguniform" and lr.params["train.lr"].args == [1e-4, 3e-3]
    assert "train.warmup_steps" in lr.params and lr.num_samples > 1


def _space(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("doc, expected", [
    ({"params": {"train.batchsize": {"grid": [1, 2]}}},
     ["params key 'train.batchsize' is not a config field; did you mean 'train.batch_size'? `python pipeline/run.py "
      "--help` lists every field"]),
    ({"params": {"train.lr": {"normal": [0, 1]}}},
     ["train.lr: {'normal': [0, 1]} is not a distribution", "loguniform ([lo, hi] float"]),
    ({"params": {"train.lr": {"loguniform": [0.0, 1e-3]}}}, ["loguniform needs lo > 0"]),
    ({"params": {"train.lr": {"loguniform": [1e-3]}}}, ["loguniform needs [lo, hi] (two numbers)"]),
    ({"params": {"train.lr": {"randint": [1, 5]}}}, ["randint draws ints but train.lr is a float; use uniform/loguniform"]),
    ({"params": {"train.batch_size": {"grid": [2, 0]}}}, ["train.batch_size=0 is invalid; it must be > 0"]),
    ({"params": {"model.tier": {"choice": ["nano", "Z"]}}}, ["model.tier='Z' is not allowed; choose one of: nano, A"]),
    ({"params": {"data.seq_len": {"grid": [64, 128]}}}, ["cannot be searched", "data.* fields go under `fixed`"]),
    ({"params": {"train.lr": 1e-3}, "metrics": "val/loss"}, ["unknown key(s) ['metrics']; did you mean 'metric' (for 'metrics')?", "valid keys: description,"]),
    ({"params": {"train.lr": 1e-3}, "metric": "val/los"}, ["metric='val/los' is not a tracked metric"]),
    ({"params": {"train.lr": 1e-3}, "scheduler": {"type": "pbt"}}, ["scheduler.type='pbt' is not allowed"]),
    ({"params": {"train.lr": 1e-3}, "fixed": {"ray.num_worker": 2}}, ["fixed key 'ray.num_worker' is not a config"]),
    ({"params": {"train.lr": 1e-3}, "resources_per_trial": {"gpus": 1}}, ["resources_per_trial: unknown key(s) ['gpus']"]),
    ({"params": {}}, ["params is empty"]),
    ({"params": {"train.batch_size": {"randint": [1, 9]}}, "skip_unfit_batch": True},
     ["skip_unfit_batch needs train.batch_size in params as a grid or choice"]),
])
def test_a_bad_space_gets_one_clear_error(tmp_path, doc, expected):
    path = _space(tmp_path, doc)
    with pytest.raises(SpaceError) as err:
        load_space(path, load_config("test"))
    message = str(err.value)
    assert message.startswith(f"search space {path}: ") and "\n" not in message
    for part in expected:
        assert part in message, message


def test_missing_space_file_names_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SpaceError, match=r"does not exist; tune_spaces/ holds bs_tier.yaml, dense_vs_moe.yaml, lr.yaml"):
        load_space("tune_spaces/nope.yaml")
    assert set(DISTRIBUTIONS) == {"grid", "choice", "uniform", "loguniform", "randint", "lograndint"}


# ------------------------------------------------------------------------- failures, table, preset
def test_is_oom_sees_through_train_and_task_wrappers():
    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert is_oom(WorkerGroupError("rank 0 failed", {0: oom}))
    wrapped = RayTaskError("run_trial", "traceback", WorkerGroupError("x", {1: ValueError("no"), 0: oom}))
    assert is_oom(wrapped)
    try:
        try:
            raise MemoryError
        except MemoryError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert is_oom(outer)
    assert not is_oom(WorkerGroupError("x", {0: ValueError("out of memory is only a phrase here")}))
    assert not is_oom(RuntimeError("boom"))


def _rows() -> list[TrialRow]:
    return [TrialRow("t0", {"train.batch_size": 1}, "nano", 1, 150.0, 0.002, 5.3, OK),
            TrialRow("t1", {"train.batch_size": 2}, "nano", 2, 270.0, 0.003, 5.1, OK, steps=32, steady_steps=29,
                     mfu=0.3127),
            TrialRow("t2", {"train.batch_size": 4}, "nano", 4, 300.0, 0.004, 4.9, STOPPED, "early"),
            TrialRow("t3", {"train.batch_size": 64}, "nano", 64, None, None, None, OOM, "OutOfMemoryError"),
            TrialRow("t4", {"train.batch_size": 8}, "nano", 8, None, None, float("nan"), FAILED, "ValueError")]


def test_best_is_the_best_finished_trial_and_the_table_has_every_row():
    rows = _rows()
    assert best_row(rows, "min").trial_id == "t1"  # t2 is lower but was stopped early (fewer tokens)
    assert best_row(rows, "max").trial_id == "t0"
    table = markdown_table(rows, "val/loss").splitlines()
    assert table[0] == ("| tier | batch size | tokens/s | MFU | timed steps | peak memory (GiB) | val/loss | status "
                        "| trial |")
    assert len(table) == 2 + len(rows) + 2 and table[-2] == ""  # the rows, then what the figures count
    assert table[-1].startswith("tokens/s and MFU are steady state: each trial's optimizer steps after its first "
                                f"{STEADY_AFTER_STEPS} (torch.compile and warm-up)")
    assert "| nano | 64 | – | – | – | – | – | oom (OutOfMemoryError) | t3 |" in table
    assert "| nano | 2 | 270 | 31.3% | 4–32 | 0.003 | 5.1000 | ok | t1 |" in table


def test_the_table_shows_total_and_active_parameters_when_a_trial_has_experts():
    from pipeline.sweep.results import _sizes

    base = load_config("test")
    dense, moe = _sizes(base, {"model.tier": "nano"}), _sizes(base, {"model.tier": "nano", "model.num_experts": 8})
    assert dense[0] == dense[1] and moe[0] > moe[1] and abs(moe[1] - dense[1]) == 8 * 64 * 2  # the routers
    rows = [TrialRow("t0", {"model.num_experts": 0}, "nano", 4, 100.0, 0.01, 5.0, OK, params_total=dense[0],
                     params_active=dense[1]),
            TrialRow("t1", {"model.num_experts": 8}, "nano", 4, 90.0, 0.01, 4.9, OK, params_total=moe[0],
                     params_active=moe[1])]
    table = markdown_table(rows, "val/loss").splitlines()
    assert table[0].startswith("| tier | batch size | model.num_experts | params | active params | tokens/s |")
    assert f"| nano | 4 | 8 | {moe[0]:,} | {moe[1]:,} | 90 |" in table[3]
    assert "params" not in markdown_table(rows[:1], "val/loss").splitlines()[0]  # dense only: no such columns


def test_best_preset_round_trips_through_the_config_loader(tmp_path):
    best = load_config("test", {"train.batch_size": 2, "train.lr": 1e-3, "run.name": "sweep-t1",
                                "ray.storage_path": "/somewhere", "ray.max_failures": 0})
    path = write_best_preset(best.flat(), Config().flat(), tmp_path / "best_preset.yaml", sweep="s",
                             row=_rows()[1], metric="val/loss")
    text = path.read_text()
    assert text.startswith("# Best trial of sweep s: val/loss=5.1000 (trial t1")
    loaded = load_config(str(path))
    skip = {"run.name", "ray.storage_path", "ray.max_failures"}
    assert {k: v for k, v in loaded.flat().items() if k not in skip} == {
        k: v for k, v in best.flat().items() if k not in skip}
    assert loaded.run.name == "" and loaded.ray.max_failures == Config().ray.max_failures


# ------------------------------------------------------------- skip path and finder, without Tune
@pytest.mark.system
@pytest.mark.parametrize("params, status, reason", [
    ({"train.batch_size": 8}, OOM, "skipped: largest batch that fits is 6"),
    # values each valid alone, invalid together: the trial fails before anything trains, with a child run
    ({"model.attention": "cudnn", "model.doc_masking": True}, FAILED,
     "ConfigError: model.attention=cudnn runs plain causal attention"),
])
def test_trial_that_ends_before_training_is_recorded_without_training(mlflow_server, tmp_path, monkeypatch, params,
                                                                     status, reason):
    """run_trial's paths that end before Train starts, with Tune's context and report swapped for stand-ins, recorded
    in MLflow: a batch the max-batch finder says cannot fit, a config invalid as a whole."""
    import ray.tune
    from mlflow.tracking import MlflowClient

    import pipeline.train.ray_train
    from pipeline.tracking.tracker import Tracker
    from pipeline.sweep.trial import run_trial

    cfg = load_config("test", {"run.root": str(tmp_path), "tracking.tracking_uri": mlflow_server[0],
                               "tracking.experiment": "skip-path"})
    dataset = tmp_path / "ds"
    dataset.mkdir()
    (dataset / "manifest.json").write_text("{}")
    monkeypatch.setattr("pipeline.data.shards.load_manifest", lambda d: type("M", (), {
        "vocab_size": 300, "tokenizer_sha256": "ab" * 32, "settings_hash": "cd" * 8})())
    reports = []
    monkeypatch.setattr(ray.tune, "get_context", lambda: type("C", (), {"get_trial_id": lambda self: "x_00007"})())
    monkeypatch.setattr(ray.tune, "report", reports.append)
    monkeypatch.setattr(pipeline.train.ray_train, "run_training", lambda *a, **k: pytest.fail("a skipped trial must not train"))
    parent = Tracker(cfg, run_name="sweep")
    ctx = SweepContext(cfg.flat(), str(dataset), str(tmp_path / "sweep"), "sweep", "val/loss", 0, parent.run_id,
                       max_fit={"nano": 6})
    with pytest.raises(TrialFailed, match=status):
        run_trial(params, ctx)
    assert reports[-1]["sweep/status"] == status and reason in reports[-1]["sweep/reason"]
    assert math.isnan(reports[-1]["val/loss"])  # Tune's metric is present (strict metric checking)
    child = MlflowClient(cfg.tracking.tracking_uri).get_run(reports[-1]["sweep/mlflow_run_id"])
    assert child.info.status == "FAILED" and child.data.tags[PARENT_RUN_TAG] == parent.run_id
    assert child.data.tags[TAG_STATUS] == status
    assert (child.data.tags[TAG_REASON] == "oom") if status == OOM else (reason in child.data.tags[TAG_REASON])
    assert child.data.tags[TAG_TRIAL] == "x_00007"
    assert all(child.data.params[k] == str(v) for k, v in params.items())


@pytest.mark.system
def test_finder_runs_as_a_ray_task_per_tier(ray_session, tmp_path):
    from pipeline.train.max_batch import find_max_batch
    from pipeline.sweep.batch_fit import max_fit_per_tier

    cfg = load_config("test", {"data.seq_len": 32, "data.vocab_size": 300, "train.memory_limit_gib": 6 / 1024,
                               "ray.use_gpu": "false"})
    space = load_space(_space(tmp_path, {"skip_unfit_batch": True, "params": {
        "train.batch_size": {"grid": [1, 4, 256]}, "model.tier": {"grid": ["nano"]}}}), cfg)
    found = max_fit_per_tier(cfg, space, vocab_size=300)
    here = find_max_batch(cfg, vocab_size=300, upper=256, device=torch.device("cpu"))
    assert found == {"nano": here.max_batch} and 4 <= here.max_batch < 256


# ---------------------------------------------------------------------------------- a real sweep
SWEEP_SPACE = {
    "description": "test sweep: batch size on a simulated 6 MiB device",
    "metric": "val/loss", "mode": "min", "num_samples": 1, "max_concurrent_trials": 3,
    # ASHA over tokens seen, with a grace period no trial reaches: none is stopped, so the outcome is fixed
    "scheduler": {"type": "asha", "time_attr": "train/tokens_seen", "grace_period": 1_000_000,
                  "reduction_factor": 2},
    "resources_per_trial": {"num_workers": 1, "cpus_per_worker": 1, "use_gpu": "false"},
    "fixed": {"ray.max_failures": 0, "train.memory_limit_gib": 6 / 1024, "train.max_steps": 4,
              "train.eval_every": 2, "train.checkpoint_every": 2, "train.log_every": 2, "train.eval_batches": 1},
    "params": {"train.batch_size": {"grid": [1, 4, 64]}},
}


@pytest.mark.system
def test_sweep_end_to_end_with_mlflow_parent_and_children(ray_session, mlflow_server, sweep_files, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.run import main

    uri, _ = mlflow_server
    corpus, runs = sweep_files  # shared with test_mixer_sweep.py: one prepared dataset for both
    space = _space(tmp_path, SWEEP_SPACE)
    args = ["tune", "--space", str(space), "--preset", "test", f"--run.root={runs}",
            "--data.source=files", f"--data.path={corpus}", "--data.seq_len=32",
            "--data.vocab_size=400", "--data.max_documents=0", "--data.val_fraction=0.1",
            "--data.tokenize_actors=1", f"--tracking.tracking_uri={uri}", "--tracking.experiment=sweep-e2e",
            "--run.name=bs-sweep"]
    assert main(args) == 0
    captured = capsys.readouterr()
    out = captured.out
    # No "Exception ignored ... SystemExit: 1" forwarded from a trial's actor as the raylet ends it (the traceback of
    # the trial that runs out of memory on purpose is still printed, by its Ray Train worker and by Tune)
    console = captured.out + captured.err
    assert "Exception ignored" not in console and "SystemExit" not in console, console
    assert ("| tier | batch size | tokens/s | MFU | timed steps | peak memory (GiB) | val/loss | status | trial |"
            in out)
    # The console: one line per trial status change, no Tune status tables (they were ~130 lines for 2 trials)
    assert "Trial status:" not in out and "Trial name" not in out, out
    status = [ln.split("  [")[0].split(" ", 3)[3] for ln in out.splitlines() if ln.startswith("tune: trial ")]
    assert sorted(st.split(" (")[0] for st in status if st.startswith("running")) == ["running"] * 3
    assert sum(st.startswith("finished: val/loss=") and st.endswith(" at step 4") for st in status) == 2, status
    assert sum(st.startswith("failed: oom (") for st in status) == 1, status
    sweep_dir = runs / "tune" / "bs-sweep"

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("sweep-e2e")
    parents = client.search_runs([exp.experiment_id], f"tags.`{TAG_SWEEP}` = 'bs-sweep' and attributes.run_name = 'bs-sweep'")
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and PARENT_RUN_TAG not in parent.data.tags
    assert parent.data.params["sweep.metric"] == "val/loss" and parent.data.params["sweep.scheduler"] == "asha"
    assert parent.data.metrics["sweep/trials"] == 3 and parent.data.metrics["sweep/trials_ok"] == 2
    assert parent.data.metrics["sweep/trials_oom"] == 1

    children = client.search_runs([exp.experiment_id], f"tags.`{PARENT_RUN_TAG}` = '{parent.info.run_id}'")
    by_bs = {int(c.data.params["train.batch_size"]): c for c in children}
    assert sorted(by_bs) == [1, 4, 64]
    single_run_params = set(load_config("test").flat()) | {"model.params", "model.active_params", "world_size",
                                                           "tokenizer_sha256", "manifest_hash", "git_commit"}
    final_val = {}
    for bs, child in by_bs.items():
        assert set(child.data.params) == single_run_params  # the same names as a single run
        assert child.data.params["train.memory_limit_gib"] == str(6 / 1024)
        assert set(child.data.metrics) <= set(METRICS)
        if bs == 64:
            assert child.info.status == "FAILED"
            assert child.data.tags[TAG_REASON] == "oom" and child.data.tags[TAG_STATUS] == OOM
            continue
        assert child.info.status == "FINISHED" and child.data.tags[TAG_STATUS] == OK
        history = client.get_metric_history(child.info.run_id, "val/loss")
        assert sorted(m.step for m in history) == [2, 4]
        tokens = client.get_metric_history(child.info.run_id, "train/tokens_seen")
        assert max(m.value for m in tokens) == 4 * bs * 32  # 4 steps x bs rows x 32 tokens
        assert 0 < child.data.metrics["train/peak_mem_gib"] <= 6 / 1024  # the simulated device's count
        final_val[bs] = next(m.value for m in history if m.step == 4)

    # The table, as files and as the parent's artifacts
    table = (sweep_dir / "sweep_table.md").read_text()
    assert "| nano | 64 | – | – | – | – | – | oom (OutOfMemoryError: cpu out of memory: " in table
    assert "MiB would be live on a simulated 6.0 MiB device" in table
    for bs in (1, 4):  # steady-state tokens/s over step 4 of 4 (the first 3 are warm-up), the trial's peak memory
        steady = by_bs[bs].data.metrics["train/steady_tokens_per_s"]
        peak = by_bs[bs].data.metrics["train/peak_mem_gib"]
        assert (f"| nano | {bs} | {steady:,.0f} | – | 4–4 | {peak:.3f} | {final_val[bs]:.4f} | ok |" in table), table
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"sweep_table.md", "sweep_table.png", "best_preset.yaml", "space.yaml", "base_config.json"} <= artifacts
    local = Path(client.download_artifacts(parent.info.run_id, "sweep_table.md", str(tmp_path / "dl")))
    assert local.read_text() == table
    png = Path(client.download_artifacts(parent.info.run_id, "sweep_table.png", str(tmp_path / "dl")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # The best finished trial becomes a preset that the CLI's config loader accepts
    best_bs = min(final_val, key=final_val.get)
    preset = load_config(str(sweep_dir / "best_preset.yaml"))
    assert preset.train.batch_size == best_bs and preset.data.seq_len == 32 and preset.train.max_steps == 4
    assert preset.run.name == "" and preset.ray.storage_path == ""
    assert f"preset: {sweep_dir / 'best_preset.yaml'}" in out


def test_cli_reports_a_bad_space_in_one_line(tmp_path, capsys):
    from pipeline.run import main

    bad = _space(tmp_path, {"params": {"train.lr": {"loguniform": [-1.0, 1e-3]}}})
    assert main(["tune", "--space", str(bad), "--preset", "test", f"--run.root={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: search space {bad}: params train.lr: loguniform needs lo > 0, got [-1.0, 0.001]"]
    assert main(["tune", "--preset", "test"]) == 2
    assert "tune needs --space FILE" in capsys.readouterr().err
    assert not (tmp_path / "tune").exists()  # nothing ran


def test_status_lines_are_one_compact_line_per_trial_status_change(capsys):
    """The sweep console's callback on trials as Tune hands them over (id, config, status, last result)."""
    from types import SimpleNamespace

    from pipeline.sweep.status_lines import StatusLines
    from pipeline.sweep.trial import REASON_KEY, STATUS_KEY

    lines = StatusLines("val/loss", ["model.tier", "train.lr"], STATUS_KEY, REASON_KEY)
    a = SimpleNamespace(trial_id="t_00000", config={"model.tier": "nano", "train.lr": 0.00123}, status="RUNNING",
                        last_result={})
    b = SimpleNamespace(trial_id="t_00001", config={"model.tier": "A", "train.lr": 0.001}, status="PENDING",
                        last_result={})
    lines.on_trial_start(0, [a, b], a)
    a.status, a.last_result = "TERMINATED", {"val/loss": 5.12341, "step": 8, STATUS_KEY: "ok"}
    b.status = "RUNNING"
    lines.on_trial_complete(1, [a, b], a)
    b.status, b.last_result = "ERROR", {STATUS_KEY: "oom", REASON_KEY: "skipped: largest batch that fits is 4"}
    lines.on_trial_error(2, [a, b], b)
    c = SimpleNamespace(trial_id="t_00002", config={}, status="TERMINATED", last_result={"val/loss": 6.0, "step": 2})
    lines.on_trial_complete(3, [a, b, c], c)
    assert capsys.readouterr().out.splitlines() == lines.lines == [
        "tune: trial t_00000 running (model.tier=nano train.lr=0.00123)  [1 running, 1 pending]",
        "tune: trial t_00000 finished: val/loss=5.1234 at step 8  [1 running, 1 done]",
        "tune: trial t_00001 failed: oom (skipped: largest batch that fits is 4)  [2 done]",
        "tune: trial t_00002 stopped early by the scheduler: val/loss=6.0000 at step 2  [3 done]",
    ]
