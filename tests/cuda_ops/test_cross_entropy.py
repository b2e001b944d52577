"""The chunked linear cross-entropy (reference path, CPU) against torch.nn.functional.cross_entropy on full logits.

    .venv/bin/python -m pytest tests/cuda_ops/test_cross_entropy.py -q
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuda_ops.cross_entropy import CEResult, linear_cross_entropy, linear_cross_entropy_reference

N, D, V = 11, 16, 37  # V = 37 is not a multiple of any chunk size used below


def make_inputs(n=N, d=D, v=V, dtype=torch.float32, seed=0, ignored=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[list(ignored)] = -100
    return hidden, weight, targets


def full_logits_oracle(hidden, weight, targets, z_loss=0.0, ignore_index=-100):
    """Sum loss and its gradients computed in float64 on full logits (the ground truth), plus the correct count."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.t()
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    keep = targets != ignore_index
    if z_loss:
        lse = torch.logsumexp(logits, dim=1)
        loss = loss + z_loss * (lse[keep] ** 2).sum()
    loss.backward()
    n_correct = ((logits.argmax(dim=1) == targets) & keep).sum()
    return loss.detach(), h.grad, w.grad, int(keep.sum()), int(n_correct)


def run(fn, hidden, weight, targets, **kw):
    hidden.grad = weight.grad = None
    res = fn(hidden, weight, targets, **kw)
    res.loss_sum.backward()
    return res, hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_size", [1, 3, 7, N, N + 5])
def test_matches_full_logits_cross_entropy(chunk_size):
    hidden, weight, targets = make_inputs()
    res, gh, gw = run(linear_cross_entropy_reference, hidden, weight, targets, chunk_size=chunk_size)
    loss, gh_ref, gw_ref, n_tok, n_cor = full_logits_oracle(hidden, weight, targets)
    assert isinstance(res, CEResult)
    assert res.loss_sum.dtype == torch.float32 and res.loss_sum.dim() == 0
    assert res.n_tokens.dtype == torch.int64 and res.n_correct.dtype == torch.int64
    torch.testing.assert_close(res.loss_sum.double(), loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh.double(), gh_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw.double(), gw_ref, rtol=1e-5, atol=1e-6)
    assert int(res.n_tokens) == n_tok == N - 2
    assert int(res.n_correct) == n_cor


def test_torch_f_cross_entropy_mean_and_its_gradients():
    """Straight against the float32 torch recipe people use: F.cross_entropy(h @ w.T, t) with mean reduction."""
    hidden, weight, targets = make_inputs(seed=3)
    mean = linear_cross_entropy(hidden, weight, targets, chunk_size=4, reduction="mean")
    mean.backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = F.cross_entropy(hidden @ weight.t(), targets)
    ref.backward()
    torch.testing.assert_close(mean, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh, hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, weight.grad, rtol=1e-5, atol=1e-6)


def test_n_correct_counts_argmax_hits_on_counted_rows_only():
    hidden, weight, targets = make_inputs(n=40, seed=1, ignored=())
    argmax = (hidden @ weight.t()).argmax(dim=1)
    targets = torch.where(torch.arange(40) % 2 == 0, argmax, targets)  # force hits on even rows
    targets[[0, 2, 4]] = -100                                          # ignored hits must not count
    res = linear_cross_entropy_reference(hidden, weight, targets, chunk_size=6)
    expected = ((argmax == targets) & (targets != -100)).sum()
    assert int(res.n_correct) == int(expected) >= 17
    assert int(res.n_tokens) == 37


def test_all_rows_ignored_give_zero_loss_zero_grads_and_mean_zero():
    hidden, weight, targets = make_inputs()
    targets[:] = -100
    res, gh, gw = run(linear_cross_entropy_reference, hidden, weight, targets, chunk_size=4)
    assert float(res.loss_sum.detach()) == 0.0 and int(res.n_tokens) == 0 and int(res.n_correct) == 0
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0
    assert float(res.mean().detach()) == 0.0  # not NaN: a pure-padding batch must not poison training


