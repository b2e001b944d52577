"""Cross-entropy Numba kernel under the CUDA simulator vs the torch reference, on awkward tiny shapes.

Run by tests/cuda_ops/test_cross_entropy_cudasim.py in a subprocess (NUMBA_ENABLE_CUDASIM=1 must be set before
numba is imported). By hand:

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python tests/cuda_ops/cudasim_cross_entropy.py

Prints one JSON object {case name: "ok" | traceback}. The simulator runs each GPU thread as a Python thread, so
shapes stay tiny (8 x 300 logits) and the block is lowered to 32 threads (64 for the staged kernel, which every case
runs unless it says otherwise); 300 is not a multiple of 32, and a 5-class vocabulary leaves most threads of a block
without a single element. The bf16 and fp16 cases run the
kernel on the storage the kernel backend holds for bf16 / fp16 training.
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

import cuda_ops.cross_entropy as ce  # noqa: E402

BLOCK = 32
ce.ROWWISE_BLOCK = BLOCK  # the torch-tensor path (_rowwise_numba) reads this at call time


def awkward_logits(n=8, v=300, seed=0):  # v even: bf16 runs as word pairs; odd: as int16
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    targets = torch.randint(0, v, (n,), generator=g)
    logits[2, 5] = 1e4                                  # one huge logit: exp overflows without max subtraction
    logits[3] = -1e4
    logits[3, 7] = 1e4                                  # +-1e4 row whose argmax is the target
    targets[3] = 7
    logits[4] = 2.0                                     # all tied: argmax must be the first index (0)
    targets[4] = 0
    logits[6, v - 1] = 50.0                             # argmax in the vocab tail past the last full block
    targets[6] = v - 1
    logits[7, 64] = logits[7, 33] = 40.0                # tie across threads: the lower-tid partial holds the
    targets[7] = 33                                     # later index (64), the first one (33) must win
    targets[1] = -100                                   # ignored row
    targets[5] = v + 3                                  # out of range: NaN loss, like the reference
    return logits, targets


def rowwise_both(logits, targets, z_loss=0.0, write_grad=True, ignore_index=-100, dtype=torch.float32):
    """(loss_rows, correct_rows, logits after) from the reference and from the kernel, on a `dtype` buffer."""
    out = []
    for fn in (ce._rowwise_reference, ce._rowwise_numba):
        buf = logits.to(dtype, copy=True)
        loss_rows = torch.full((len(targets),), -7.0)
        correct_rows = torch.full((len(targets),), -7, dtype=torch.int32)
        fn(buf, targets, ignore_index, z_loss, write_grad, loss_rows, correct_rows)
        out.append((loss_rows, correct_rows, buf))
    return out


def assert_rowwise_equal(ref, ker, loss_tol=1e-5):
    (l_ref, c_ref, g_ref), (l_ker, c_ker, g_ker) = ref, ker
    torch.testing.assert_close(l_ker, l_ref, rtol=loss_tol, atol=loss_tol, equal_nan=True)
    assert torch.equal(c_ker, c_ref), (c_ker, c_ref)
    torch.testing.assert_close(g_ker, g_ref, rtol=1e-5, atol=1e-6)


def case_rowwise_awkward():
    logits, targets = awkward_logits()
    ref, ker = rowwise_both(logits, targets)
    assert_rowwise_equal(ref, ker)
    assert ker[1][3] == ker[1][4] == ker[1][6] == ker[1][7] == 1     # the argmax cases above were exercised
    assert torch.isnan(ker[0][5]) and ker[0][1] == 0 and torch.count_nonzero(ker[2][1]) == 0


def case_rowwise_z_loss():
    logits, targets = awkward_logits(seed=1)
    ref, ker = rowwise_both(logits, targets, z_loss=1e-2)
    assert_rowwise_equal(ref, ker, loss_tol=1e-4)                      # 1e-2 * (1e4)^2 = 1e6: relative tolerance


def case_rowwise_all_rows_ignored():
    logits, targets = awkward_logits()
    targets[:] = -1
    ref, ker = rowwise_both(logits, targets, ignore_index=-1)
    assert_rowwise_equal(ref, ker)
    assert torch.count_nonzero(ker[0]) == 0 and torch.count_nonzero(ker[2]) == 0


def case_rowwise_vocab_smaller_than_block():
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    targets = torch.tensor([0, 4, -100, 2])
    ref, ker = rowwise_both(logits, targets)
    assert_rowwise_equal(ref, ker)
    assert torch.isfinite(ker[0]).all()                                 # empty partials must not produce NaN


def case_rowwise_without_grad_leaves_logits():
    logits, targets = awkward_logits()
    ref, ker = rowwise_both(logits, targets, write_grad=False)
    assert_rowwise_equal(ref, ker)
    assert torch.equal(ker[2], logits)


def case_rowwise_bf16_storage():
    """bf16 logits (the kernel backend's buffer for bf16 training), V even (int32 words of two logits) and odd (int16
    bits): the kernel widens the bits and rounds the gradient back to bf16 as torch's .to(torch.bfloat16) rounds the
    reference's fp32 gradient, so the two agree to one bf16 ulp (fp32 exp/log rounding apart) and mostly exactly."""
    for v in (300, 301):
        logits, targets = awkward_logits(v=v, seed=3)
        targets[0] = v - 1                              # the high half of the last word (even V), the odd tail
        ref, ker = rowwise_both(logits, targets, z_loss=1e-3, dtype=torch.bfloat16)
        torch.testing.assert_close(ker[0], ref[0], rtol=1e-4, atol=1e-4, equal_nan=True)
        assert torch.equal(ker[1], ref[1]) and ker[2].dtype == torch.bfloat16
        ulp = (ker[2].view(torch.int16).int() - ref[2].view(torch.int16).int()).abs()
        assert int(ulp.max()) <= 1 and float((ulp == 0).float().mean()) > 0.9, (v, int(ulp.max()))
    assert ce._storage_view(torch.zeros(2, 300, dtype=torch.bfloat16))[1] == "bf16x2"
    assert ce._storage_view(torch.zeros(2, 301, dtype=torch.bfloat16))[1] == "bf16"


