"""Downstream tasks scored beside Ray Train (pipeline/train/task_scoring.py): Ray Train's validation hook scores the
checkpoints in a Ray task while the worker goes on training, a task that fails is a FAILED mark for it alone and the
run finishes, and the scores land in the training run's MLflow run at the checkpoints' steps with the picture.

"While training goes on" is shown by the run's own step timestamps: train/loss is logged at every step, and steps
later than the scored checkpoint were logged inside the scoring's time span (eval/<task>/seconds before its scores
were logged), whatever the machine's speed. The run is 150 steps, not 40: the first scoring task starts a Ray worker
that imports torch and lm-eval, which on 2 loaded cores outlasted a 40-step run (11 s: every checkpoint was then
scored after the last step, 2026-12-02).
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")

pytestmark = pytest.mark.system


def test_tasks_are_scored_beside_training_and_a_failing_task_stops_nothing(ray_session, tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.config import load_config
    from pipeline.tracking.names import TRAIN_LOSS, task_metric, task_seconds, task_status_tag
    from pipeline.train.session.train_session import TrainSession, load_phases
    from tests.pipeline.train.hf_helpers import build_dataset

    broken = tmp_path / "tasks" / "broken.yaml"  # data that is not there: FAILED, for this task alone
    broken.parent.mkdir()
    broken.write_text("task: broken_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                      f"{tmp_path / 'missing.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
                      "doc_to_text: q\ndoc_to_choice: c\ndoc_to_target: 0\n")
    cfg, _ = build_dataset(tmp_path / "data", seq_len=256, overrides={
        "run.root": str(tmp_path / "runs"), "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "train.max_steps": 150, "train.log_every": 1, "train.eval_every": 50, "train.checkpoint_every": 30,
        "train.sample_tokens": 0, "eval.tasks": f"builtin_cloze,{broken}", "eval.limit": 24.0})
    run_dir = tmp_path / "runs" / "scored"
    run_dir.mkdir(parents=True)
    result = TrainSession(cfg, run_dir, load_phases(None, cfg)).run()
    assert result.checkpoint is not None

    client = MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    run = client.get_run(json.loads((run_dir / "run.json").read_text())["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    steps = {m.step: m.timestamp for m in client.get_metric_history(run.info.run_id, TRAIN_LOSS)}
    assert max(steps) == 150  # a failing task stopped nothing
    assert run.data.tags[task_status_tag("broken_local")].startswith("FAILED at step ")
    assert run.data.tags[task_status_tag("builtin_cloze")].startswith("ok at step ")
    scored = client.get_metric_history(run.info.run_id, task_metric("builtin_cloze", "acc"))
    assert {m.step for m in scored} >= {30, 150} and all(0 <= m.value <= 1 for m in scored)
    assert "eval_tasks.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
    seconds = {m.step: m.value for m in client.get_metric_history(run.info.run_id, task_seconds("builtin_cloze"))}
    # a checkpoint scored while the worker trained on: later steps were logged inside its scoring's time span
    beside = [m.step for m in scored if m.step < 150 and any(
        step > m.step and m.timestamp - 1000 * seconds[m.step] <= t <= m.timestamp for step, t in steps.items())]
    assert beside, (f"no step was logged while a checkpoint was scored: scores "
                    f"{[(m.step, m.timestamp) for m in scored]}, seconds {seconds}, steps {sorted(steps.items())}")
