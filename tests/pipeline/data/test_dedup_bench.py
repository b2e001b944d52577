"""bench/dedup_speed.py and bench/dedup_profile.py run end to end on a tiny planted corpus and write their JSON (the
figures themselves are the benchmarks' business, not the tests')."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.system
def test_the_dedup_speed_bench_runs_and_records_every_mode(ray_session, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    proc = subprocess.run([sys.executable, "bench/dedup_speed.py", "--mb", "1", "--mb", "2", "--repeat", "1",
                           "--warmup-mb", "0.5", "--smoke", "--work", str(tmp_path / "work"), "--out-dir",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("dedup_speed_smoke-*.json")).read_text())
    small, big = result["sizes"]
    assert [r["mode"] for r in big["runs"]] == ["none", "exact", "near"]
    near = big["runs"][2]
    assert near["dedup_stages"]["signatures_s"] > 0 and "MapBatches(_signature_rows)" in near["ray_data"][
        "Ray Data, the signatures"]
    assert big["stage"]["record"]["removed_exact"] > 0 and big["stage"]["record"]["removed_near"] > 0
    assert big["quality"]["longtrain"]["recall_above_0.85"] > 0.9
    assert big["encode_limit"]["mb_per_s"] > 0 and len(big["encode_limit"]["runs"]) == 2
    assert result["marginal_prepare_mb_per_s"] != 0
    # the session's Ray is not this bench's child: only the driver's CPU is counted, too little to tell the sizes
    # apart, and the efficiency is None rather than a division by zero (CI, 2026-12-01)
    assert "marginal_cpu_efficiency" in result


@pytest.mark.system
def test_the_dedup_profile_bench_times_every_step(tmp_path):
    proc = subprocess.run([sys.executable, "bench/dedup_profile.py", "--mb", "1", "--work", str(tmp_path / "work"),
                           "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("dedup_profile_1mb-*.json")).read_text())
    steps = result["steps"]
    assert {"read .jsonl", "SentencePiece encode", "components + removal (one task)"} <= set(steps)
    assert all(s["cpu_s"] >= 0 for s in steps.values()) and result["removed"] > 0
