"""The decoder benchmarks run end to end at tiny size (--smoke) and write the JSON they promise.

    .venv/bin/python -m pytest tests/cuda_ops/test_bench_smoke.py -q      (~20 s on 2 cores)

Only structure and sanity are asserted (keys, shapes, positive figures); timings are never assertions.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, out_dir: Path, name: str | None = None) -> dict:
    """Run bench/<script> --smoke; `name`: the result's benchmark name when it is not the script's."""
    name = name or script[:-3]
    env = {k: v for k, v in os.environ.items() if k != "LONGTRAIN_KERNELS"}
    # Run as the docs say (`python bench/NAME.py`) from outside the repo: the script must find its own imports.
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--smoke", "--out", str(out_dir)],
                          cwd=out_dir, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = list(out_dir.glob(f"{name}-*.json"))
    assert len(files) == 1, files
    record = json.loads(files[0].read_text())
    assert record["benchmark"] == name and record["smoke"] is True
    assert {"date", "commit", "device"} <= record.keys()
    assert "ratio" in proc.stdout
    record["_stdout"] = proc.stdout  # the printed tables, for the tests that check them
    return record


@pytest.mark.system
def test_decoder_memory_smoke(tmp_path):
    rec = run_bench("decoder_memory.py", tmp_path)
    assert rec["shapes"] == {"tokens": 64, "hidden": 32, "vocab": 500, "dtype": rec["shapes"]["dtype"]}
    assert rec["full_logits_peak_bytes"] > rec["grads_bytes"] > 0
    assert [r["chunk_size"] for r in rec["chunked"]] == [16, 64]
    for row in rec["chunked"]:
        # the grads alone are allocated by both methods, so every honest peak is at least their size
        assert row["peak_bytes"] >= rec["grads_bytes"]
        assert row["ratio_to_full"] == row["peak_bytes"] / rec["full_logits_peak_bytes"]
    # the 64 x 500 fp32 logits alone (128 KB) exceed a 16-row chunk's buffer: the smaller chunk must use less
    assert rec["chunked"][0]["peak_bytes"] < rec["chunked"][1]["peak_bytes"] <= rec["full_logits_peak_bytes"]


@pytest.mark.system
def test_decoder_smoke(tmp_path):
    rec = run_bench("decoder_kernels.py", tmp_path.resolve(), name="decoder")
    assert rec["settings"]["compile_backend"] == "eager"
    shapes = [(r["shape"]["tokens"], r["shape"]["hidden"]) for r in rec["cross_entropy"]]
    assert shapes == [(64, 32), (96, 32)]
    for row in rec["cross_entropy"]:
        assert set(row["methods"]) == {"eager", "compiled", "fused", "chunked"}
        for m in row["methods"].values():
            assert m["median_ms"] > 0 and m["first_call_ms"] > 0 and m["peak_bytes"] > 0
        assert {"eager_time_over_fused", "compiled_time_over_fused", "eager_peak_over_fused"} <= row["ratios"].keys()
    assert [(s["shape"]["batch"], s["shape"]["vocab"]) for s in rec["sampling"]] == [(1, 500), (4, 500)]
    for samp in rec["sampling"]:
        assert set(samp["methods"]) == {"sampler", "sampler_kernels", "torch_sort"}
        assert samp["ratios"]["torch_sort_time_over_sampler"] > 0
        assert samp["bytes_one_read"] == samp["shape"]["batch"] * 500 * 4
        assert samp["bytes_at_most"] >= samp["bytes_one_read"] and samp["profile"] == []  # profiles: CUDA only
    # the bytes-moved model: one row per kernel, figures derived from the model and the measured time
    names = [k["kernel"] for k in rec["kernels"]]
    assert names == (["fused CE fwd+bwd", "CE row (float32, two reads)"] * 2
                     + ["sampler kernels (top-p)", "sampler, every launch"] * 2)
    for k in rec["kernels"]:
        assert k["bytes"] > 0 and k["median_ms"] > 0
        assert k["gb_per_s"] == pytest.approx(k["bytes"] / (k["median_ms"] * 1e-3) / 1e9)
        assert k["ms_at_3tbps"] == pytest.approx(k["bytes"] / 3e12 * 1e3)
    t = rec["cross_entropy"][0]["traffic"]  # 64 tokens x 32 hidden x 500 vocab, fp32 on CPU, 32-row chunks
    assert (t["chunks"], t["rows_per_chunk"]) == (2, 32)
    assert t["rowwise_kernel"]["bytes"] == 3 * 64 * 500 * 4 + 64 * 16
    assert t["logits_matmul"]["flops"] == 2 * 64 * 500 * 32
    assert "bytes moved per kernel" in rec["_stdout"]


@pytest.mark.system
def test_decode_profile_and_step_counts_smoke(tmp_path):
    """bench/decode_profile.py (on CPU: eager steps under the profiler's CPU activity) and
    bench/decode_step_counts.py (with a speed round of this checkout) at their smallest."""
    env = {k: v for k, v in os.environ.items() if k != "LONGTRAIN_KERNELS"}
    for script, extra in (("decode_profile.py", []), ("decode_step_counts.py", ["--speed", "--repeat", "1"])):
        proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--smoke", "--out", str(tmp_path), *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    prof = json.loads(next(tmp_path.glob("decode_profile-*.json")).read_text())
    assert [(r["batch"], r["attention"]) for r in prof["rows"]] == [(1, "fused"), (2, "fused")]
    assert all(r["step_ms"] > 0 and r["kernels_per_step"] > 0 and r["bytes_model"]["total"] > 0 for r in prof["rows"])
    counts = json.loads(next(tmp_path.glob("decode_step_counts_nano-*.json")).read_text())
    fused = [s for s in counts["summary"] if s["attention"] == "fused"]
    assert {s["part"] for s in fused} == {"model_compiled", "model_eager", "sampler_emit"}
    assert not any(s["grows_with_cache_len"] for s in fused) and all(s["syncs"] == [0] for s in fused)
    assert set(counts["speed"]["median_tokens_per_s"]["this"]) == {"short_b1", "long300_b1", "short_b2", "long300_b2"}
