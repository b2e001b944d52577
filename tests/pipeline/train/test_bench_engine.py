"""The engine benchmarks (and the Ray Train overhead one) run end to end at a tiny size on CPU and write
well-formed results."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def run_bench(script: str, out: Path, *extra: str, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(out.glob(f"{script[:-3]}*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


@pytest.mark.system  # docs/tests.md: over ~5 s (8.3 s in the quick tier on 2 idle cores)
def test_engine_throughput_smoke(tmp_path):
    res = run_bench("engine_throughput.py", tmp_path, "--profile", str(tmp_path / "prof"))
    row = res["rows"][0]
    assert res["device"]["device"] == "cpu" and res["commit"]
    assert row["tier"] == "nano" and row["seq_len"] == 64 and row["batch_size"] == 2
    assert row["tokens_per_s"] > 0 and 0 <= row["data_wait_frac"] < 1
    assert row["params"] > 0 and row["flops_per_token"] > 0
    assert list((tmp_path / "prof").glob("trace-*.json"))


@pytest.mark.system  # docs/tests.md: over ~5 s (6.8 s in the quick tier on 2 idle cores)
def test_train_speed_smoke(tmp_path):
    res = run_bench("train_speed.py", tmp_path)
    # two document-length distributions by default (web, and short documents at the smoke's 64 tokens)
    assert [(r["doc_len"], r["batch_size"]) for r in res["rows"]] == [("web", 1), ("web", 2), ("16", 1), ("16", 2)]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in res["rows"])
    assert "| tier | seq_len |" in res["markdown"]
    assert list(tmp_path.glob("train_speed-*.md"))


@pytest.mark.system
def test_ray_overhead_smoke(tmp_path, ray_address):
    """Both paths train the same steps; the ratio is theirs (no figure is asserted: timings are not tests).
    The bench joins the session's Ray (RAY_ADDRESS, as inside `ray job submit`) rather than starting one."""
    import os

    res = run_bench("ray_overhead.py", tmp_path, "--cpus-per-worker", "2", env={**os.environ, "RAY_ADDRESS": ray_address})
    assert res["benchmark"] == "ray_overhead_nano_s32_b2"
    assert res["samples"]["local"] == res["samples"]["ray"] == 6  # steps 1..8: the intervals from step 2 on
    assert res["ratio"] == pytest.approx(res["median_step_s"]["ray"] / res["median_step_s"]["local"])
    assert res["torch_threads"] == 2  # both sides on the worker's CPUs


@pytest.mark.system  # docs/tests.md: over ~5 s (7.5 s in the quick tier on 2 idle cores)
def test_fsdp_bench_smoke(tmp_path):
    """The unsharded engine and FSDP on a one-worker group, side by side, with the memory model's prediction."""
    res = run_bench("fsdp.py", tmp_path)
    assert [(r["parallel"], r["status"]) for r in res["rows"]] == [("none", "ok"), ("fsdp", "ok")]
    assert all(r["tokens_per_s"] > 0 and r["predicted_peak_gib"] > 0 for r in res["rows"])
    assert res["rows"][1]["activation_checkpointing"] == "all" and set(res["fsdp_over_unsharded_tokens_per_s"]) == {"nano:2"}
