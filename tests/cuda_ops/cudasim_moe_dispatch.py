"""The MoE dispatch Numba kernels under the CUDA simulator, against the torch reference (run as a script).

Run by tests/cuda_ops/test_moe_dispatch_cudasim.py in a subprocess (NUMBA_ENABLE_CUDASIM=1 must be set before numba
is imported; tests/cuda_ops/conftest.py starts it in the background). By hand:

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python tests/cuda_ops/cudasim_moe_dispatch.py

Prints one JSON object {case name: "ok" | traceback}. Each case compares the kernels (plan, scatter, combine and
their backward) with cuda_ops/moe_dispatch.py's reference on a tiny shape: the slots, offsets, counts and the
dropped count exactly, the scattered rows and the rows' gradients bit for bit (copies and single products), the
combined rows and the weights' gradients to fp32 rounding (sums in another order). The counting chunk is 8
assignments (CHUNK is 256 on a GPU) so several chunks and their carried bases are exercised, and the row kernels'
blocks stride over rows wider than their threads.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import cuda_ops.moe_dispatch as md  # noqa: E402
from tests.cuda_ops.case_runner import report_cases  # noqa: E402

SIM_CHUNK = 8


def _routes(N: int, k: int, E: int, seed: int, skew: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(N, E, generator=g)
    if skew:  # most tokens want expert 0: a capacity drops some, and other experts stay empty
        scores[:, 0] += 2.0
        scores[:, E - 1] -= 2.0
    return scores.topk(k, dim=-1).indices


def _check_plan(ids: torch.Tensor, E: int, align: int, capacity: int) -> tuple:
    ref = md.plan_reference(ids, E, align, capacity)
    ker = md.plan_kernel(ids, E, align, capacity, chunk=SIM_CHUNK)
    assert torch.equal(ker.slot, ref.slot), (ker.slot, ref.slot)
    assert torch.equal(ker.offsets, ref.offsets), (ker.offsets, ref.offsets)
    assert torch.equal(ker.counts, ref.counts), (ker.counts, ref.counts)
    assert int(ker.dropped) == int(ref.dropped) and ker.rows == ref.rows
    return ref, ker


def _check_rows(ids: torch.Tensor, E: int, align: int, capacity: int, D: int, dtype: torch.dtype) -> None:
    """Forward and backward of scatter and combine on the kernels against the reference's autograd."""
    ref, ker = _check_plan(ids, E, align, capacity)
    N, k = ids.shape
    g = torch.Generator().manual_seed(N * 31 + D)
    x = torch.randn(N, D, generator=g).to(dtype)
    w = torch.rand(N, k, generator=g)
    gout = torch.randn(N, D, generator=g)
    outs = {}
    for name, plan, backend in (("reference", ref, "reference"), ("kernel", ker, "numba")):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        buf = md._scatter(xi, plan, backend)
        y = buf * 2 - 1  # stand-in experts: every row changes, and so does its gradient
        yi = y.detach().requires_grad_()
        out = md._combine(yi, plan, wi, backend)
        out.backward(gout)
        buf.backward(yi.grad * 2)
        outs[name] = (buf.detach(), out.detach(), xi.grad, wi.grad, yi.grad)
    (rb, ro, rgx, rgw, rgy), (kb, ko, kgx, kgw, kgy) = outs["reference"], outs["kernel"]
    assert kb.dtype == rb.dtype and torch.equal(kb, rb), "scatter differs"
    assert torch.equal(kgy, rgy), "combine's gradient into the rows differs"  # one product each, same rounding
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(ko, ro, rtol=tol, atol=tol), (ko - ro).abs().max()
    assert torch.allclose(kgw, rgw, rtol=1e-5, atol=1e-5), (kgw - rgw).abs().max()
    assert kgx.dtype == rgx.dtype and torch.allclose(kgx.float(), rgx.float(), rtol=tol, atol=tol), "scatter grad"


def case_plan_dropless_aligned():
    for seed, (N, k, E, align) in enumerate([(13, 2, 4, 1), (13, 2, 4, 4), (7, 3, 5, 8), (1, 1, 3, 2)]):
        _check_plan(_routes(N, k, E, seed), E, align, 0)


def case_plan_capacity_drops_late_tokens():
    ids = _routes(21, 2, 4, 5, skew=True)
    ref, _ = _check_plan(ids, 4, 2, 6)
    assert int(ref.dropped) > 0, "the skewed routes should overflow expert 0"


def case_plan_empty_experts():
    ids = torch.zeros(9, 1, dtype=torch.int64)  # every token to expert 0: experts 1..3 get no rows
    ref, _ = _check_plan(ids, 4, 4, 0)
    assert ref.offsets.tolist()[:3] == [12, 12, 12] and ref.offsets.tolist()[3] == ref.rows


def case_rows_fp32():
    _check_rows(_routes(11, 2, 4, 1), 4, 4, 0, 37, torch.float32)


def case_rows_fp32_capacity():
    _check_rows(_routes(19, 2, 4, 2, skew=True), 4, 2, 6, 9, torch.float32)


def case_rows_bf16():
    _check_rows(_routes(10, 3, 5, 3), 5, 8, 0, 20, torch.bfloat16)


def case_rows_bf16_capacity():
    _check_rows(_routes(16, 2, 4, 4, skew=True), 4, 8, 8, 12, torch.bfloat16)


if __name__ == "__main__":
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
    report_cases(globals())