def test_custom_ignore_index():
    hidden, weight, targets = make_inputs(ignored=())
    targets[[1, 4]] = 7                      # class 7 is the ignored one
    res, gh, gw = run(linear_cross_entropy_reference, hidden, weight, targets, ignore_index=7, chunk_size=5)
    loss, gh_ref, gw_ref, n_tok, _ = full_logits_oracle(hidden, weight, targets, ignore_index=7)
    assert int(res.n_tokens) == n_tok == N - int((targets == 7).sum())
    torch.testing.assert_close(res.loss_sum.double(), loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh.double(), gh_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_z_loss_against_hand_computed_version(chunk_size):
    z = 1e-2
    hidden, weight, targets = make_inputs(seed=2)
    hidden.data.mul_(3)  # larger logits so the z term matters
    res, gh, gw = run(linear_cross_entropy_reference, hidden, weight, targets, chunk_size=chunk_size, z_loss=z)
    loss, gh_ref, gw_ref, _, _ = full_logits_oracle(hidden, weight, targets, z_loss=z)
    loss_no_z, _, _, _, _ = full_logits_oracle(hidden, weight, targets)
    assert float(loss - loss_no_z) > 1e-3  # the check below would not notice a missing z term otherwise
    torch.testing.assert_close(res.loss_sum.double(), loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh.double(), gh_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw.double(), gw_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    """Loss compared to the float64 oracle on the same (already rounded) inputs: the softmax math is fp32, so the
    loss is tight (1e-4 rel); gradients are rounded once to the input dtype (8 bits of mantissa for bf16), so they
    get 1e-2 relative to the largest gradient entry."""
    hidden, weight, targets = make_inputs(n=29, dtype=dtype)
    res, gh, gw = run(linear_cross_entropy_reference, hidden, weight, targets, chunk_size=8, z_loss=1e-3)
    loss, gh_ref, gw_ref, _, n_cor = full_logits_oracle(hidden, weight, targets, z_loss=1e-3)
    assert gh.dtype == dtype and gw.dtype == dtype and res.loss_sum.dtype == torch.float32
    torch.testing.assert_close(res.loss_sum.double(), loss, rtol=1e-4, atol=1e-4)
    assert (gh.double() - gh_ref).abs().max() <= 1e-2 * gh_ref.abs().max()
    assert (gw.double() - gw_ref).abs().max() <= 1e-2 * gw_ref.abs().max()
    assert int(res.n_correct) == n_cor


def test_autocast_runs_the_projection_in_the_autocast_dtype():
    """fp32 hidden and master weight under bf16 autocast: same result as casting both to bf16 by hand, and the
    gradients reach the fp32 leaves in fp32."""
    hidden, weight, targets = make_inputs(n=29)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res, gh, gw = run(linear_cross_entropy_reference, hidden, weight, targets, chunk_size=8)
    assert gh.dtype == gw.dtype == torch.float32
    h16, w16 = (x.detach().to(torch.bfloat16).requires_grad_() for x in (hidden, weight))
    res16, gh16, gw16 = run(linear_cross_entropy_reference, h16, w16, targets, chunk_size=8)
    torch.testing.assert_close(res.loss_sum, res16.loss_sum, rtol=0, atol=0)
    torch.testing.assert_close(gh, gh16.float(), rtol=0, atol=0)
    torch.testing.assert_close(gw, gw16.float(), rtol=0, atol=0)


def test_large_logits_stay_finite():
    hidden, weight, targets = make_inputs()
    with torch.no_grad():
        hidden.mul_(1e3)  # logits of order 1e3..1e4: exp overflows without max subtraction
    res, gh, gw = run(linear_cross_entropy_reference, hidden, weight, targets, chunk_size=3)
    loss, gh_ref, _, _, _ = full_logits_oracle(hidden, weight, targets)
    assert torch.isfinite(res.loss_sum) and torch.isfinite(gh).all() and torch.isfinite(gw).all()
    torch.testing.assert_close(res.loss_sum.double(), loss, rtol=1e-5, atol=1e-2)
    torch.testing.assert_close(gh.double(), gh_ref, rtol=1e-4, atol=1e-3)


def test_batched_leading_dims_and_upstream_scale():
    hidden, weight, targets = make_inputs(n=12)
    h3 = hidden.detach().reshape(3, 4, D).requires_grad_()
    res = linear_cross_entropy_reference(h3, weight, targets.reshape(3, 4), chunk_size=5)
    (res.loss_sum * 2.5).backward()  # backward scales the gradients stored during forward
    loss, gh_ref, gw_ref, _, _ = full_logits_oracle(hidden, weight, targets)
    torch.testing.assert_close(h3.grad.reshape(12, D).double(), 2.5 * gh_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), 2.5 * gw_ref, rtol=1e-5, atol=1e-6)


def test_grad_only_for_inputs_that_require_it():
    hidden, weight, targets = make_inputs()
    res = linear_cross_entropy_reference(hidden, weight.detach(), targets)
    res.loss_sum.backward()
    assert hidden.grad is not None
    with torch.no_grad():
        res = linear_cross_entropy_reference(hidden, weight, targets)
    assert not res.loss_sum.requires_grad
    torch.testing.assert_close(res.loss_sum.double(), full_logits_oracle(hidden, weight, targets)[0])


def test_second_backward_is_refused():
    hidden, weight, targets = make_inputs()
    res = linear_cross_entropy_reference(hidden, weight, targets)
    res.loss_sum.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        res.loss_sum.backward()


def test_out_of_range_target_gives_nan_loss_not_a_crash():
    hidden, weight, targets = make_inputs()
    targets[0] = V + 3
    res = linear_cross_entropy_reference(hidden, weight, targets)
    assert torch.isnan(res.loss_sum)
    assert int(res.n_tokens) == N - 2


@pytest.mark.parametrize("bad, match", [
    (dict(weight=torch.zeros(V, D + 1)), "disagree on D"),
    (dict(targets=torch.zeros(N + 1, dtype=torch.long)), "targets shape"),
    (dict(targets=torch.zeros(N)), "integer"),
    (dict(weight=torch.zeros(V, D, dtype=torch.float64)), "float64"),
    (dict(chunk_size=-1), "chunk_size"),
    (dict(reduction="avg"), "reduction"),
])
def test_input_errors_name_the_problem(bad, match):
    hidden, weight, targets = make_inputs()
    kw = dict(hidden=hidden, weight=weight, targets=targets)
    kw.update({k: v for k, v in bad.items() if k in kw})
    opts = {k: v for k, v in bad.items() if k not in kw}
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(kw["hidden"], kw["weight"], kw["targets"], **opts)


def test_auto_chunks_split_rows_evenly_within_the_budget():
    from cuda_ops.cross_entropy import CHUNK_MULTIPLE, LOGITS_BUDGET_BYTES, auto_chunk_rows

    cpu = torch.device("cpu")
    # 32,768 x 32,000 bf16 = 2,000 MiB of logits: the fewest chunks under the budget, rows split evenly
    rows = auto_chunk_rows(32768, 32000, torch.bfloat16, cpu)
    assert rows == 5504 and rows % CHUNK_MULTIPLE == 0 and -(-32768 // rows) == 6
    assert rows * 32000 * 2 <= LOGITS_BUDGET_BYTES + CHUNK_MULTIPLE * 32000 * 2
    assert auto_chunk_rows(32768, 32000, torch.float32, cpu) == 3072       # fp32 rows: twice the bytes, 11 chunks
    assert auto_chunk_rows(100, 32000, torch.bfloat16, cpu) == 100         # everything fits: one chunk of N
    assert auto_chunk_rows(4096, 32000, torch.bfloat16, cpu, budget_bytes=64_000 * 5) == 5   # tiny budget


def test_auto_chunk_gives_the_same_result_as_any_fixed_chunk():
    hidden, weight, targets = make_inputs()
    auto, gh_a, gw_a = run(linear_cross_entropy_reference, hidden, weight, targets, chunk_size=None)
    fixed, gh_f, gw_f = run(linear_cross_entropy_reference, hidden, weight, targets, chunk_size=3)
    torch.testing.assert_close(auto.loss_sum, fixed.loss_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh_a, gh_f, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gw_a, gw_f, rtol=1e-5, atol=1e-6)
    zero, _, _ = run(linear_cross_entropy_reference, hidden, weight, targets, chunk_size=0)  # 0 = auto (config)
    assert torch.equal(zero.loss_sum, auto.loss_sum)


def test_reference_rowwise_writes_low_precision_gradients_rounded_once():
    """A bf16 logits buffer (what the kernel backend holds) gets the fp32 gradient rounded once to bf16."""
    from cuda_ops.cross_entropy import _rowwise_reference

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 37, generator=g) * 4).bfloat16()
    t = torch.tensor([0, 36, -100, 5, 9])
    outs = []
    for buf in (x.float(), x.clone()):
        loss, corr = torch.empty(5), torch.empty(5, dtype=torch.int32)
        _rowwise_reference(buf, t, -100, 1e-3, True, loss, corr)
        outs.append((loss, corr, buf))
    (l32, c32, g32), (l16, c16, g16) = outs
    assert torch.equal(l16, l32) and torch.equal(c16, c32) and g16.dtype == torch.bfloat16
    assert torch.equal(g16, g32.bfloat16())


