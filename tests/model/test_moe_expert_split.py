"""A MoE layer whose dispatch holds only a subset of the experts (model/expert_dispatch.py), on 2 gloo ranks with
tests/model/expert_exchange.py's all-to-all: each rank's outputs and input gradients equal the one-process layer
with every expert, and each rank's experts' weight gradients equal that layer's on every rank's tokens together.

    .venv/bin/python -m pytest tests/model/test_moe_expert_split.py -q
"""
from __future__ import annotations

import pytest
import torch

from model.moe import MoEFeedForward
from model.tiers import MoESpec
from pipeline.train.distributed.process_group import run_workers

pytestmark = pytest.mark.system  # starts 2 processes

D, RANKS = 32, 2


def _layer(spec: MoESpec, dtype: torch.dtype) -> MoEFeedForward:
    torch.manual_seed(3)
    layer = MoEFeedForward(D, spec).to(dtype).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    return layer


def _tokens(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    n = 13 + 6 * rank  # uneven: the ranks send each other different numbers of rows
    return (torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype))


def _split_worker(rank: int, world: int, spec_kw: dict, impl: str, dtype_name: str) -> dict:
    from tests.model.expert_exchange import AllToAllExperts

    dtype = getattr(torch, dtype_name)
    spec = MoESpec(**spec_kw)
    split, whole = _layer(spec, dtype), _layer(spec, dtype)
    split.dispatch, split.impl = AllToAllExperts(), impl
    x, g = _tokens(rank, dtype)
    x = x.requires_grad_()
    y = split(x[None])[0]
    y.backward(g)
    # the reference: every expert here, every rank's tokens (the experts' gradients sum over all of them)
    xs = [_tokens(r, dtype)[0].requires_grad_() for r in range(world)]
    ys = [whole(xr[None])[0] for xr in xs]
    sum((yr * _tokens(r, dtype)[1]).sum() for r, yr in enumerate(ys)).backward()
    per = spec.num_experts // world
    mine = slice(rank * per, (rank + 1) * per)
    err = {
        "out": float((y - ys[rank]).abs().max()),
        "grad_x": float((x.grad - xs[rank].grad).abs().max()),
        "grad_w_gate_up": float((split.experts.w_gate_up.grad[mine] - whole.experts.w_gate_up.grad[mine]).abs().max()),
        "grad_w_down": float((split.experts.w_down.grad[mine] - whole.experts.w_down.grad[mine]).abs().max()),
        "others_untouched": float(split.experts.w_down.grad[[e for e in range(spec.num_experts) if not
                                                             rank * per <= e < (rank + 1) * per]].abs().max()),
    }
    return err


@pytest.mark.parametrize("spec_kw,impl,dtype,tol", [
    (dict(num_experts=4, experts_per_token=2, expert_ffn=16), "per_expert", "float64", 1e-12),
    (dict(num_experts=6, experts_per_token=3, expert_ffn=8, shared_experts=1), "per_expert", "float64", 1e-12),
    (dict(num_experts=4, experts_per_token=2, expert_ffn=16), "grouped", "float32", 1e-5),  # torch._grouped_mm
])
def test_a_layer_holding_half_the_experts_equals_the_whole_layer(spec_kw, impl, dtype, tol):
    """fp64 where it shows exactness; fp32 through the grouped GEMM to fp32 rounding (sums in another order)."""
    results = run_workers(_split_worker, RANKS, spec_kw, impl, dtype, timeout_s=60)
    for rank, err in enumerate(results):
        assert all(v < tol for v in err.values()), (rank, err)
