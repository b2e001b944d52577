"""What a refused command leaves behind, and what a resume records: each test types a command line as a user does
(`python pipeline/run.py ...` in a subprocess) on a --no-ray run of the tiny `test` preset (the fixtures of
test_resume_extend.py: a corpus prepared once, runs tracked to the session's MLflow server).

    .venv/bin/python -m pytest -q tests/pipeline/train/test_resume_record.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipeline.train.test_resume_extend import common, finished_run  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[3]
RUN = [sys.executable, str(ROOT / "pipeline" / "run.py")]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def one_error_line(res: subprocess.CompletedProcess) -> str:
    """The refused command's stderr: exit 2, one line, no traceback."""
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def what_the_run_is(run_dir: Path, mlflow_uri: str) -> tuple[bytes, str, tuple]:
    """run.json byte for byte, the `runs` line of the run, and its MLflow run (status, end time, params, tags)."""
    from mlflow.tracking import MlflowClient

    record = (run_dir / "run.json").read_bytes()
    listing = run_cli("runs", f"--run.root={run_dir.parent}")
    assert listing.returncode == 0, listing.stderr
    row = next(ln for ln in listing.stdout.splitlines() if ln.startswith(run_dir.name + " "))
    run = MlflowClient(mlflow_uri).get_run(json.loads(record)["mlflow_run_id"])
    return record, row, (run.info.status, run.info.end_time, run.data.params, run.data.tags)


@pytest.mark.system
def test_a_refused_resume_leaves_the_run_its_record_and_its_mlflow_run_as_they_were(finished_run,  # noqa: F811
                                                                                      mlflow_server):
    """`train --resume RUN --no-ray --model.tier=A --train.max_steps=...` was refused only once training loaded the
    checkpoint, after run.json had taken model.tier A and the new max_steps and the MLflow run had turned FAILED; the
    next plain resume then failed for a tier the user had not typed. Every refusal now comes first."""
    before = what_the_run_is(finished_run, mlflow_server[0])
    assert json.loads(before[0])["status"] == "finished" and before[2][0] == "FINISHED"
    refusals = {
        ("--model.tier=A", "--train.max_steps=210"):
            f"error: run {finished_run} was trained with model.tier='nano' and a resumed run keeps its model and "
            f"tokenizer; drop --model.tier=A (or start a new run without --resume)",
        ("--data.vocab_size=300", "--train.max_steps=8"):
            f"error: run {finished_run} was trained with data.vocab_size=",
        ("--run.name=other",):
            f"error: --run.name=other: --resume continues run {finished_run} under its own name ({finished_run.name}); "
            f"drop --run.name (a new run of that name: leave out --resume)",
        ("--tracking.tracking_uri=http://127.0.0.1:9", "--train.max_steps=8"): "error: ",  # no server there
    }
    for flags, line in refusals.items():
        res = run_cli("train", "--resume", str(finished_run), "--no-ray", *flags)
        assert one_error_line(res).startswith(line), (flags, res.stderr)
        assert what_the_run_is(finished_run, mlflow_server[0]) == before, flags
    res = run_cli("train", "--resume", str(finished_run), "--no-ray")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"run {finished_run} is finished (step 4 of 4); nothing to continue.")


@pytest.mark.system
def test_an_extended_run_records_its_new_max_steps_in_mlflow(finished_run, mlflow_server):  # noqa: F811
    """`--resume RUN --train.max_steps=N` on a finished run: MLflow's param train.max_steps is write-once (it keeps
    the value the run started with, and a warning said the new value was not recorded); the tag longtrain.max_steps
    now holds the steps the run trains to, and nothing warns."""
    from mlflow.tracking import MlflowClient

    record = json.loads((finished_run / "run.json").read_text())
    first = int(record["config"]["train.max_steps"])
    total = sum(p["steps"] for p in record["phases"]) + 2
    res = run_cli("train", "--resume", str(finished_run), "--no-ray", f"--train.max_steps={total}")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "not recorded" not in out and "Traceback" not in out, out
    run = MlflowClient(mlflow_server[0]).get_run(record["mlflow_run_id"])
    assert run.data.tags["longtrain.max_steps"] == str(total)
    assert run.data.tags["longtrain.extended"].startswith(f"train.max_steps {total - 2} -> {total}:")
    assert run.data.params["train.max_steps"] == str(first) and run.info.status == "FINISHED"


@pytest.mark.system
def test_a_run_root_that_is_a_file_gets_one_line(tmp_path):
    """--run.root naming a file raised NotADirectoryError with a traceback."""
    root = tmp_path / "runs"
    root.write_text("not a directory\n")
    want = (f"error: run.root={root} is a file, not a directory; pass --run.root=DIR a directory (it is created when "
            f"missing), or move the file away")
    assert one_error_line(run_cli("train", "--preset", "test", "--no-ray", f"--run.root={root}")) == want
    assert one_error_line(run_cli("runs", f"--run.root={root}")) == want
    below = root / "sub"
    assert one_error_line(run_cli("runs", f"--run.root={below}")) == (
        f"error: run.root={below} is under {root}, which is a file, not a directory; pass --run.root=DIR a directory "
        f"(it is created when missing), or move the file away")
    assert root.read_text() == "not a directory\n"


@pytest.mark.system
def test_validate_finds_a_run_by_its_name_under_run_root_and_names_a_missing_path(finished_run, tmp_path):  # noqa: F811
    """`validate <name> --run.root=DIR` was refused (validate took no field); `validate base` for a path that is not
    there said it was not a prepared dataset and to run prepare."""
    res = run_cli("validate", finished_run.name, f"--run.root={finished_run.parent}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads((finished_run / "run.json").read_text())["checkpoint"] in res.stdout
    missing = tmp_path / "base"
    assert one_error_line(run_cli("validate", str(missing), f"--run.root={tmp_path}")) == (
        f"error: validate {missing}: no such path, and no run named {missing} under run.root ({tmp_path}); validate "
        f"takes a dataset directory, a checkpoint directory, a run directory or a run's name (add --run.root=DIR for "
        f"a run under another root)")
    assert one_error_line(run_cli("validate", finished_run.name, "--train.lr=1")).startswith(
        "error: --train.lr=1 is not used by `validate`")
