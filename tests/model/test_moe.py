"""The mixture-of-experts layer (model/moe.py) and its routing (model/moe_routing.py): every compute path equals the
plain per-expert loop forward and backward, the balancing terms against hand-computed values, the bias update's
direction, capacity drops, and the tiers' and models' parameter counts.

    .venv/bin/python -m pytest tests/model/test_moe.py -q
"""
from __future__ import annotations

import math

import pytest
import torch

from cuda_ops.moe_dispatch import plan_reference
from model.decoder import build_model
from model.flops import active_param_count, expert_params, feed_forward_params, param_count
from model.moe import MoEFeedForward, grouped_mm_supported
from model.moe_routing import balance_loss, route_stats, top_k_route, update_selection_bias
from model.tiers import RESONANCE_TIERS, TIERS, MoESpec, with_moe

D = 32


def _layer(spec: MoESpec, dtype=torch.float64, seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(D, spec).to(dtype).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
        if layer.expert_bias is not None:
            layer.expert_bias.normal_(0.0, 0.05)
    return layer


def _grads(layer: MoEFeedForward, x: torch.Tensor, g: torch.Tensor, reference: bool):
    x = x.clone().requires_grad_()
    y = layer.forward_reference(x) if reference else layer(x)
    grads = torch.autograd.grad(y, [x, *layer.parameters()], g)
    return y.detach(), grads


SPECS = {
    "plain": MoESpec(num_experts=6, experts_per_token=2, expert_ffn=16),
    "shared": MoESpec(num_experts=4, experts_per_token=3, expert_ffn=8, shared_experts=2),
    "unnormalised": MoESpec(num_experts=5, experts_per_token=2, expert_ffn=8, renormalize=False),
    "bias": MoESpec(num_experts=6, experts_per_token=2, expert_ffn=8, selection_bias=True),
    "capacity": MoESpec(num_experts=4, experts_per_token=2, expert_ffn=8, capacity_factor=1.0),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("impl,dtype,tol", [("per_expert", torch.float64, 1e-12), ("gathered", torch.float64, 1e-12),
                                            ("grouped", torch.float32, 1e-5)])
def test_every_path_equals_the_loop_forward_and_backward(name, impl, dtype, tol):
    """fp64 shows the per-expert and gathered paths exact; the grouped GEMM (no fp64 kernel) is compared in fp32."""
    if impl == "grouped" and not grouped_mm_supported(torch.device("cpu"), dtype):
        pytest.skip("torch._grouped_mm has no CPU kernel for this dtype in this torch")
    layer = _layer(SPECS[name], dtype)
    layer.impl = impl
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, D, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(3, 11, D, generator=gen, dtype=torch.float64).to(dtype)
    if name == "capacity":  # skew the router towards expert 0, past its capacity
        x = x + 1.0
        with torch.no_grad():
            layer.router.weight[0] += 0.3
    y, grads = _grads(layer, x, g, reference=False)
    y_ref, grads_ref = _grads(layer, x, g, reference=True)
    assert y.dtype == dtype and y.shape == x.shape
    scale = max(1.0, float(y_ref.abs().max()))
    assert float((y - y_ref).abs().max()) <= tol * scale
    for a, b in zip(grads, grads_ref):
        assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))
    if name == "capacity":
        assert int(layer.stats.dropped) > 0, "the capacity case should drop some assignments"


