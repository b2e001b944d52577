"""The mixture-of-experts feed-forward: E routed SwiGLU experts, k per token, optional shared experts, in place of
a block's SwiGLU MLP (both families; model/layers.py feed_forward builds it for a tier with a MoESpec).

    from model.moe import MoEFeedForward
    moe = MoEFeedForward(d_model=768, spec=MoESpec(num_experts=64, experts_per_token=8, expert_ffn=384))
    y = moe(x)                          # (B, T, D) -> (B, T, D); in training, moe.stats holds its RouterStats
    y_ref = moe.forward_reference(x)    # the plain per-expert loop: what the tests compare every path with
    set_expert_dispatch(model, split)   # how every MoE layer of a model reaches its experts (LOCAL: all here)

A token's output is sum over its k chosen experts e of w_e SwiGLU_e(x) (model/moe_routing.py: softmax router in
fp32, top-k, renormalised weights by default), plus sigmoid(g . x) SwiGLU_shared(x) when the spec has shared
experts (one SwiGLU of shared_experts x expert_ffn, gated as Qwen2-MoE's shared expert, so the export is exact).

The expert compute (`impl`):
  grouped     tokens into expert order (cuda_ops/moe_dispatch.py: count, prefix-sum, scatter; the Numba kernels on
              CUDA), two grouped GEMMs over every expert at once (torch._grouped_mm: bf16 anywhere torch has it,
              fp32/fp16 eagerly on CPU; not fp64, and on CUDA only from sm_90), and the weighted combine back. With
              the experts all here (model/expert_dispatch.py LOCAL) every shape is fixed by the batch: no host
              sync, so the decode step compiles and is captured in a CUDA graph like the dense one.
  per_expert  the same dispatch, then one matmul pair per expert's group (reads the group offsets on the host): for
              dtypes and devices without a grouped GEMM.
  gathered    each assignment's expert weights gathered and applied as one batched matmul: fixed shapes in any
              dtype, for a few tokens (a decode step) where there is no grouped GEMM; its weight reads grow with
              N k, so it serves only N k <= E.
  auto        grouped where supported; else gathered for N k <= E on one rank; else per_expert.
`forward_reference` is the plain loop the tests hold every path to (forward and backward, fp64 and fp32).

Experts split over ranks: `dispatch` (model/expert_dispatch.py) is LOCAL unless a distributed engine sets another
(set_expert_dispatch). The layer routes its own tokens, scatters them into expert order, hands the rows
and per-expert counts to dispatch.exchange, runs the experts this rank holds (dispatch.local_weight of its weights,
groups padded again for the grouped GEMM), and hands the outputs to dispatch.combine before the weighted combine.

Capacity (spec.capacity_factor > 0, training forwards only): an expert takes at most C = ceil(cf N k / E) of a
micro-batch's assignments (rounded up to the group alignment), the first ones in token order; the rest are dropped
(`RouterStats.dropped` counts them). Evaluation and generation are dropless, so val/loss measures the model as it
is exported. Expert weights are stored as nn.Linear weights stacked over experts, (E, out, in): w_gate_up
(E, 2 F, D) with rows [gate | up], w_down (E, D, F).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from cuda_ops.dispatch import resolve_backend
from cuda_ops.moe_dispatch import combine_rows, plan_routes, scatter_rows
from model.expert_dispatch import LOCAL, ExpertDispatch
from model.layers import SwiGLU, eager_only
from model.moe_routing import RouterStats, route_stats, top_k_route
from model.tiers import MoESpec

IMPLS = ("auto", "grouped", "per_expert", "gathered")


def group_align(dtype: torch.dtype) -> int:
    """Rows each expert's group is padded to a multiple of: 16 bytes of a row's elements' size (8 rows of bf16)."""
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here: bf16 on CPU and on CUDA from sm_90; fp32 and fp16 on CPU outside
    torch.compile (its compile-time shape function takes bf16 only); never fp64 (measured on torch 2.13)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    if device.type != "cpu":
        return False
    if dtype == torch.bfloat16:
        return True
    return dtype in (torch.float32, torch.float16) and not torch.compiler.is_compiling()


