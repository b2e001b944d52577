"""Training while object storage answers 403 AccessDenied, as a user runs it: `python pipeline/run.py train ...` in a
subprocess whose S3 traffic, and that of every Ray worker of its job, goes through the session's fault proxy
(tests/conftest.py `fault_proxy`, `proxy_env`).

- 403 for 25 s mid-run (a store's auth service away for a while): every storage call, a training-data read through
  Ray Data included, and a restart's wait for the store ride it out within run.storage_retry_s as they do an outage;
  the run finishes with the clean run's losses and no traceback on the console.

403 for good (credentials revoked), ending in one line that says the 403 was waited out for run.storage_retry_s and
that it may be the credentials: tests/pipeline/test_storage_faults_train.py (its resume from a chosen checkpoint).
"""
from __future__ import annotations

import json

import pytest

from pipeline import storage
from tests.conftest import proxy_env
from tests.pipeline.test_storage_faults_train import clean_losses, logged_losses, run_watching

pytestmark = pytest.mark.system  # docs/tests.md: the system tier

STEPS = 30
RETRY_S = 15  # run.storage_retry_s: shorter than the 403 below, so an attempt can give up inside it
DENIED_S = 25


def test_403_for_25s_mid_run_is_waited_out_and_the_run_finishes_without_a_traceback(s3_dataset, fault_proxy,
                                                                                    ray_address):
    fault_proxy.clear()
    fault_proxy.reset_log()
    denied = {}

    def on_step(step: int) -> None:
        if step >= 8 and not denied:
            denied["at"] = step
            denied["rule"] = fault_proxy.deny(seconds=DENIED_S)

    args = ["train", "--preset", "test", *s3_dataset.overrides, "--run.name=denied-25s", f"--train.max_steps={STEPS}",
            "--train.checkpoint_every=10", "--train.eval_every=10", f"--run.storage_retry_s={RETRY_S}",
            "--ray.max_failures=3", "--address", ray_address]
    try:
        code, out = run_watching(args, proxy_env(fault_proxy), on_step, timeout_s=600)
    finally:
        fault_proxy.clear()
    assert code == 0, out[-6000:]
    assert denied and denied["rule"].hits > 0, "the store never answered 403"
    assert "Traceback" not in out and "RayTaskError" not in out, out[-8000:]
    run_dir = s3_dataset.run_root / "denied-25s"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished"
    meta = json.loads(storage.read_text(f"{record['checkpoint']}/meta.json"))
    assert meta["counters"]["step"] == STEPS
    logged = logged_losses(s3_dataset.run_root, record["mlflow_run_id"])
    clean = clean_losses(record, s3_dataset.dataset, STEPS)
    assert sorted(logged) == sorted(clean)
    assert list(logged.values()) == pytest.approx([clean[s] for s in logged], rel=1e-5, abs=1e-6)
