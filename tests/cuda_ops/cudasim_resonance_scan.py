"""The resonance scan's Numba kernels under the CUDA simulator, against the fp64 definition and the FFT form.

Run by tests/cuda_ops/test_resonance_scan_cudasim.py in a subprocess (NUMBA_ENABLE_CUDASIM=1 must be set before
numba is imported). By hand:

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python tests/cuda_ops/cudasim_resonance_scan.py

Prints one JSON object {case name: "ok" | traceback}. The simulator runs each GPU thread as a Python thread, so the
shapes are tiny (2 rows x 13 tokens x 2 groups x 3 eigenvalues) and the block is lowered to 32 threads; chunks of
1, 4, 5 and 13 tokens give many chunks, a partial last chunk, and the single-pass path (one chunk).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    sys.exit("set NUMBA_ENABLE_CUDASIM=1 before running this file (numba reads it at import)")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from case_runner import report_cases  # noqa: E402  (this script's folder is on sys.path)

import cuda_ops.resonance_scan as rs  # noqa: E402
from model.resonance import fft_conv  # noqa: E402

rs.BLOCK = 32
B, T, G, K = 2, 13, 2, 3
CHUNKS = (4, 5, 13, 1)


def inputs(seed=0, dtype=torch.float32):
    """z, log_lam, gs rounded to `dtype` (and kept in fp64 for the oracle), and starts: a start inside a chunk,
    two in a row (a one-token document), one on a chunk boundary (t = 8 with chunk 4), the last token, t = 0."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, G, K, 2, generator=g, dtype=torch.float64).to(dtype)
    gs = torch.randn(B, T, G, K, 2, generator=g, dtype=torch.float64).to(dtype)
    decay = torch.rand(G, K, generator=g, dtype=torch.float64) * 0.6 + 1e-5  # |lambda| from 0.55 to ~1
    angle = torch.randn(G, K, generator=g, dtype=torch.float64) * 2
    log_lam = torch.stack([-decay, angle], dim=-1).float()  # the model hands the kernel fp32 log lambda
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, [3, 4, 8, 12]] = True
    starts[1, 0] = True
    return z, log_lam, gs, starts


def oracle(z, log_lam, gs, starts, state0=None):
    """(s, last, dz, dlog_lam) from the definition, in fp64 autograd."""
    z64 = z.double().requires_grad_()
    ll64 = log_lam.double().requires_grad_()
    s, last = rs.sequential_scan(z64, ll64, starts, None if state0 is None else state0.double())
    (s * gs.double()).sum().backward()
    return s.detach(), last.detach(), z64.grad, ll64.grad


def kernel(z, log_lam, gs, starts, chunk, state0=None):
    """(s, last, dz, dlog_lam) from the Numba kernels (forced past dispatch: host tensors under the simulator)."""
    zk = z.clone().requires_grad_()
    lk = log_lam.clone().requires_grad_()
    s, last = rs._scan(zk, lk, starts, state0, "numba", rs.REFERENCE_CHUNK, chunk)
    (s.double() * gs.double()).sum().backward()
    return s.detach(), last, zk.grad, lk.grad


def close(got, want, tol, what):
    err = float((got.double() - want.double()).abs().max())
    scale = float(want.double().abs().max())
    assert err <= tol * max(scale, 1.0), f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def case_fp32_forward_backward_match_the_fp64_definition():
    z, log_lam, gs, starts = inputs()
    want = oracle(z, log_lam, gs, starts)
    for chunk in CHUNKS:
        got = kernel(z, log_lam, gs, starts, chunk)
        assert got[0].dtype == got[2].dtype == torch.float32 and got[1].dtype == torch.float32
        for name, a, b in zip(("s", "last", "dz", "dlog_lam"), got, want):
            close(a, b, 2e-6, f"chunk {chunk} {name}")


def case_one_document_matches_the_fft_form():
    z, log_lam, gs, _ = inputs(seed=1)
    zf = z.double().requires_grad_()
    lf = log_lam.double().requires_grad_()
    s_fft, last_fft = fft_conv(zf, lf)
    (s_fft * gs.double()).sum().backward()
    for chunk in (4, 13):
        s, last, dz, dll = kernel(z, log_lam, gs, None, chunk)
        for name, a, b in (("s", s, s_fft), ("last", last, last_fft), ("dz", dz, zf.grad), ("dlog", dll, lf.grad)):
            close(a, b.detach(), 2e-6, f"chunk {chunk} {name}")


