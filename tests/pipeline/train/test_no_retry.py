"""An error that the next attempt would raise again spends no Ray Train retry (pipeline/train/distributed/failure_policy.py): a
Ray Train run resumed from a checkpoint whose train_state.pt is corrupt ends after one attempt, with one line and no
worker traceback, whatever ray.max_failures allows; an outage or a lost worker is still retried."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError
from pipeline.storage import StorageError
from pipeline.train.checkpoints.broken import BrokenCheckpoint
from pipeline.train.distributed.collectives import CollectiveTimeoutError

ROOT = Path(__file__).resolve().parents[3]
RUN = [sys.executable, str(ROOT / "pipeline" / "run.py")]


@pytest.mark.parametrize("error, decision", [
    (BrokenCheckpoint("runs/x/ray/phase0/checkpoint_1", "train_state.pt is corrupt", None), "RAISE"),
    (ConfigError("train.lr: must be > 0"), "RAISE"),
    (StorageError("s3://b/x: the endpoint did not answer"), "RETRY"),
    (CollectiveTimeoutError("rank 1 did not join"), "RETRY"),
    (RuntimeError("CUDA error: an illegal memory access"), "RETRY"),  # not the project's: Ray Train's retries
])
def test_the_policy_raises_at_once_only_what_would_repeat(error, decision):
    from ray.train import FailureConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    from pipeline.train.distributed.failure_policy import NoRetryOfRepeatingErrors

    policy = NoRetryOfRepeatingErrors(FailureConfig(max_failures=3))
    assert policy.make_decision(WorkerGroupError(str(error), {0: error})).value == decision


def _train_workers_started(class_name: str = "RayTrainWorker") -> int:
    """Ray Train workers (or actors of another class) the session's Ray has started so far (ended ones too), by its
    state API."""
    import ray
    from ray.util.state import list_actors

    api = f"http://{ray._private.worker.get_dashboard_url()}"  # this Ray's: others may run on the machine
    return len(list_actors(address=api, filters=[("class_name", "=", class_name)], limit=10_000,
                           raise_on_missing_output=False))


@pytest.mark.system
def test_a_corrupt_train_state_under_ray_train_is_one_attempt_and_one_line(test_runs_root, ray_address):
    from pipeline.train.session.run_dir import latest_of_run

    common = ["--preset", "test", f"--run.root={test_runs_root}", "--address", ray_address, "--tracking.enabled=false"]
    managers = _train_workers_started("DatasetManager")
    res = subprocess.run([*RUN, "train", *common, "--run.name=no-retry", "--train.max_steps=4",
                          "--train.checkpoint_every=2", "--train.eval_every=2", "--train.sample_tokens=0"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    # the workers read their own rows: Ray Train started no DatasetManager actor for the run (ray_train.py)
    assert _train_workers_started("DatasetManager") == managers
    run = test_runs_root / "no-retry"
    state = Path(latest_of_run(run)[0]) / "train_state.pt"
    state.write_bytes(b"\x5a" * state.stat().st_size)  # whole by its listing; its bytes are wrong
    before = _train_workers_started()
    res = subprocess.run([*RUN, "train", "--resume", str(run), *common, "--train.max_steps=6",
                          "--ray.max_failures=3"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr, res.stdout + res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "train_state.pt" in last, res.stderr
    assert _train_workers_started() - before == 1  # one attempt of its one worker, not max_failures + 1
