"""The resonance scan's Numba kernels under the CUDA simulator against the fp64 definition and the FFT form, and
compiled to sm_90 PTX by the real compiler (where NVVM is installed).

    .venv/bin/python -m pytest tests/cuda_ops/test_resonance_scan_cudasim.py -q      (~5 s)

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, and other test modules may already have imported
it in this process, so the cases (tests/cuda_ops/cudasim_resonance_scan.py, tests/cuda_ops/ptx_resonance_scan.py)
run once each in a subprocess, started in the background by tests/cuda_ops/conftest.py; each case is then reported
here as its own test.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("numba")

HERE = Path(__file__).resolve().parent
CASES = ["case_a_row_split_over_ranks_scans_as_the_whole_row", "case_bf16_io_is_the_fp32_kernel_rounded_once", "case_fp32_forward_backward_match_the_fp64_definition",
         "case_initial_state_continues_a_row", "case_nan_stays_nan_in_bf16", "case_one_document_matches_the_fft_form",
         "case_strided_views_read_like_contiguous_tensors"]
KERNELS = [f"{io} {name}" for io in ("f32", "bf16")
           for name in ("fwd_reduce", "fwd_carry", "fwd_apply", "bwd_reduce", "bwd_carry", "bwd_apply")]


def _report(runs, script: str) -> dict[str, str]:
    out = runs.result(HERE / script)  # started in the background by tests/cuda_ops/conftest.py
    assert out.returncode == 0, f"{script} crashed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(cudasim_runs) -> dict[str, str]:
    return _report(cudasim_runs, "cudasim_resonance_scan.py")


@pytest.fixture(scope="module")
def ptx_report(cudasim_runs) -> dict[str, str]:
    rep = _report(cudasim_runs, "ptx_resonance_scan.py")
    if "skipped" in rep:
        pytest.skip(rep["skipped"])
    return rep


def test_every_case_ran(report):
    assert sorted(report) == CASES


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_definition_under_simulator(report, case):
    result = report.get(case, "missing from the simulator run")
    assert result == "ok", result


def test_every_kernel_compiles_for_sm90_without_spilling(ptx_report):
    failed = {k: v for k, v in ptx_report.items() if v != "ok"}
    assert sorted(ptx_report) == sorted(KERNELS) and not failed, failed