def case_bf16_io_is_the_fp32_kernel_rounded_once():
    """Same bf16 inputs: the bf16 kernel's fp32 state equals the fp32 kernel's, so s and dz must be the fp32
    kernel's results rounded to bf16 by torch, bit for bit, and the final state identical. dlog_lam sums r conj(s)
    over the saved s, bf16-rounded here: within 2^-8 of the fp32 kernel's."""
    z, log_lam, gs, starts = inputs(seed=2, dtype=torch.bfloat16)
    for chunk in (4, 13):
        s16, last16, dz16, dl16 = kernel(z, log_lam, gs, starts, chunk)
        s32, last32, dz32, dl32 = kernel(z.float(), log_lam, gs.float(), starts, chunk)
        assert s16.dtype == dz16.dtype == torch.bfloat16 and last16.dtype == torch.float32
        assert torch.equal(s16, s32.to(torch.bfloat16)), "bf16 stores differ from torch's rounding"
        assert torch.equal(dz16, dz32.to(torch.bfloat16))
        assert torch.equal(last16, last32)
        close(dl16, dl32, 2 ** -8, "bf16 dlog_lam vs fp32")
        close(s16, oracle(z, log_lam, gs, starts)[0], 2 ** -8, "bf16 s vs the fp64 definition")


def case_initial_state_continues_a_row():
    z, log_lam, gs, starts = inputs(seed=3)
    whole = kernel(z, log_lam, gs, starts, 4)
    first = kernel(z[:, :6], log_lam, gs[:, :6], starts[:, :6], 4)
    for chunk in (4, 7):
        second = kernel(z[:, 6:], log_lam, gs[:, 6:], starts[:, 6:], chunk, state0=first[1])
        close(torch.cat([first[0], second[0]], dim=1), whole[0], 1e-6, f"chunk {chunk} s")
        close(second[1], whole[1], 1e-6, f"chunk {chunk} last")


def case_strided_views_read_like_contiguous_tensors():
    """z and the gradient as permuted views (what an einsum can hand over): the kernels take strided arrays."""
    z, log_lam, gs, starts = inputs(seed=4)
    z_t = z.permute(2, 0, 1, 3, 4).contiguous().permute(1, 2, 0, 3, 4)  # memory (G, B, T, K, 2)
    assert not z_t.is_contiguous() and torch.equal(z_t, z)
    for chunk in (5, 13):
        a, b = kernel(z_t, log_lam, gs, starts, chunk), kernel(z, log_lam, gs, starts, chunk)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def case_nan_stays_nan_in_bf16():
    z, log_lam, gs, _ = inputs(seed=5, dtype=torch.bfloat16)
    z[0, 2, 1, 1, 0] = float("nan")
    s = kernel(z, log_lam, gs, None, 13)[0]
    assert torch.isnan(s[0, 2, 1, 1, 0]) and torch.isnan(s[0, 3:, 1, 1]).all() and not torch.isinf(s).any()
    assert torch.isfinite(s[1]).all() and torch.isfinite(s[0, :2]).all()


def case_a_row_split_over_ranks_scans_as_the_whole_row():
    """Context parallelism on the kernels: the row's 12 tokens as 2, 3 and 4 contiguous slices (split_scan.py
    emulates the ranks' exchange), each slice in chunks of 1 to 6 tokens and as one chunk (pass 1 then runs only for
    the exchange), starts inside slices and on their first tokens: the whole row's s and gradients, within fp32."""
    from split_scan import split_scan

    z, log_lam, gs, starts = inputs(seed=6)
    z, gs, starts = z[:, :12], gs[:, :12], starts[:, :12].clone()
    starts[1, 6] = True  # a slice's first token at degrees 2 and 3
    want = oracle(z, log_lam, gs, starts)
    for degree, chunks in ((2, (4, 6)), (3, (1, 4)), (4, (2, 3))):
        for chunk in chunks:
            got = split_scan(lambda zr, ll, sr, carry: rs._scan(zr, ll, sr, None, "numba", rs.REFERENCE_CHUNK, chunk,
                                                                carry), z, log_lam, starts, gs, degree)
            for name, a, b in zip(("s", "dz", "dlog_lam"), got, (want[0], want[2], want[3])):
                close(a, b, 2e-6, f"degree {degree} chunk {chunk} {name}")


if __name__ == "__main__":
    report_cases(globals())