def test_fp16_gradients_are_scaled_before_they_are_rounded_to_fp16():
    """fp16 inputs: the gradients are of the loss SUM until backward scales them by 1 / tokens. Held in fp16 at
    sum scale, the weight's gradient over 16,384 tokens that agree (one target, one hidden direction) is ~1.2e5,
    past fp16's 65,504: inf before the scaling could bring it back. Held in fp32 and rounded once after the
    scaling, both gradients are the fp32 ones to fp16's rounding (half a subnormal's 6e-8 spacing, or 2^-11)."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 16384, 16, 32
    hidden = torch.full((n, d), 8.0) + torch.randn(n, d, generator=g).half().float() / 8  # fp16-exact values
    weight = (torch.randn(v, d, generator=g) / 64).half().float()
    targets = torch.zeros(n, dtype=torch.int64)
    grads = {}
    for dtype in (torch.float32, torch.float16):
        h = hidden.to(dtype, copy=True).requires_grad_()
        w = weight.to(dtype, copy=True).requires_grad_()
        linear_cross_entropy(h, w, targets, reduction="mean", backend="reference").backward()
        assert h.grad.dtype == w.grad.dtype == dtype
        grads[dtype] = (h.grad.float(), w.grad.float())
    assert (grads[torch.float32][1] * n).abs().max() > 65504  # the sum-scale weight gradient overflows fp16
    assert (grads[torch.float32][0].abs() < 6.1e-5).float().mean() > 0.5  # hidden's: mostly fp16 subnormals
    for got, want in zip(grads[torch.float16], grads[torch.float32]):
        assert torch.isfinite(got).all()
        assert ((got - want).abs() <= 3.0e-8 + want.abs() * 2.0**-11).all()


def test_training_vocabularies_run_the_staged_row_kernel_and_longer_rows_the_two_read_one():
    """cuda_ops.cross_entropy.rowwise_plan at the GPU block: a 32,000-logit bf16 row (16,000 words of two) is held
    16 words a thread in 1,024-thread blocks; 128,256 in bf16 and 32,000 in fp32 keep the two-read kernel."""
    from cuda_ops.cross_entropy import ROWWISE_BLOCK, rowwise_plan

    assert ROWWISE_BLOCK == 512
    assert rowwise_plan(16000) == (1024, 16) and rowwise_plan(2500) == (1024, 4)
    assert rowwise_plan(64128) == (512, 0) and rowwise_plan(32000) == (512, 0)
    assert rowwise_plan(16000, staged=False) == (512, 0)
