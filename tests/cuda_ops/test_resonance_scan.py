"""cuda_ops/resonance_scan.py on CPU: the torch reference against the fp64 definition (values and gradients), the
launch plan and bytes-moved model, dispatch, and the one-line errors. The kernels themselves run under the
simulator (test_resonance_scan_cudasim.py) and on a GPU (test_resonance_scan_gpu.py).

    .venv/bin/python -m pytest tests/cuda_ops/test_resonance_scan.py -q
"""
from __future__ import annotations

import pytest
import torch

import cuda_ops.resonance_scan as rs
from cuda_ops.dispatch import KernelBackendError

H100 = dict(sm_count=132, threads_per_sm=2048)


def inputs(B=2, T=19, G=2, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, G, K, 2, generator=g, dtype=torch.float64)
    log_lam = torch.stack([-(torch.rand(G, K, generator=g, dtype=torch.float64) * 0.5 + 1e-5),
                           torch.randn(G, K, generator=g, dtype=torch.float64) * 2], dim=-1)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, [3, 4, 11]] = True  # a one-token document, a start inside a chunk
    starts[1, [0, 8, 16]] = True  # the first token, starts on chunk boundaries (chunk 4, 8)
    return z, log_lam, starts


@pytest.mark.parametrize("chunk", [1, 4, 5, 256])
def test_reference_equals_the_definition_with_resets_and_an_initial_state(chunk):
    z, log_lam, starts = inputs()
    state0 = torch.randn(2, 2, 3, 2, dtype=torch.float64)
    for st, s0 in ((None, None), (starts, None), (starts, state0)):
        want, want_last = rs.sequential_scan(z, log_lam, st, s0)
        got, got_last = rs.resonance_scan(z, log_lam, st, s0, backend="reference", chunk=chunk)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_last, want_last, rtol=0, atol=1e-12)


def test_reference_gradients_equal_the_definitions():
    z, log_lam, starts = inputs()
    gs = torch.randn_like(z)
    grads = []
    for fn in (lambda a, b: rs.sequential_scan(a, b, starts),
               lambda a, b: rs.resonance_scan(a, b, starts, backend="reference", chunk=4)):
        a, b = z.clone().requires_grad_(), log_lam.clone().requires_grad_()
        (fn(a, b)[0] * gs).sum().backward()
        grads.append((a.grad, b.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_reference_keeps_the_input_dtype_and_an_fp32_state():
    z, log_lam, _ = inputs()
    s, last = rs.resonance_scan(z.to(torch.bfloat16), log_lam.float(), backend="reference")
    assert s.dtype == torch.bfloat16 and last.dtype == torch.float32
    want, _ = rs.sequential_scan(z.to(torch.bfloat16).double(), log_lam.float())
    assert (s.double() - want).abs().max() <= 2 ** -8 * want.abs().max()  # one bf16 rounding of the fp32 state


def test_the_plan_fills_the_device_from_the_channel_count():
    b = rs.plan_scan(1, 32768, 6, 64, **H100)  # tier B, 32k, batch 1: 384 channels
    assert (b.chunk, b.n_chunks) == (64, 512) and b.threads == 196_608 >= 0.5 * 132 * 2048
    assert rs.plan_scan(1, 262144, 6, 64, **H100).chunk == 512
    wide = rs.plan_scan(64, 4096, 12, 64, **H100)  # 49,152 channels x ... : chunks still needed
    assert wide.n_chunks > 1 and wide.threads >= 0.5 * 132 * 2048
    one = rs.plan_scan(512, 1024, 6, 64, **H100)  # 196,608 channels fill the device alone: one pass
    assert (one.chunk, one.n_chunks) == (1024, 1)
    assert rs.plan_scan(1, 10, 6, 64, **H100).n_chunks == 1  # a short row is one chunk
    assert rs.plan_scan(2, 100, 2, 3, **H100, chunk=7).n_chunks == 15


def test_the_bytes_model_counts_seven_token_passes_in_bf16():
    plan = rs.plan_scan(1, 32768, 6, 64, **H100)
    rows = rs.traffic(plan, io_bytes=4)
    token_pass = 32768 * 6 * 64 * 4  # one read or write of z in bf16: 50.3 MB
    big = sum((r["read"] + r["written"]) // token_pass for r in rows)
    assert [r["pass"] for r in rows] == ["fwd reduce", "fwd carry", "fwd apply", "bwd reduce", "bwd carry", "bwd apply"]
    assert big == 7  # z twice + s forward; gs twice + z + dz backward
    assert [r["steps"] for r in rows] == [64, 511, 64, 64, 511, 64]
    single = rs.traffic(rs.plan_scan(1, 32768, 6, 64, **H100, chunk=32768), io_bytes=4)
    assert [r["pass"] for r in single] == ["fwd apply", "bwd apply"]


def test_dispatch_runs_the_reference_on_cpu_and_refuses_a_forced_kernel(monkeypatch):
    z, log_lam, starts = inputs()
    monkeypatch.delenv("LONGTRAIN_KERNELS", raising=False)
    torch.testing.assert_close(rs.resonance_scan(z, log_lam, starts)[0],
                               rs.resonance_scan(z, log_lam, starts, backend="reference")[0], rtol=0, atol=0)
    monkeypatch.setenv("LONGTRAIN_KERNELS", "numba")
    with pytest.raises(KernelBackendError, match="CUDA tensors"):
        rs.resonance_scan(z, log_lam, starts)


@pytest.mark.parametrize("bad, match", [
    (dict(z=torch.zeros(2, 5, 2, 3)), r"z must be \(B, T, G, K, 2\)"),
    (dict(log_lam=torch.zeros(2, 4, 2)), r"log_lam must be \(G, K, 2\) = \(2, 3, 2\)"),
    (dict(starts=torch.zeros(2, 5, dtype=torch.int64)), r"starts must be a \(2, 5\) bool tensor"),
    (dict(state0=torch.zeros(2, 2, 3)), r"state0 must be \(B, G, K, 2\)"),
])
def test_malformed_inputs_are_one_clear_error(bad, match):
    args = dict(z=torch.zeros(2, 5, 2, 3, 2), log_lam=torch.zeros(2, 3, 2), starts=None, state0=None) | bad
    with pytest.raises(ValueError, match=match):
        rs.resonance_scan(args["z"], args["log_lam"], args["starts"], args["state0"])


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_a_row_split_over_ranks_scans_as_the_whole_row(degree):
    """Context parallelism on the reference: contiguous slices exchanging (decay, state) summaries forward and the
    adjoint backward (tests/cuda_ops/split_scan.py emulates the ranks) give the whole row's s and gradients, with
    documents starting inside a slice, at a slice's first token and at its last, and without documents."""
    from tests.cuda_ops.split_scan import split_scan

    z, log_lam, starts = inputs(T=24)
    starts[0, [6, 12, 17]] = True  # slice starts 6, 12 (row 1: 0, 8, 16); 17: the last token of a slice at degree 4
    gs = torch.randn_like(z)
    for st in (starts, None):
        a, b = z.clone().requires_grad_(), log_lam.clone().requires_grad_()
        want, _ = rs.sequential_scan(a, b, st)
        (want * gs).sum().backward()
        s, dz, dlog = split_scan(lambda zr, ll, sr, carry: rs.resonance_scan(zr, ll, sr, backend="reference",
                                                                              chunk=4, carry=carry),
                                 z, log_lam, st, gs, degree)
        torch.testing.assert_close(s, want.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(dz, a.grad, rtol=0, atol=1e-11)
        torch.testing.assert_close(dlog, b.grad, rtol=0, atol=1e-11)
