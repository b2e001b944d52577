"""Joining or starting Ray ends in one line when it cannot: `--ray.address` naming a place where no Ray runs, and a
local Ray that a busy machine does not start within Ray's wait (pipeline/ray_runtime.py).

The busy machine is made for real, in the GCS itself: Ray's own fault-injection setting RAY_testing_asio_delay_us
holds the GCS's answer to the new node's registration, which is what an overloaded GCS does; a CPU hog would make the
test's outcome depend on the machine."""
from __future__ import annotations

import pytest
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

pytestmark = pytest.mark.system  # docs/tests.md: the system tier

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, str(ROOT / "pipeline" / "run.py")]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_no_ray_runs_ends_with_one_line_naming_it(tmp_path):
    port = _free_port()  # nothing listens there
    started = time.monotonic()
    res = subprocess.run([*RUN, "train", "--preset", "test", f"--ray.address=127.0.0.1:{port}",
                          f"--run.root={tmp_path}", "--tracking.enabled=false"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT, env=_env())
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr and "Failed to connect to GCS" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no Ray cluster answers at 127.0.0.1:{port} "), res.stderr
    assert f"ray start --head --port={port}" in last
    print(f"one line after {time.monotonic() - started:.1f} s")  # Ray's own retries went on for minutes


def test_a_local_ray_the_machine_cannot_start_in_time_says_it_is_overloaded(tmp_path):
    """The node's registration held for 10 minutes: Ray's fixed 30 s wait, then LONGTRAIN_RAY_START_WAIT_S (40 s
    here), then one line saying the machine is overloaded and how to give Ray more time. Also under --no-ray: its
    prepare starts Ray Data."""
    env = _env(RAY_testing_asio_delay_us="NodeInfoGcsService.grpc_server.RegisterNode=600000000:600000000",
               LONGTRAIN_RAY_START_WAIT_S="40")
    res = subprocess.run([*RUN, "train", "--no-ray", "--preset", "test", f"--run.root={tmp_path}",
                          "--tracking.enabled=false"], capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr, res.stdout + res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the local Ray did not start within 40 s: this machine is overloaded"), res.stderr
    assert "LONGTRAIN_RAY_START_WAIT_S=300" in last
