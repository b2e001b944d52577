"""bench/expert_exchange.py runs end to end on 2 gloo ranks and writes its JSON; the bytes the exchange sends equal
what the router's counts say it must (rows for experts on the other rank, four crossings each, and the counts):
nothing else crosses. The figures against the even-spread model are the benchmark's business."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.system
def test_the_exchange_sends_exactly_the_routed_rows(tmp_path):
    proc = subprocess.run([sys.executable, "bench/expert_exchange.py", "--smoke", "--out-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("expert_exchange_smoke-*.json")
    one, two = json.loads(path.read_text())["rows"]
    assert one["degree"] == 1 and sum(one["bytes_measured_per_rank"]) == 0
    assert two["degree"] == 2 and min(two["bytes_measured_per_rank"]) > 0
    assert two["measured_over_router"] == pytest.approx(1.0, rel=1e-12)
    assert 0.5 < two["measured_over_even"] < 1.5
