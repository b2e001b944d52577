"""The resonance scan's Numba kernels on a real GPU at tier B's shape (32,768 tokens x 6 groups x 64 eigenvalues),
against the torch reference in fp64, forward and backward, with and without document resets.

    .venv/bin/python -m pytest tests/cuda_ops/test_resonance_scan_gpu.py -q -m gpu

Skipped without CUDA. Tolerances: the kernel keeps an fp32 state, so each step adds fp32 rounding, which the
decays (here |lambda| = exp(-(1e-3 .. 5e-2)), a memory of up to ~1,000 tokens) sum to about 1e-5 relative; in
bf16 the inputs are the same bf16 numbers for both sides and the outputs are rounded once (2^-8 relative).
"""
from __future__ import annotations

import pytest
import torch

import cuda_ops.resonance_scan as rs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

B, T, G, K = 1, 32768, 6, 64


def make(dtype: torch.dtype, docs: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(B, T, G, K, 2, device="cuda", generator=g).to(dtype)
    gs = torch.randn(B, T, G, K, 2, device="cuda", generator=g).to(dtype)
    decay = torch.rand(G, K, device="cuda", generator=g) * 0.049 + 1e-3
    log_lam = torch.stack([-decay, torch.randn(G, K, device="cuda", generator=g)], dim=-1)
    starts = None
    if docs:  # web-like documents: a start every 1..800 tokens
        gaps = torch.randint(1, 800, (T,), device="cuda", generator=g).cumsum(0)
        starts = torch.zeros(B, T, dtype=torch.bool, device="cuda")
        starts[0, gaps[gaps < T]] = True
    return z, log_lam, gs, starts


def run(backend, z, log_lam, gs, starts, **kw):
    zz, ll = z.clone().requires_grad_(), log_lam.clone().requires_grad_()
    s, last = rs.resonance_scan(zz, ll, starts, backend=backend, **kw)
    (s.double() * gs.double()).sum().backward()
    return s.detach(), last, zz.grad, ll.grad


def rel(got, want) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def test_warmup_compiles_and_reports_seconds():
    assert rs.warmup() > 0


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("dtype, tol, tol_dlam", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 2 ** -7, 1e-2)])
def test_kernel_matches_the_fp64_reference_at_tier_b_shape(dtype, tol, tol_dlam, docs):
    z, log_lam, gs, starts = make(dtype, docs)
    s, last, dz, dlam = run("numba", z, log_lam, gs, starts)
    r = run("reference", z.double(), log_lam.double(), gs, starts)  # the same (bf16-rounded) numbers, in fp64
    assert s.dtype == dz.dtype == dtype and last.dtype == torch.float32
    assert rel(s, r[0]) < tol and rel(last, r[1]) < tol and rel(dz, r[2]) < tol
    assert rel(dlam, r[3]) < tol_dlam


def test_every_plan_gives_the_same_numbers():
    """One chunk (a single pass), the device's plan, and short chunks: the same scan up to fp32 rounding."""
    z, log_lam, gs, starts = make(torch.float32, True, seed=1)
    base = run("numba", z, log_lam, gs, starts, kernel_chunk=T)
    for chunk in (None, 16, 1000):
        other = run("numba", z, log_lam, gs, starts, kernel_chunk=chunk)
        for a, b in zip(other, base):
            assert rel(a, b) < 1e-5, chunk


def test_forward_backward_never_syncs_the_host():
    z, log_lam, gs, starts = make(torch.bfloat16, True, seed=2)
    run("numba", z, log_lam, gs, starts)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any torch-side device->host sync now raises
    try:
        zz, ll = z.clone().requires_grad_(), log_lam.clone().requires_grad_()
        s, _ = rs.resonance_scan(zz, ll, starts, backend="numba")
        (s.float() * gs.float()).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(zz.grad.float()).all() and torch.isfinite(ll.grad).all()


def test_launches_on_torchs_current_stream():
    z, log_lam, _, starts = make(torch.bfloat16, True, seed=3)
    with torch.no_grad():
        expected = rs.resonance_scan(z, log_lam, starts, backend="numba")[0]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = rs.resonance_scan(z, log_lam, starts, backend="numba")[0]
        torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, expected)
