"""The cross-entropy Numba kernel under the CUDA simulator, compared with the torch reference (awkward tiny shapes).

    .venv/bin/python -m pytest tests/cuda_ops/test_cross_entropy_cudasim.py -q      (~15 s)

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, and other test modules may already have imported
it in this process, so the cases (tests/cuda_ops/cudasim_cross_entropy.py) run once in a subprocess, started in the
background by tests/cuda_ops/conftest.py; each case is then reported here as its own test.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.system  # docs/tests.md: over ~5 s (the simulator's run)

pytest.importorskip("numba")

SCRIPT = Path(__file__).with_name("cudasim_cross_entropy.py")
CASES = ["case_bf16_rounding_matches_torch", "case_end_to_end_bf16", "case_end_to_end_fp32",
         "case_rowwise_all_rows_ignored", "case_rowwise_awkward", "case_rowwise_bf16_storage",
         "case_rowwise_fp16_storage", "case_rowwise_two_read_kernel", "case_rowwise_vocab_smaller_than_block",
         "case_rowwise_without_grad_leaves_logits", "case_rowwise_z_loss",
         "case_staged_and_two_read_kernels_agree_bit_for_bit"]


@pytest.fixture(scope="module")
def report(cudasim_runs) -> dict[str, str]:
    out = cudasim_runs.result(SCRIPT)  # started in the background by tests/cuda_ops/conftest.py
    assert out.returncode == 0, f"simulator run crashed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_case_ran(report):
    assert sorted(report) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_under_simulator(report, case):
    result = report.get(case, "missing from the simulator run")
    assert result == "ok", result


def test_the_staged_row_kernel_holds_the_row_in_registers_on_sm90(cudasim_runs):
    """tests/cuda_ops/ptx_decoder_kernels.py: a 32,000-logit bf16 row's 16 words a thread stay out of local memory."""
    out = cudasim_runs.result(Path(__file__).with_name("ptx_decoder_kernels.py"))
    assert out.returncode == 0, f"ptx_decoder_kernels.py crashed:\n{out.stdout}\n{out.stderr}"
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    if "skipped" in rep:
        pytest.skip(rep["skipped"])
    assert rep["cross_entropy_staged"] == "ok", rep["cross_entropy_staged"]
