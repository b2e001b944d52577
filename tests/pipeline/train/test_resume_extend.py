"""`--resume` does what the user asked, `--checkpoint` takes a run directory, `runs` lists the runs, and a Ctrl+C
in the Ray-free path and during eval ends cleanly. Each test is a newcomer's command line run through the CLI's
main() in this process, on the Ray-free engine (--no-ray) and the session's prepared `test` dataset: nothing is
prepared and no Ray Train run starts. Runs track to the session's MLflow server.

    .venv/bin/python -m pytest -q tests/pipeline/train/test_resume_extend.py
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline.train.engine import lr_lambda

pytestmark = pytest.mark.system

GPU_ONLY_METRICS = ("train/mfu", "train/hfu", "train/mfu_causal_equiv", "train/steady_mfu")


@pytest.fixture(scope="module")
def common(files_dataset, mlflow_server, tmp_path_factory) -> list[str]:
    """The command line every test's runs share: a run root of the module's own, on the session's files dataset
    (tests/pipeline/conftest.py: prepared once on the session's Ray, found again in its dataset store) with its
    tokenizer named explicitly, so that a phase added later reuses the same dataset (a later phase's data is
    prepared with the first phase's tokenizer) instead of preparing another."""
    root = tmp_path_factory.mktemp("resume-runs")
    return ["--preset", "test", f"--run.root={root}", *files_dataset.overrides, "--train.sample_tokens=0",
            f"--tracking.tracking_uri={mlflow_server[0]}", "--tracking.experiment=resume-extend",
            "--tracking.system_metrics=false"]


def _root(common: list[str]) -> Path:
    return Path(next(a for a in common if a.startswith("--run.root=")).split("=", 1)[1])


def _main(args: list[str], capsys) -> tuple[int, str, str]:
    from pipeline.run import main

    code = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out, err


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _meta(checkpoint: str) -> dict:
    return json.loads((Path(checkpoint) / "meta.json").read_text())


@pytest.fixture(scope="module")
def finished_run(common) -> Path:
    """A --no-ray run trained to its end: 4 steps."""
    from pipeline.run import main

    assert main(["train", "--no-ray", *common, "--train.max_steps=4", "--run.name=done4"]) == 0
    run_dir = _root(common) / "done4"
    assert _record(run_dir)["status"] == "finished"
    return run_dir


def test_resuming_a_finished_run_says_how_to_extend_it_and_trains_nothing(finished_run, capsys):
    before = _record(finished_run)["checkpoint"]
    code, out, _ = _main(["train", "--resume", str(finished_run), "--no-ray"], capsys)
    assert code == 0
    assert out.strip() == (f"run {finished_run} is finished (step 4 of 4); nothing to continue. To train further, "
                           f"raise train.max_steps (the learning-rate schedule is stretched to it) or add phases "
                           f"(--phases): python pipeline/run.py train --resume {finished_run} --no-ray "
                           f"--train.max_steps=8")
    assert _record(finished_run)["checkpoint"] == before


def test_resuming_a_no_ray_run_without_no_ray_names_the_command_that_works(finished_run, capsys):
    code, _, err = _main(["train", "--resume", str(finished_run)], capsys)
    assert code == 2
    assert err.strip() == (f"error: run {finished_run} trained with --no-ray (its checkpoints are under "
                           f"checkpoints/); resume it the same way: python pipeline/run.py train --resume "
                           f"{finished_run} --no-ray")


def test_a_larger_max_steps_or_an_added_phase_extends_a_finished_run(finished_run, mlflow_server, tmp_path, capsys):
    """`train --resume RUN --train.max_steps=8` on a finished 4-step run exited 0 with no training and no message.
    Now it trains steps 4..8 from the last checkpoint on a schedule stretched to 8 steps, and says so in the header
    and in MLflow; a phases file that adds a phase then trains that phase from there."""
    from mlflow.tracking import MlflowClient

    code, out, err = _main(["train", "--resume", str(finished_run), "--no-ray", "--train.max_steps=8"], capsys)
    assert code == 0, out + err
    extended = ("train.max_steps 4 -> 8: the learning-rate schedule (2 warmup steps, cosine to 0.1 x lr) now spans 8 "
                "steps")
    assert (f"==> train: tier nano, steps 4..8 (resumed at step 4; {extended}), one process, no Ray; run "
            f"{finished_run}") in out
    record = _record(finished_run)
    assert record["status"] == "finished" and record["phases"] == [{"steps": 8, "overrides": {}}]
    meta = _meta(record["checkpoint"])
    assert meta["counters"]["step"] == 8 and meta["config"]["train"]["max_steps"] == 8
    client = MlflowClient(mlflow_server[0])
    run = client.get_run(record["mlflow_run_id"])
    assert run.data.tags["longtrain.extended"] == extended
    if not torch.cuda.is_available() and not os.environ.get("LONGTRAIN_PEAK_TFLOPS"):
        # docs/tracking.md names the metrics a CPU run does not log: they need a GPU's peak FLOP/s
        tracking_doc = (Path(__file__).resolve().parents[3] / "docs" / "tracking.md").read_text()
        gpu_only = tracking_doc.split("**Metrics that need a GPU.**", 1)[1].split("not logged", 1)[0]
        assert sorted(re.findall(r"`(train/\w+)`", gpu_only)) == sorted(GPU_ONLY_METRICS)
        assert not set(GPU_ONLY_METRICS) & set(run.data.metrics) and "train/tflops_per_gpu" in run.data.metrics
    lr = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/lr")}
    # step 6 on the 8-step cosine; the 4-step schedule had reached its floor (0.1 x lr) at step 4
    assert lr[6] == pytest.approx(3e-3 * lr_lambda(6, 2, 8, 0.1)) and lr[6] > 3 * 3e-3 * 0.1
    assert lr[2] == pytest.approx(3e-3 * lr_lambda(2, 2, 4, 0.1))  # the first 4 steps kept their own values

    code, _, err = _main(["train", "--resume", str(finished_run), "--no-ray", "--train.max_steps=6"], capsys)
    assert code == 2 and err.strip() == ("error: train.max_steps=6 is not past step 8, which this run has reached; "
                                         "give a larger value to train further")

    phases = tmp_path / "phases.yaml"
    phases.write_text("- steps: 8\n- steps: 2\n  overrides: {train.lr: 1.0e-3}\n")
    code, out, err = _main(["train", "--resume", str(finished_run), "--no-ray", "--phases", str(phases)], capsys)
    assert code == 0, out + err
    assert "==> train: tier nano, steps 8..10 (phase 1) (train.max_steps 8 -> 10: " in out
    record = _record(finished_run)
    assert record["phases_done"] == 2 and len(record["phases"]) == 2
    assert _meta(record["checkpoint"])["counters"] == {**_meta(record["checkpoint"])["counters"], "step": 10,
                                                       "phase": 1}


def test_checkpoint_takes_a_run_directory_and_runs_lists_it(finished_run, capsys):
    """`eval --checkpoint runs/<run>` (the run, not one of its checkpoints) evaluates its latest checkpoint, and
    `runs` lists the run with its status, steps, val loss and that checkpoint."""
    record = _record(finished_run)
    root = finished_run.parent
    code, out, _ = _main(["eval", "--checkpoint", str(finished_run), f"--run.root={root}"], capsys)
    assert code == 0, out
    assert f"==> eval: {record['checkpoint']} on the validation split" in out and "eval: eval/loss=" in out
    code, out, _ = _main(["eval", "--checkpoint", finished_run.name, f"--run.root={root}"], capsys)  # its name
    assert code == 0 and f"==> eval: {record['checkpoint']} on" in out

    code, out, _ = _main(["runs", f"--run.root={root}"], capsys)
    assert code == 0
    header, *lines = out.strip().splitlines()
    assert header.split() == ["run", "status", "steps", "val", "loss", "how", "last", "checkpoint"]
    meta = _meta(record["checkpoint"])
    step = meta["counters"]["step"]
    total = sum(p["steps"] for p in record["phases"])
    row = next(ln for ln in lines if ln.startswith(finished_run.name + " "))
    assert row.split() == [finished_run.name, record["status"], f"{step}/{total}", f"{meta['metrics']['val/loss']:.4f}",
                           "no-ray", record["checkpoint"]]


def _sigint_when(predicate, timeout_s: float = 300) -> threading.Thread:
    """A thread that sends this process SIGINT once predicate() holds, as a user's Ctrl+C (kill -INT) does."""
    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _as_a_background_job(args: list[str], capsys) -> tuple[int, str, str]:
    """main(args) started the way a shell script's `cmd &` starts it: with SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return _main(args, capsys)
    except KeyboardInterrupt:
        pytest.fail("a SIGINT escaped the command instead of ending it cleanly")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_training_without_ray_checkpoints_and_the_printed_hint_resumes_it(common, capsys):
    """Ctrl+C during a --no-ray run: it checkpoints and stops; the hint it prints, run exactly as printed (it used to
    leave out --no-ray), finishes the run, and its header shows the step it really starts from (it said 0..N)."""
    run_dir = _root(common) / "ctrlc-noray"
    audit = run_dir / "data_audit" / "rank_0.jsonl"

    def at_step_2() -> bool:
        lines = audit.read_text().splitlines() if audit.exists() else []
        return any(json.loads(ln)["step"] >= 2 for ln in lines if ln.strip())

    watcher = _sigint_when(at_step_2)
    code, out, _ = _as_a_background_job(["train", "--no-ray", *common, "--train.max_steps=24", "--run.name=ctrlc-noray",
                                         "--audit-data"], capsys)
    watcher.join(timeout=5)
    assert code == 0, out
    record = _record(run_dir)
    stopped_at = _meta(record["checkpoint"])["counters"]["step"]
    assert record["status"] == "stopped" and 2 <= stopped_at < 24
    hint = next(ln for ln in out.splitlines() if ln.startswith("continue with: "))
    assert hint == f"continue with: python pipeline/run.py train --resume {run_dir} --no-ray"
    words = shlex.split(hint.removeprefix("continue with: "))
    assert words[:2] == ["python", "pipeline/run.py"]
    code, out, _ = _main(words[2:], capsys)
    assert code == 0, out
    assert f"==> train: tier nano, steps {stopped_at}..24 (resumed at step {stopped_at}), one process, no Ray" in out
    assert _record(run_dir)["status"] == "finished" and _meta(_record(run_dir)["checkpoint"])["counters"]["step"] == 24


def test_ctrl_c_during_eval_ends_cleanly_and_says_nothing_was_logged(finished_run, mlflow_server, monkeypatch,
                                                                    capsys):
    """A SIGINT that arrives while eval reads its batches (the command started as a background job, SIGINT
    ignored): exit 130 and one line saying what was kept, and no eval metric logged to the run."""
    from mlflow.tracking import MlflowClient

    import pipeline.data.shards as shards

    real = shards.eval_reader

    def interrupted_reader(*args, **kwargs):
        for i, batch in enumerate(real(*args, **kwargs)):
            if i == 1:
                os.kill(os.getpid(), signal.SIGINT)  # a real signal, delivered to this (the main) thread
            yield batch

    monkeypatch.setattr(shards, "eval_reader", interrupted_reader)
    record = _record(finished_run)
    client = MlflowClient(mlflow_server[0])
    logged_before = len(client.get_metric_history(record["mlflow_run_id"], "eval/loss"))
    code, out, err = _as_a_background_job(["eval", "--checkpoint", str(finished_run),
                                           f"--run.root={finished_run.parent}"], capsys)
    assert code == 130
    assert err.strip().splitlines()[-1] == ("interrupted: during eval: nothing was logged, and the checkpoint is "
                                            "unchanged")
    assert len(client.get_metric_history(record["mlflow_run_id"], "eval/loss")) == logged_before
