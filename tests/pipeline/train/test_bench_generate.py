"""bench/generate.py runs end to end at tiny size (--smoke) and writes the JSON it promises.

Only structure and sanity are asserted (keys, counts, positive figures); timings are never assertions.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_smoke(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LONGTRAIN_KERNELS"}
    # run as documented (`python bench/generate.py`) from outside the repo: the script finds its own imports
    return subprocess.run([sys.executable, str(REPO / "bench" / "generate.py"), "--smoke", "--out", str(tmp_path),
                           *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_generate_bench_smoke(tmp_path):
    proc = run_smoke(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = list(tmp_path.glob("generate_nano_t*-*.json"))
    assert len(files) == 1, files
    rec = json.loads(files[0].read_text())
    assert rec["smoke"] is True and {"date", "commit", "device", "load_average_before"} <= rec.keys()
    assert rec["shapes"]["batch_sizes"] == [1, 2] and rec["shapes"]["new_tokens"] == 6
    assert [(r["batch"], r["sampler"]) for r in rec["rows"]] == [(1, "kernels"), (1, "reference"),
                                                                (2, "kernels"), (2, "reference")]
    for row in rec["rows"]:
        assert row["decode_tokens"] == row["batch"] * (6 - 2)  # the first token and one warm-up step apart
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
        assert row["sampler_backend"] == "reference" and row["cuda_graph"] is False  # CPU
    assert "ratio kernels / reference" in proc.stdout


def test_generate_bench_takes_prompt_lengths_and_the_resonance_family(tmp_path):
    proc = run_smoke(tmp_path, "--mixer", "resonance", "--prompt-len", "4", "40", "--batch-sizes", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads(next(tmp_path.glob("generate_resonance_nano_t*-*.json")).read_text())
    assert rec["shapes"]["mixer"] == "resonance" and rec["shapes"]["prompt_lens"] == [4, 40]
    assert [(r["prompt_len"], r["batch"], r["sampler"]) for r in rec["rows"]] == [
        (4, 1, "kernels"), (4, 1, "reference"), (40, 1, "kernels"), (40, 1, "reference")]
    for row in rec["rows"]:
        assert row["decode_tokens"] == 6 - 2 and row["decode_tokens_per_s"] > 0
        assert row["prefill_tokens_per_s"] > 0 and row["compiled"] is False


def test_a_run_stopped_midway_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """The JSON is rewritten after every row, so a run stopped at bench/gpu_check.py's cap (SIGINT there: a
    KeyboardInterrupt here, after two rows) leaves those rows, marked "complete": false; a whole run says true."""
    from bench import generate as bench_generate

    real, calls = bench_generate.measure, []

    def measure_twice(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_generate, "measure", measure_twice)
    with pytest.raises(KeyboardInterrupt):
        bench_generate.main(["--smoke", "--batch-sizes", "1", "--prompt-len", "4", "8", "--out", str(tmp_path)])
    rec = json.loads(next(tmp_path.glob("generate_nano_t*-*.json")).read_text())
    assert rec["complete"] is False
    assert [(r["prompt_len"], r["sampler"]) for r in rec["rows"]] == [(4, "kernels"), (4, "reference")]
    assert not list(tmp_path.glob(".tmp-*"))  # written atomically: no temporary file left behind
    monkeypatch.undo()  # the real measure again
    assert bench_generate.main(["--smoke", "--batch-sizes", "1", "--out", str(tmp_path)]) == 0
    assert json.loads(next(tmp_path.glob("generate_nano_t*-*.json")).read_text())["complete"] is True
