"""The MoE dispatch Numba kernels (count, prefix-sum, scatter, weighted combine and their backward) under the CUDA
simulator, against the torch reference.

    .venv/bin/python -m pytest tests/cuda_ops/test_moe_dispatch_cudasim.py -q      (~20 CPU-s under the simulator)

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, so the cases run in a subprocess
(tests/cuda_ops/cudasim_moe_dispatch.py, started in the background by tests/cuda_ops/conftest.py); each case is one
test here.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cuda_ops import cudasim_moe_dispatch

pytestmark = pytest.mark.system  # docs/tests.md: over ~5 s (the simulator's run)

pytest.importorskip("numba")

SCRIPT = Path(__file__).with_name("cudasim_moe_dispatch.py")
CASES = sorted(name for name in vars(cudasim_moe_dispatch) if name.startswith("case_"))


@pytest.fixture(scope="module")
def report(cudasim_runs) -> dict[str, str]:
    out = cudasim_runs.result(SCRIPT)
    assert out.returncode == 0, f"simulator run crashed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_case_ran(report):
    assert sorted(report) == CASES and len(CASES) >= 7


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference(report, case):
    assert report[case] == "ok", report[case]