def case_rowwise_fp16_storage():
    logits, targets = awkward_logits(seed=4)
    logits = logits.clamp(-6e4, 6e4)                    # fp16's range
    ref, ker = rowwise_both(logits, targets, dtype=torch.float16)
    torch.testing.assert_close(ker[0], ref[0], rtol=1e-4, atol=1e-4, equal_nan=True)
    assert torch.equal(ker[1], ref[1]) and ker[2].dtype == torch.float16
    torch.testing.assert_close(ker[2], ref[2], rtol=2e-3, atol=1e-7)


def case_bf16_rounding_matches_torch():
    """The kernel's fp32 -> bf16 rounding (nearest even, NaN kept) on ties, carries into the exponent, +-inf,
    subnormals and the largest finite values, against torch's conversion; and the widening back is exact."""
    ce._rowwise_kernel(32, "bf16")                      # binds the simulator's bit casts
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F7FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x00008000,
                         0x80018000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x00000001, 0xBF808001, 0x4049_0FDB],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    vals = torch.cat([bits, torch.randn(2000, generator=torch.Generator().manual_seed(6)) * 1e3])
    want = vals.bfloat16().view(torch.int16)
    got = torch.tensor([ce._f32_to_bf16_bits(float(v)) for v in vals.tolist()], dtype=torch.int16)
    nan = torch.isnan(vals)
    assert torch.equal(got[~nan], want[~nan]) and bool(torch.isnan(got[nan].view(torch.bfloat16).float()).all())
    back = torch.tensor([float(ce._bf16_bits_to_f32(int(b))) for b in want[~nan].tolist()])
    assert torch.equal(back, want[~nan].view(torch.bfloat16).float())
    # pairs: two bf16 in one int32 word (low half first), both ways, against torch's own view of the same bytes
    pairs = vals[~nan][: 2 * (int((~nan).sum()) // 2)].reshape(-1, 2)
    words = [ce._f32_pair_to_bf16_word(float(a), float(b)) for a, b in pairs.tolist()]
    assert torch.equal(torch.tensor(words, dtype=torch.int32), pairs.bfloat16().contiguous().view(torch.int32)[:, 0])
    widened = torch.tensor([[float(x) for x in ce._bf16_pair_to_f32(w)] for w in words])
    assert torch.equal(widened, pairs.bfloat16().float())


def case_staged_and_two_read_kernels_agree_bit_for_bit():
    """The staged kernel (the row held in registers, read once) folds each thread's words in the two-read kernel's
    order: with the same threads a block they give the same bits (losses, argmax, gradients), in every storage."""
    assert ce.rowwise_plan(150, BLOCK) == (2 * BLOCK, 4) and ce.rowwise_plan(150, BLOCK, staged=False) == (BLOCK, 0)
    for dtype, v in ((torch.float32, 300), (torch.bfloat16, 300), (torch.bfloat16, 301), (torch.float16, 300)):
        logits, targets = awkward_logits(v=v, seed=7)
        logits = logits.clamp(-6e4, 6e4)
        outs = []
        for kw in (dict(block=BLOCK, staged=True), dict(block=2 * BLOCK, staged=False)):
            buf = logits.to(dtype, copy=True)
            loss_rows = torch.full((len(targets),), -7.0)
            correct_rows = torch.full((len(targets),), -7, dtype=torch.int32)
            ce._rowwise_numba(buf, targets, -100, 1e-3, True, loss_rows, correct_rows, **kw)
            outs.append((loss_rows, correct_rows, buf))
        (l1, c1, g1), (l2, c2, g2) = outs
        assert torch.equal(l1.nan_to_num(-1.0), l2.nan_to_num(-1.0)) and torch.equal(c1, c2), (dtype, v)
        assert torch.equal(g1.view(torch.int16) if dtype != torch.float32 else g1,
                           g2.view(torch.int16) if dtype != torch.float32 else g2), (dtype, v)


def case_rowwise_two_read_kernel():
    """The kernel for rows too long to hold (128,256 in bf16 on a GPU) against the reference."""
    ce.ROWWISE_STAGED = False
    try:
        logits, targets = awkward_logits()
        assert_rowwise_equal(*rowwise_both(logits, targets))
        logits, targets = awkward_logits(v=300, seed=3)
        ref, ker = rowwise_both(logits, targets, z_loss=1e-3, dtype=torch.bfloat16)
        ulp = (ker[2].view(torch.int16).int() - ref[2].view(torch.int16).int()).abs()
        assert torch.equal(ker[1], ref[1]) and int(ulp.max()) <= 1
    finally:
        ce.ROWWISE_STAGED = True


def end_to_end(dtype, tol_loss, tol_grad):
    """linear_cross_entropy through the kernel (backend forced past dispatch: host tensors under the simulator)
    against the reference path, 3 chunks of <= 3 rows, the first chunk fully ignored."""
    g = torch.Generator().manual_seed(5)
    n, d, v = 8, 24, 300
    hidden = torch.randn(n, d, generator=g).to(torch.bfloat16).to(dtype)   # bf16-rounded values
    weight = (torch.randn(v, d, generator=g) / 2).to(torch.bfloat16).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[:3] = -100
    results = []
    for backend in ("reference", "numba"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        res = ce._linear_cross_entropy(h, w, targets, -100, 3, 1e-3, backend)
        (res.loss_sum * 0.5).backward()
        results.append((res, h.grad, w.grad))
    (r_ref, gh_ref, gw_ref), (r_ker, gh_ker, gw_ker) = results
    torch.testing.assert_close(r_ker.loss_sum, r_ref.loss_sum, rtol=tol_loss, atol=tol_loss)
    assert int(r_ker.n_tokens) == int(r_ref.n_tokens) == 5
    assert int(r_ker.n_correct) == int(r_ref.n_correct)
    assert gh_ker.dtype == gw_ker.dtype == dtype
    for got, want in ((gh_ker, gh_ref), (gw_ker, gw_ref)):
        err = (got.double() - want.double()).abs().max()
        assert err <= tol_grad * want.double().abs().max(), (dtype, float(err))
    assert torch.count_nonzero(gh_ker[:3]) == 0


def case_end_to_end_fp32():
    end_to_end(torch.float32, 1e-5, 1e-5)


def case_end_to_end_bf16():
    # bf16 inputs: the kernel backend keeps matmuls and the logits chunk in bf16 and writes dL/dlogits in bf16
    # (8-bit mantissa), while the reference does all in fp32.
    end_to_end(torch.bfloat16, 2e-2, 2e-2)


if __name__ == "__main__":
    report_cases(globals())
