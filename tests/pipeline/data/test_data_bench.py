"""bench/data_throughput.py --smoke runs end to end: both sides, identical shards, a JSON result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.system
def test_data_throughput_bench_smoke(ray_session, tmp_path):
    # The Ray children join this session's cluster (RAY_ADDRESS) instead of starting their own.
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    proc = subprocess.run([sys.executable, "bench/data_throughput.py", "--smoke", "--out-dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "speedup (Ray Data / single process, tokens/s)" in proc.stdout
    result = json.loads(next(tmp_path.glob("data_throughput_smoke-*.json")).read_text())
    assert result["identical_shards"] is True
    assert result["tokens"] > 100_000 and 0.99 < result["tokens_kept_fraction"] <= 1.0
    assert len(result["driver_peak_rss_mb"]) == 2 and result["speedup_ray_over_baseline"] > 0
    assert result["commit"] and result["device"]["cpu_count"] == os.cpu_count()
    row = result["scaling"][0]  # one row per --cpus N (here: every core)
    assert row["parallel_efficiency"] == pytest.approx(row["speedup"] / row["cores"])
    assert row["cpu_efficiency"] == pytest.approx(row["ray_cpu_seconds"] / result["baseline_cpu_seconds"])
    assert "driver" in row["cpu_by_process_kind"]  # (joined to the test session's Ray: its workers are not ours)
    assert len(row["load_1min"]) == 2


def test_the_bench_names_each_ray_process_by_what_it_is():
    sys.path.insert(0, str(REPO))
    from bench.data_throughput import process_kind

    ray_bin = "/venv/lib/python3.11/site-packages/ray/core/src/ray"
    worker = ["/venv/bin/python", "/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py",
              "--node-ip-address=127.0.0.1"]
    # The raylet's own arguments name default_worker.py (the command it starts workers with): still the raylet.
    raylet = [f"{ray_bin}/raylet/raylet", "--raylet_socket_name=/tmp/s",
              "--python_worker_command=/venv/bin/python /venv/lib/python3.11/site-packages/ray/_private/workers/"
              "default_worker.py --node-ip-address=127.0.0.1"]
    assert process_kind(raylet, "raylet") == "daemon:raylet"
    assert process_kind([f"{ray_bin}/gcs/gcs_server", "--gcs_server_port=6379"], "gcs_server") == "daemon:gcs_server"
    assert process_kind(worker, "python") == "worker-start"
    assert process_kind(["ray::MapWorker(MapBatches(_TokenizeBatch))"], "python") == "ray::MapWorker"
    assert process_kind(["ray::IDLE"], "python") == "ray::IDLE"
    assert process_kind(["/venv/bin/python", "-m", "ray.dashboard.dashboard", "--host=127.0.0.1"], "python") == \
        "daemon:dashboard"
