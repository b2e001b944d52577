"""bench/mixer.py at its --smoke size on CPU: both families measured at every length, the JSON it promises.
Only structure and sanity are asserted; timings never are."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
