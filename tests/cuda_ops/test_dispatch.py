"""Backend dispatch: automatic choice, LONGTRAIN_KERNELS forcing, and the clear error when numba cannot run.

    .venv/bin/python -m pytest tests/cuda_ops/test_dispatch.py -q
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_ops import dispatch
from cuda_ops.cross_entropy import linear_cross_entropy
from cuda_ops.dispatch import KernelBackendError, resolve_backend

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def numba_usable(monkeypatch):
    """Pretend numba-cuda works (or not) without touching a driver."""
    def set_status(ok: bool):
        monkeypatch.setattr(dispatch, "numba_cuda_status", lambda: (ok, "no CUDA driver (test)"))
    return set_status


def test_auto_on_cpu_is_reference(monkeypatch):
    monkeypatch.delenv("LONGTRAIN_KERNELS", raising=False)
    assert resolve_backend("cpu") == "reference"
    assert resolve_backend(torch.device("cpu"), "auto") == "reference"


def test_auto_on_cuda_follows_numba_availability(monkeypatch, numba_usable):
    monkeypatch.delenv("LONGTRAIN_KERNELS", raising=False)
    numba_usable(True)
    assert resolve_backend("cuda:0") == "numba"
    numba_usable(False)
    assert resolve_backend("cuda:0") == "reference"


def test_env_forces_reference_even_where_numba_works(monkeypatch, numba_usable):
    numba_usable(True)
    monkeypatch.setenv("LONGTRAIN_KERNELS", "reference")
    assert resolve_backend("cuda") == "reference"


def test_env_numba_on_cpu_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("LONGTRAIN_KERNELS", "numba")
    with pytest.raises(KernelBackendError, match=r"LONGTRAIN_KERNELS.*cpu.*CUDA tensors"):
        resolve_backend("cpu")


def test_env_numba_without_driver_names_the_reason(monkeypatch, numba_usable):
    numba_usable(False)
    monkeypatch.setenv("LONGTRAIN_KERNELS", "numba")
    with pytest.raises(KernelBackendError, match="no CUDA driver"):
        resolve_backend("cuda")


def test_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("LONGTRAIN_KERNELS", "numba")
    assert resolve_backend("cpu", "reference") == "reference"
    monkeypatch.setenv("LONGTRAIN_KERNELS", "reference")
    with pytest.raises(KernelBackendError, match="backend argument"):
        resolve_backend("cpu", "numba")


def test_unknown_values_list_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("LONGTRAIN_KERNELS", "triton")
    with pytest.raises(KernelBackendError, match="auto, reference, numba"):
        resolve_backend("cpu")
    monkeypatch.delenv("LONGTRAIN_KERNELS")
    with pytest.raises(KernelBackendError, match="'cuBLAS'"):
        resolve_backend("cpu", "cuBLAS")


def test_linear_cross_entropy_honours_forcing(monkeypatch):
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    monkeypatch.setenv("LONGTRAIN_KERNELS", "numba")
    with pytest.raises(KernelBackendError, match="LONGTRAIN_KERNELS"):
        linear_cross_entropy(h, w, t)
    monkeypatch.setenv("LONGTRAIN_KERNELS", "reference")
    assert torch.isfinite(linear_cross_entropy(h, w, t).loss_sum)


def test_importing_cuda_ops_does_not_import_numba():
    code = ("import sys, cuda_ops.cross_entropy, cuda_ops.dispatch; "
            "loaded = [m for m in sys.modules if m == 'numba' or m.startswith('numba.')]; "
            "assert not loaded, loaded")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_every_family_names_its_backend_and_why(monkeypatch):
    """What a run prints and tags once (pipeline/train/engine.py announce_kernels): CPU tensors take the reference
    path and say why; a GPU whose numba-cuda finds no NVVM says so and names the fix (the gpu extra), instead of
    quietly training on fp32 matmuls; a forced backend says who forced it."""
    from cuda_ops import dispatch

    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    cpu = dispatch.kernel_backends("cpu")
    assert set(cpu) == set(dispatch.KERNEL_FAMILIES)
    assert {b for b, _ in cpu.values()} == {"reference"} and "need CUDA tensors" in cpu["cross_entropy"][1]
    assert dispatch.describe_backends("cpu").startswith("cross_entropy, sampling, resonance_scan, moe_dispatch: reference (")

    monkeypatch.setattr(dispatch, "numba_cuda_status", lambda: (False, "numba-cuda finds no usable CUDA driver/NVVM"))
    line = dispatch.describe_backends("cuda")
    assert line.startswith("cross_entropy, sampling, resonance_scan, moe_dispatch: reference (numba-cuda finds no usable CUDA")
    assert "pip install -e '.[gpu]'" in line

    monkeypatch.setattr(dispatch, "numba_cuda_status", lambda: (True, "numba-cuda sees a CUDA device"))
    assert dispatch.describe_backends("cuda") == "cross_entropy, sampling, resonance_scan, moe_dispatch: numba (Numba-CUDA kernels)"
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.kernel_backends("cuda")["sampling"] == (
        "reference", f"forced by environment variable {dispatch.ENV_VAR}=reference")
    monkeypatch.setenv(dispatch.ENV_VAR, "numba")
    backend, why = dispatch.kernel_backends("cpu")["cross_entropy"]
    assert backend == "unavailable" and "need CUDA" in why