class ExpertWeights(nn.Module):
    """E SwiGLU experts' weights: w_gate_up (E, 2F, D) rows [gate | up], w_down (E, D, F)."""

    def __init__(self, num_experts: int, d_model: int, ffn: int):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn, d_model))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_model, ffn))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_gate_up, w_down): read through a call, so that a wrapper that shards the experts on their own (FSDP
        over the ranks holding the same experts, pipeline/train/distributed/) gathers them first."""
        return self.w_gate_up, self.w_down


def _swiglu_rows(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert on its rows: (n, D) -> (n, D)."""
    gate, up = F.linear(h, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


class MoEFeedForward(nn.Module):
    """(B, T, D) -> (B, T, D): the mixture-of-experts feed-forward of the module docstring."""

    def __init__(self, d_model: int, spec: MoESpec):
        super().__init__()
        if spec.experts_per_token > spec.num_experts:
            raise ValueError(f"experts_per_token={spec.experts_per_token} > num_experts={spec.num_experts}")
        self.spec, self.d_model = spec, d_model
        self.router = nn.Linear(d_model, spec.num_experts, bias=False)
        self.experts = ExpertWeights(spec.num_experts, d_model, spec.expert_ffn)
        if spec.shared_experts:
            self.shared = SwiGLU(None, d_model=d_model, d_ff=spec.shared_ffn)
            self.shared_gate = nn.Linear(d_model, 1, bias=False)
        else:
            self.shared = self.shared_gate = None
        if spec.selection_bias:  # fp32 whatever the model's dtype: it moves by 1e-3 steps
            self.register_buffer("expert_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.dispatch: ExpertDispatch = LOCAL
        self.impl = "auto"
        self.stats: RouterStats | None = None  # the last training forward's statistics (model/moe_routing.py)

    # -- routing -------------------------------------------------------------------------------------------------
    def route_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, E) fp32 router logits (fp32 under autocast too: the softmax's input)."""
        with torch.autocast(flat.device.type, enabled=False):
            return F.linear(flat.float(), self.router.weight.float())

    def capacity(self, n_tokens: int, align: int) -> int:
        """Rows per expert under the capacity factor in a training forward; 0 = dropless."""
        cf = self.spec.capacity_factor
        if cf <= 0 or not self.training:
            return 0
        c = math.ceil(cf * n_tokens * self.spec.experts_per_token / self.spec.num_experts)
        return max(align, -(-c // align) * align)

    # -- forward -------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, D = x.shape, x.shape[-1]
        flat = x.reshape(-1, D)
        logits = self.route_logits(flat)
        route = top_k_route(logits, self.spec.experts_per_token, self.spec.renormalize, self.expert_bias)
        y, dropped = self._routed(flat, route)
        if self.training and torch.is_grad_enabled():
            self.stats = route_stats(logits, route, self.spec.num_experts, dropped)
        return self._with_shared(flat, y).to(x.dtype).view(shape)

    def _with_shared(self, flat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.shared is None:
            return y
        return y + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """What the expert matmuls run in: the autocast dtype under autocast, else the input's."""
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def choose_impl(self, n_assignments: int, device: torch.device, dtype: torch.dtype) -> str:
        if self.impl != "auto":
            return self.impl
        if grouped_mm_supported(device, dtype):
            return "grouped"
        if self.dispatch.degree == 1 and n_assignments <= self.spec.num_experts:
            return "gathered"
        return "per_expert"

    def _routed(self, flat: torch.Tensor, route) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed experts' weighted sum (N, D) fp32 (fp64 for fp64 input), and the dropped count (or None)."""
        N, k, E = flat.shape[0], self.spec.experts_per_token, self.spec.num_experts
        cdt = self.compute_dtype(flat)
        h = flat.to(cdt)
        w_gu, w_dn = self.experts()
        w_gu = self.dispatch.local_weight(w_gu).to(cdt)  # (E_local, 2F, D)
        w_dn = self.dispatch.local_weight(w_dn).to(cdt)  # (E_local, D, F)
        impl = self.choose_impl(N * k, flat.device, cdt)
        capacity = self.capacity(N, group_align(cdt))
        if impl == "gathered" and not capacity:  # no dispatch at all: each assignment's own weights
            out = _gathered(h, route.experts, w_gu, w_dn)  # (N, k, D)
            acc = torch.float64 if cdt == torch.float64 else torch.float32
            return (out.to(acc) * route.weights.to(acc)[..., None]).sum(1), None
        if impl == "gathered":
            impl = "per_expert"
        kernels = resolve_backend(flat.device) == "numba"  # the Numba launches stay out of compiled graphs
        plan_fn, scatter_fn, combine_fn = ((eager_only(plan_routes), eager_only(scatter_rows), eager_only(combine_rows))
                                           if kernels else (plan_routes, scatter_rows, combine_rows))
        local = self.dispatch.degree == 1
        align = group_align(cdt) if local else 1
        if capacity and not local:
            capacity = -(-capacity // align) * align
        plan = plan_fn(route.experts, E, align=align, capacity=capacity)
        rows = scatter_fn(h, plan)  # (R, D) in expert order
        if local:
            out = _run_experts(rows, plan.offsets, w_gu, w_dn, impl)
        else:
            out = self._exchange_and_run(rows, plan, capacity, w_gu, w_dn, impl, plan_fn, scatter_fn, combine_fn)
        return combine_fn(out, plan, route.weights), plan.dropped if capacity else None

    @eager_only  # an exchange over ranks reads its split sizes on the host
    def _exchange_and_run(self, rows, plan, capacity, w_gu, w_dn, impl, plan_fn, scatter_fn, combine_fn):
        """Experts on other ranks: rows to their ranks and back through the dispatch (module docstring)."""
        counts = plan.counts if not capacity else torch.full_like(plan.counts, capacity)
        received, local_counts, handle = self.dispatch.exchange(rows, counts)
        n_local = local_counts.shape[0]
        local_ids = torch.repeat_interleave(torch.arange(n_local, device=rows.device), local_counts,
                                            output_size=received.shape[0])[:, None]
        local_plan = plan_fn(local_ids, n_local, align=group_align(received.dtype))
        out = _run_experts(scatter_fn(received, local_plan), local_plan.offsets, w_gu, w_dn, impl)
        ones = torch.ones(received.shape[0], 1, dtype=torch.float32, device=rows.device)
        out = combine_fn(out, local_plan, ones).to(rows.dtype)
        return self.dispatch.combine(out, handle)

    # -- the reference --------------------------------------------------------------------------------------------
    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same layer as a plain loop over the experts (all of them here), in the input's dtype: the reference
        the tests compare the other paths with, forward and backward (the same capacity rule in training)."""
        shape, D = x.shape, x.shape[-1]
        flat = x.reshape(-1, D)
        logits = self.route_logits(flat)
        route = top_k_route(logits, self.spec.experts_per_token, self.spec.renormalize, self.expert_bias)
        capacity = self.capacity(flat.shape[0], group_align(flat.dtype))
        acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
        out = torch.zeros(flat.shape, dtype=acc, device=flat.device)
        for e in range(self.spec.num_experts):
            token, choice = (route.experts == e).nonzero(as_tuple=True)  # token order
            if capacity:
                token, choice = token[:capacity], choice[:capacity]
            y = _swiglu_rows(flat[token], self.experts.w_gate_up[e], self.experts.w_down[e])
            out = out.index_add(0, token, y.to(acc) * route.weights[token, choice, None].to(acc))
        return self._with_shared(flat, out).to(x.dtype).view(shape)


def _run_experts(rows: torch.Tensor, offsets: torch.Tensor, w_gu: torch.Tensor, w_dn: torch.Tensor,
                 impl: str) -> torch.Tensor:
    """rows (R, D) grouped by expert, offsets (E,) int32 group ends (the last = R) -> (R, D): each group through its
    expert's SwiGLU."""
    if impl == "grouped":
        gate, up = torch._grouped_mm(rows, w_gu.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w_dn.transpose(1, 2), offs=offsets)
    if impl != "per_expert":
        raise ValueError(f"impl={impl!r} is not allowed; choose one of: {', '.join(IMPLS)}")
    ends = offsets.tolist()  # a host read: this path is for where no grouped GEMM runs
    pieces, start = [], 0
    for e, end in enumerate(ends):
        pieces.append(_swiglu_rows(rows[start:end], w_gu[e], w_dn[e]))
        start = end
    return torch.cat(pieces)


def _gathered(h: torch.Tensor, experts: torch.Tensor, w_gu: torch.Tensor, w_dn: torch.Tensor) -> torch.Tensor:
    """(N, D) rows, (N, k) expert ids -> (N, k, D): every assignment through its own gathered expert weights."""
    gu = torch.einsum("nd,nkfd->nkf", h, w_gu[experts])  # (N, k, 2F)
    gate, up = gu.chunk(2, dim=-1)
    return torch.einsum("nkf,nkdf->nkd", F.silu(gate) * up, w_dn[experts])


# ---------------------------------------------------------------------------------------------------------------
# A model's feed-forwards


def feed_forward(tier, layer: int) -> nn.Module:
    """Block `layer`'s feed-forward: the tier's SwiGLU MLP, or the mixture of experts when the tier has a MoESpec
    and `layer` is past its dense first layers (both families' blocks build theirs here)."""
    spec = getattr(tier, "moe", None)
    if spec is None or not spec.is_moe_layer(layer):
        return SwiGLU(tier)
    return MoEFeedForward(tier.d_model, spec)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The mixture-of-experts feed-forwards of `model`, in block order; [] for a dense model."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def set_expert_dispatch(model: nn.Module, dispatch: ExpertDispatch) -> None:
    """How every MoE layer of `model` reaches its experts (model/expert_dispatch.py; LOCAL: all of them here). Set
    once, before the first forward, by whatever splits the experts over ranks."""
    for layer in moe_layers(model):
        layer.dispatch = dispatch