def test_bf16_grouped_path_follows_the_fp32_loop():
    """Under bf16 autocast the experts run through torch._grouped_mm in bf16 (CPU kernel): the layer's output stays
    within bf16 rounding of the fp32 loop."""
    layer = _layer(SPECS["plain"], torch.float32)
    x = torch.randn(2, 24, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = layer.forward_reference(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got = layer(x)
    assert got.dtype == torch.float32  # accumulated in fp32, as the residual stream is
    assert float((got - want).abs().max() / want.abs().max()) < 3e-2


def test_router_top_k_renormalises_and_the_bias_only_chooses():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    p = torch.softmax(logits, -1)
    route = top_k_route(logits, 2)
    assert route.experts.tolist() == [[0, 1], [2, 3]]
    assert torch.allclose(route.weights, torch.stack([p[0, :2] / p[0, :2].sum(), p[1, 2:] / p[1, 2:].sum()]))
    raw = top_k_route(logits, 2, renormalize=False)
    assert torch.allclose(raw.weights, torch.stack([p[0, :2], p[1, 2:]]))
    bias = torch.tensor([-1.0, 0.0, 0.0, 1.0])  # expert 3 favoured, expert 0 avoided
    biased = top_k_route(logits, 2, renormalize=False, bias=bias)
    assert biased.experts.tolist() == [[3, 1], [3, 2]]
    assert torch.allclose(biased.weights, torch.stack([p[0, [3, 1]], p[1, [3, 2]]]))  # the probabilities, unbiased


def test_aux_loss_on_a_hand_computed_case():
    """E = 4, k = 2, N = 4 tokens. Counts (3, 3, 1, 1): f = (0.75, 0.75, 0.25, 0.25); mean probabilities
    P = (0.4, 0.3, 0.2, 0.1); L = (E / k) sum f P = 2 (0.3 + 0.225 + 0.05 + 0.025) = 1.2."""
    counts = torch.tensor([3.0, 3.0, 1.0, 1.0])
    prob_sum = torch.tensor([1.6, 1.2, 0.8, 0.4], requires_grad=True)  # 4 tokens
    loss = balance_loss(counts, prob_sum, tokens=4, k=2)
    assert loss.item() == pytest.approx(1.2)
    loss.backward()  # the gradient flows through P only: (E / k) f / N
    assert torch.allclose(prob_sum.grad, 2 * torch.tensor([0.75, 0.75, 0.25, 0.25]) / 4)
    # a perfect balance is 1 whatever E and k
    assert float(balance_loss(torch.full((8,), 6.0), torch.full((8,), 2.0), tokens=16, k=3)) == pytest.approx(1.0)
    # global counts from other ranks' tokens: f over all of them, P over this rank's
    assert balance_loss(counts * 3, prob_sum, tokens=4, k=2, counted_tokens=12).item() == pytest.approx(1.2)


def test_route_stats_z_loss_and_entropy():
    logits = torch.tensor([[0.0, math.log(2.0), 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0]])
    p = torch.tensor([[0.2, 0.4, 0.2, 0.2], [0.5, 1 / 6, 1 / 6, 1 / 6]])
    stats = route_stats(logits, top_k_route(logits, 1), 4)
    assert stats.counts.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert float(stats.z_sum) == pytest.approx(math.log(5.0) ** 2 + math.log(6.0) ** 2)  # logsumexp = log 5, log 6
    assert float(stats.entropy_sum) == pytest.approx(-float((p * p.log()).sum()), rel=1e-6)
    assert stats.tokens == 2 and torch.allclose(stats.prob_sum, p.sum(0))


def test_bias_update_moves_against_the_load():
    bias = torch.zeros(4)
    update_selection_bias(bias, torch.tensor([10.0, 2.0, 4.0, 0.0]), rate=0.01)  # mean 4
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    # the overloaded expert is then less likely to be chosen: its biased score falls below an equal neighbour's
    logits = torch.zeros(1, 4)
    assert top_k_route(logits, 1, bias=bias).experts.item() != 0


def test_bias_balancing_evens_a_skewed_router():
    """A router that sends most tokens to expert 0 (its weight points along the tokens' shared offset): 100
    bias updates bring the max/mean load from 2.8 under 1.4."""
    torch.manual_seed(0)
    E, k = 8, 2
    u = torch.nn.functional.normalize(torch.randn(D), dim=0)
    x = torch.randn(512, D) + 1.5 * u
    w = torch.randn(E, D) * 0.3
    w[0] += 2.0 * u
    logits = x @ w.T  # fixed: only the bias moves
    bias = torch.zeros(E)

    def load() -> torch.Tensor:
        return route_stats(logits, top_k_route(logits, k, bias=bias), E).counts

    before = load()
    for _ in range(100):
        update_selection_bias(bias, load(), 0.01)
    after = load()  # with fixed logits the sign steps end in a small cycle (1.24 <-> 1.37 here): within 1.4
    assert float(before.max() / before.mean()) > 2.5 and float(after.max() / after.mean()) < 1.4
    assert int(bias.argmin()) == 0  # the overloaded expert got the lowest bias


def test_plan_slots_group_by_expert_in_token_order():
    ids = torch.tensor([[1, 0], [1, 2], [0, 1]])
    plan = plan_reference(ids, 3, align=2)
    # expert 0: assignments 1, 4 -> rows 0, 1; expert 1: 0, 2, 5 -> rows 2, 3, 4 (+1 pad); expert 2: 3 -> row 6
    assert plan.slot.tolist() == [2, 0, 3, 6, 1, 4]
    assert plan.counts.tolist() == [2, 3, 1] and plan.rows == 6 + 3 and plan.offsets.tolist() == [2, 6, 9]
    capped = plan_reference(ids, 3, align=1, capacity=2)
    assert capped.slot.tolist() == [2, 0, 3, 4, 1, -1] and int(capped.dropped) == 1


def test_capacity_applies_in_training_only():
    layer = _layer(MoESpec(num_experts=4, experts_per_token=2, expert_ffn=8, capacity_factor=1.0), torch.float64)
    x = torch.randn(1, 40, D, dtype=torch.float64) + 2.0  # a shared offset skews the router
    assert layer.capacity(40, 2) == 20
    layer.eval()
    assert layer.capacity(40, 2) == 0
    with torch.no_grad():
        dropless = layer(x)
        layer.spec = MoESpec(num_experts=4, experts_per_token=2, expert_ffn=8)
        assert torch.equal(layer(x), dropless)


@pytest.mark.parametrize("mixer", ["attention", "resonance"])
def test_moe_tiers_count_total_and_active_parameters(mixer):
    table = TIERS if mixer == "attention" else RESONANCE_TIERS
    for name in ("nano-moe", "B-moe"):
        tier = table[name]
        with torch.device("meta"):
            model = build_model(name, 1000, mixer=mixer)
        assert model.num_params() == param_count(tier, 1000)
        spec, d = tier.moe, tier.d_model
        unused = tier.n_layers * (spec.num_experts - spec.experts_per_token) * 3 * d * spec.expert_ffn
        assert active_param_count(tier, 1000) == param_count(tier, 1000) - unused
        assert expert_params(tier) == tier.n_layers * spec.num_experts * 3 * d * spec.expert_ffn
    b = table["B-moe"].moe  # OLMoE-1B-7B's shape at tier B's width
    assert (b.num_experts, b.experts_per_token, b.expert_ffn) == (64, 8, table["B"].d_model // 2)
    assert TIERS["nano-moe"].moe.experts_per_token * TIERS["nano-moe"].moe.expert_ffn == TIERS["nano"].d_ff


def test_settings_change_the_spec_and_dense_first_layers_keep_the_mlp():
    tier = with_moe(TIERS["nano-moe"], shared_experts=1, dense_first_layers=1)
    model = build_model(tier, 100)
    assert type(model.blocks[0].mlp).__name__ == "SwiGLU" and isinstance(model.blocks[1].mlp, MoEFeedForward)
    assert model.num_params() == param_count(tier, 100)
    assert feed_forward_params(tier) == 3 * 64 * 192 + 8 * 64 + 8 * 3 * 64 * 96 + 3 * 64 * 96 + 64
    assert with_moe(TIERS["nano-moe"], num_experts=0).moe is None
    assert with_moe(TIERS["nano"]) is TIERS["nano"]
    assert with_moe(TIERS["nano"], num_experts=4).moe == MoESpec(4, 2, 96)


@pytest.mark.system  # docs/tests.md: over ~5 s (dynamo traces two blocks)
def test_a_compiled_block_under_bf16_autocast_has_no_graph_break():
    """What a CUDA run compiles (regional torch.compile of each block, bf16 autocast): the grouped path traces as one
    graph per block, with no host read, and the router statistics are still recorded for the aux loss ("aot_eager":
    inductor's C++ build takes minutes on 2 cores)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from model.moe import moe_layers

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = build_model("nano-moe", 300).train()
    model.compile_blocks(backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model(torch.randint(0, 300, (2, 32)))
    hidden.float().square().mean().backward()
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    assert all(layer.stats is not None and layer.stats.prob_sum.requires_grad for layer in moe_layers(model))
    torch._dynamo.reset()
