"""Checkpoint uploads in the background (ray.checkpoint_upload=async; sync is the default), as a user sees them: `python
pipeline/run.py train` on object storage through the session's fault proxy (tests/conftest.py `fault_proxy`,
`proxy_env`), which holds the requests that write a checkpoint's files (a stall: no answer until released).

- async: the steps after a checkpoint go on while the store holds its upload; once the store answers again, the run
  finishes and every checkpoint left is complete and registered.
- sync: the step waits for the held upload (nothing is logged past the checkpoint until the store answers).
- a bad value of the field is one line.
"""
from __future__ import annotations

import json
import time

import pytest

from pipeline import storage
from pipeline.train.checkpoints.index import list_checkpoints, step_of
from tests.conftest import proxy_env
from tests.pipeline.test_storage_faults_train import run_watching

STEPS, EVERY = 12, 4
# The files of a checkpoint folder (checkpoint_<date>_<time>), not Ray's checkpoint_manager_snapshot.json
HELD = r"^(PUT|POST) \S*/ray/phase0/checkpoint_\d{4}-"


def held_run(s3_dataset, fault_proxy, ray_address, name: str, hold_s: float, *extra: str) -> dict:
    """A run of STEPS steps, a checkpoint every EVERY, whose checkpoint uploads the store holds from the first one
    on, for at most `hold_s` from that first upload (a bound on a step that waits for it; counted from the upload,
    so however long the run took to get there), or until the run logs step EVERY + 3 while they are held. Returns
    the run's exit code, output, the rule, and the steps logged while an upload was held."""
    fault_proxy.clear()
    fault_proxy.reset_log()
    held = fault_proxy.stall(HELD, lasting=hold_s)
    during: list[int] = []

    def on_step(step: int) -> None:
        if held.hits and held.active(time.monotonic()):
            during.append(step)
            if step >= EVERY + 3:
                held.until = 0.0  # the store answers again; the held requests are retried on new connections

    args = ["train", "--preset", "test", *s3_dataset.overrides, f"--run.name={name}", f"--train.max_steps={STEPS}",
            "--train.log_every=1", f"--train.checkpoint_every={EVERY}", f"--train.eval_every={EVERY}",
            "--train.sample_tokens=0", "--address", ray_address, *extra]
    try:
        code, out = run_watching(args, proxy_env(fault_proxy), on_step, timeout_s=600)
    finally:
        fault_proxy.clear()
    return {"code": code, "out": out, "held": held, "during": during, "run_dir": s3_dataset.run_root / name,
            "ckpts": f"{s3_dataset.overrides[-1].split('=', 1)[1]}/{name}/ray/phase0"}


def assert_complete_and_registered(run: dict) -> None:
    record = json.loads((run["run_dir"] / "run.json").read_text())
    assert record["status"] == "finished", record
    found = list_checkpoints(run["ckpts"])
    assert found and all(f.complete for f in found), [(f.name, f.problem) for f in found]
    assert record["checkpoint"] == max(found, key=lambda f: step_of(f.location)).location
    assert json.loads(storage.read_text(f"{record['checkpoint']}/meta.json"))["counters"]["step"] == STEPS
    # Ray's record names exactly the folders in the bucket: nothing unregistered left, nothing registered missing
    snapshot = json.loads(storage.read_text(f"{run['ckpts']}/checkpoint_manager_snapshot.json"))
    assert {r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]} == {f.name for f in found}


@pytest.mark.system
def test_steps_go_on_while_the_store_holds_a_checkpoint_upload(s3_dataset, fault_proxy, ray_address):
    run = held_run(s3_dataset, fault_proxy, ray_address, "upload-held", 240, "--ray.checkpoint_upload=async")
    assert run["code"] == 0, run["out"][-5000:]
    assert run["held"].hits > 0, "no checkpoint upload reached the store"
    assert max(run["during"], default=0) > EVERY, \
        f"no step after the step-{EVERY} checkpoint was logged while its upload was held: {run['during']}"
    assert "Traceback" not in run["out"], run["out"][-5000:]
    assert_complete_and_registered(run)


@pytest.mark.system
def test_with_sync_uploads_the_step_waits_for_the_held_upload(s3_dataset, fault_proxy, ray_address):
    # held for 30 s from the first upload: the async run above logs past step EVERY within seconds of it
    run = held_run(s3_dataset, fault_proxy, ray_address, "upload-held-sync", 30, "--ray.checkpoint_upload=sync")
    assert run["code"] == 0, run["out"][-5000:]
    assert run["held"].hits > 0, "no checkpoint upload reached the store"
    assert max(run["during"], default=0) <= EVERY, run["during"]
    assert_complete_and_registered(run)


def test_a_bad_checkpoint_upload_mode_is_one_line(capsys):
    from pipeline.run import main

    assert main(["train", "--ray.checkpoint_upload=later"]) == 2
    assert capsys.readouterr().err.strip() == ("error: ray.checkpoint_upload='later' is not allowed; choose one of: "
                                               "async, sync")
