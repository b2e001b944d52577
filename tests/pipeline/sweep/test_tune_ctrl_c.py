"""Ctrl+C during `python pipeline/run.py tune` behaves as it does during `train`: exit status 130, one `interrupted:`
line saying what was kept and how to go on, the sweep's MLflow run and its unfinished trials' runs KILLED, and
none of Tune's own ending (trials labelled stopped by the scheduler, a table, a Tuner.restore(...) hint the CLI
cannot follow). The trials' placement groups are all gone by the time the command exits, on a Ray that outlives it."""
from __future__ import annotations

import pytest
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pipeline.sweep.placement_groups import job_placement_groups, release_placement_groups
from pipeline.sweep.trial import TAG_SWEEP

pytestmark = pytest.mark.system  # docs/tests.md: the system tier

ROOT = Path(__file__).resolve().parents[3]
RUN = [sys.executable, str(ROOT / "pipeline" / "run.py")]
SPACE = {
    "metric": "val/loss", "mode": "min", "num_samples": 1, "max_concurrent_trials": 2,
    "scheduler": {"type": "fifo"},
    "resources_per_trial": {"num_workers": 1, "cpus_per_worker": 1, "use_gpu": "false"},
    # long enough that the Ctrl+C finds both trials training
    "fixed": {"train.max_steps": 100_000, "train.eval_every": 2, "train.checkpoint_every": 2, "train.log_every": 2,
              "train.eval_batches": 1, "train.sample_tokens": 0},
    "params": {"train.batch_size": {"grid": [1, 2]}},
}


def test_ctrl_c_during_a_sweep_ends_it_as_train_does(ray_session, ray_address, mlflow_server, sweep_files, tmp_path):
    from mlflow.tracking import MlflowClient

    uri, _ = mlflow_server
    corpus, runs = sweep_files
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    args = ["tune", "--space", str(space), "--preset", "test", f"--run.root={runs}", "--address", ray_address,
            "--data.source=files", f"--data.path={corpus}", "--data.seq_len=32", "--data.vocab_size=400",
            "--data.max_documents=0", "--data.val_fraction=0.1", "--data.tokenize_actors=1",
            f"--tracking.tracking_uri={uri}", "--tracking.experiment=sweep-ctrl-c", "--run.name=ctrl-c"]
    proc = subprocess.Popen([*RUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    client = MlflowClient(tracking_uri=uri)
    try:
        deadline, training = time.monotonic() + 600, []
        while len(training) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(2)
            exp = client.get_experiment_by_name("sweep-ctrl-c")
            found = client.search_runs([exp.experiment_id], f"tags.`{TAG_SWEEP}` = 'ctrl-c'") if exp else []
            training = [r for r in found if r.info.run_name != "ctrl-c" and r.data.metrics.get("train/loss")
                        is not None]  # a child run that logged a training step
        assert len(training) == 2, proc.communicate(timeout=60) if proc.poll() is not None else "no trial trained"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # the sweep's job, and the one that joined again after it ended to remove what it still held
    jobs = [j["JobID"] for j in ray_session._private.state.jobs() if j["DriverPid"] == proc.pid]
    held = {pg: info["state"] for pg, info in ray_session.util.placement_group_table().items()
            if pg[-8:] in jobs and info["state"] != "REMOVED"}  # as the command exits: none of its jobs' left
    assert proc.returncode == 130, out + err
    assert len(jobs) == 2 and held == {}, (jobs, held)
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: during the sweep: its MLflow run and those of its unfinished trials are "
                           "marked KILLED"), err
    assert f"python pipeline/run.py tune --space {space}" in last
    assert "Tuner.restore" not in out + err and "by the scheduler" not in out + err and "Traceback" not in out + err
    assert not (runs / "tune" / "ctrl-c" / "sweep_table.md").exists()
    found = client.search_runs([client.get_experiment_by_name("sweep-ctrl-c").experiment_id],
                               f"tags.`{TAG_SWEEP}` = 'ctrl-c'")
    assert sorted(r.info.status for r in found) == ["KILLED"] * 3, [(r.info.run_name, r.info.status) for r in found]


def test_groups_a_job_registers_after_its_last_was_removed_are_removed_too(ray_session):
    """What a Ctrl+C'd sweep's driver does once it has left a Ray that outlives it (`release_ended_job`): the job's
    placement groups are removed, and so is one registered after the last was removed, as a Train controller
    restarting its worker group does as its job ends; groups named as kept stay. Here on this process's own job."""
    from ray.util.placement_group import placement_group, remove_placement_group

    ray = ray_session
    job = ray.get_runtime_context().get_job_id()
    own = placement_group([{"CPU": 0.01}])
    ray.get(own.ready(), timeout=60)
    kept = frozenset(job_placement_groups(job))
    assert own.id.hex() in kept

    @ray.remote(num_cpus=0)
    class Restarter:  # a group; when it is removed, a new one: three times
        def run(self, times: int) -> list[str]:
            from ray.util.placement_group import placement_group_table

            made = []
            for _ in range(times):
                pg = placement_group([{"CPU": 0.01}])
                made.append(pg.id.hex())
                while placement_group_table(pg)["state"] != "REMOVED":
                    time.sleep(0.05)
            return made

    actor = Restarter.remote()
    made = actor.run.remote(3)
    deadline = time.monotonic() + 60
    while not job_placement_groups(job) - kept:  # the first is registered
        assert time.monotonic() < deadline, "the actor registered no placement group"
        time.sleep(0.05)
    removed = release_placement_groups(job, kept, quiet_s=3.0, timeout_s=60)
    try:
        made = ray.get(made, timeout=30)  # it returns only once its third group was removed
        assert removed == made and len(set(made)) == 3, (removed, made)
        assert job_placement_groups(job) == kept
        assert ray.util.placement_group_table(own)["state"] == "CREATED"
    finally:
        ray.kill(actor)
        remove_placement_group(own)
