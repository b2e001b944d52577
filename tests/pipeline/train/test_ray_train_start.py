"""A Ray Train run whose workers cannot start ends with one clear reason after a bounded number of attempts
(Ray Train V2 retries a worker group that does not start forever by default)."""
from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.train.ray_train import START_TIMEOUT_ENV, TrainStartError, check_fits_cluster


def test_workers_that_ask_more_than_the_local_ray_has_fail_before_starting(ray_session):
    cfg = load_config("test", {"ray.num_workers": 3, "ray.cpus_per_worker": 4, "ray.use_gpu": "false"})
    with pytest.raises(TrainStartError, match=r"^Ray Train's 3 worker\(s\) with \{CPU 4\} each \(PACK\) can never "
                                              r"start: this Ray has 8 CPU in all; lower ray.num_workers"):
        check_fits_cluster(cfg)
    check_fits_cluster(cfg.replace({"ray.num_workers": 2}))  # 8 of 8: fits


@pytest.mark.system
def test_train_that_cannot_start_exits_nonzero_with_one_line(ray_session, test_runs_root, monkeypatch, capsys):
    """Two workers STRICT_SPREAD (one per node) on the one-node session Ray: each attempt waits 2 s, two
    attempts (ray.max_failures=1), then `error: ...` and exit code 2 instead of retrying without end."""
    from pipeline.run import main

    monkeypatch.setenv(START_TIMEOUT_ENV, "2")
    code = main(["train", "--preset", "test", f"--run.root={test_runs_root}", "--run.name=cannot-start",
                 "--ray.num_workers=2", "--ray.cpus_per_worker=1", "--ray.use_gpu=false",
                 "--ray.placement_strategy=STRICT_SPREAD", "--ray.max_failures=1", "--tracking.enabled=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    errors = [ln for ln in err if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == err[-1], err[-20:]
    assert errors[0].startswith("error: Ray Train's 2 worker(s) with {CPU 1} each (STRICT_SPREAD): their resources "
                                "did not come within 2 s, in 2 attempt(s) (ray.max_failures + 1); free now: CPU ")
    assert errors[0].endswith(f"or wait longer per attempt with {START_TIMEOUT_ENV}")
