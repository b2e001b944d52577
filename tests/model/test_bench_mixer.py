"""bench/mixer.py at its --smoke size on CPU: both families measured at every length, the scan kernel's
bytes-moved model and the saved-for-backward bytes, the JSON it promises. Only structure and sanity are asserted;
timings never are."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.system
def test_mixer_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "mixer.py"), "--smoke", "--out", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = list(tmp_path.glob("mixer-*.json"))
    assert len(files) == 1, files
    rec = json.loads(files[0].read_text())
    assert rec["benchmark"] == "mixer" and rec["smoke"] is True and {"date", "commit", "device", "load"} <= rec.keys()
    assert [(r["seq_len"], r["mixer"]) for r in rec["rows"]] == [
        (64, "attention"), (64, "resonance"), (128, "attention"), (128, "resonance")]
    for row in rec["rows"]:
        assert row["status"] == "ok" and row["params"] > 0
        for key in ("train_tokens_per_s", "train_peak_gib", "decode_tokens_per_s", "gen_peak_gib"):
            assert row[key] > 0, (row, key)
    assert [r["seq_len"] for r in rec["ratios"]] == [64, 128]
    assert "ratio resonance/attention at 128" in proc.stdout
    model = rec["kernel_model"]  # tier B on the H100's launch plan: 7 passes over a bf16 (T, 6, 64) tensor a layer
    assert model["tier"] == "B" and [r["seq_len"] for r in model["rows"]] == [8192, 32768, 131072, 262144]
    at_32k = model["rows"][1]
    assert at_32k["chunk"] * at_32k["n_chunks"] == 32768 and len(at_32k["passes"]) == 6
    assert 7 * 32768 * 384 * 4 <= at_32k["layer_bytes"] < 8 * 32768 * 384 * 4
    assert "fwd apply  read" in proc.stdout and "ms per step" in proc.stdout
    saved = rec["saved_bytes_per_token_layer"]
    assert saved["attention"] > 0 and 0 < saved["resonance fft"] < saved["resonance fft, plain autograd"]
    assert "its autograd Function / plain autograd" in proc.stdout
