"""Which transformers architecture holds a mixture-of-experts model of the attention family, and its weights there.

    arch = moe_architecture(tier)          # "MixtralForCausalLM" | "Qwen2MoeForCausalLM", or UnrepresentableMoE
    config.update(moe_config(tier, arch))
    weights.update(moe_block_weights(state, tier, arch, layer))   # one block's feed-forward, per-expert names

The attention, norms, RoPE and embeddings are Llama's in both (pipeline/train/handoff/hf_export.py maps them); what
differs is the feed-forward (model/moe.py), and the architectures represent it exactly as follows:

  Mixtral    softmax router in fp32 over E experts, top-k, renormalised; SwiGLU experts; no shared expert, every
             block a MoE block. Ours without shared experts, without dense first layers, renormalised.
  Qwen2-MoE  the same router with `norm_topk_prob` (renormalised or not), SwiGLU experts of moe_intermediate_size,
             one shared SwiGLU expert of shared_expert_intermediate_size gated by sigmoid(shared_expert_gate . x)
             (ours: shared_experts x expert_ffn wide, the same gate), and dense blocks named in mlp_only_layers
             (ours: the first dense_first_layers, of the tier's d_ff). Its attention has q/k/v biases unless
             qkv_bias=false, which the export writes. Every Qwen2-MoE MoE block has a shared expert, so a model with
             dense first layers or unnormalised routing and no shared experts has no exact home: refused.
  Qwen3-MoE has no shared expert and normalises queries and keys (q_norm, k_norm), which our attention does not:
             never the target. DeepSeek-V3 routes by sigmoid scores with multi-head latent attention: never either.

Refused, with the reason: a selection bias (model.moe_balance=bias: it changes which experts a token runs, and
neither architecture adds one to the scores). A capacity factor is training-only (evaluation and generation are
dropless), so it exports. Weights are written in the per-expert layout the Hub's checkpoints use
(`block_sparse_moe.experts.<e>.w1/w2/w3` for Mixtral, `mlp.experts.<e>.gate_proj/up_proj/down_proj` for Qwen2-MoE),
which transformers 4.x loads as it is and 5.x converts to its fused experts on load.
"""
from __future__ import annotations

from typing import Any

import torch

MIXTRAL, QWEN2_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM"


class UnrepresentableMoE(ValueError):
    """No transformers architecture holds this mixture of experts exactly; the message says why."""


def moe_architecture(tier) -> str:
    """The transformers class that represents `tier`'s MoESpec exactly (module docstring), or UnrepresentableMoE."""
    spec = tier.moe
    if spec.selection_bias:
        raise UnrepresentableMoE("its experts are chosen with a selection bias (model.moe_balance=bias), which no "
                                 "transformers MoE architecture adds to the router's scores (Mixtral, Qwen2-MoE), so "
                                 "it would run other experts there; train with model.moe_balance=aux to export")
    if not spec.shared_experts and not spec.dense_first_layers and spec.renormalize:
        return MIXTRAL
    if spec.shared_experts:
        return QWEN2_MOE
    what = "dense first layers" if spec.dense_first_layers else "top-k weights without renormalisation"
    raise UnrepresentableMoE(f"it has {what} and no shared experts: Mixtral has neither, and every Qwen2-MoE MoE "
                             f"block has a shared expert; set model.shared_experts >= 1, or drop the {what}")


def moe_config(tier, arch: str) -> dict[str, Any]:
    """config.json keys of `arch` for tier's MoESpec (replacing the Llama ones they differ in)."""
    spec = tier.moe
    common = {"num_experts_per_tok": spec.experts_per_token, "output_router_logits": False,
              "router_aux_loss_coef": 0.0}
    if arch == MIXTRAL:
        return {**common, "architectures": [MIXTRAL], "model_type": "mixtral", "num_local_experts": spec.num_experts,
                "intermediate_size": spec.expert_ffn, "router_jitter_noise": 0.0, "sliding_window": None}
    return {**common, "architectures": [QWEN2_MOE], "model_type": "qwen2_moe", "num_experts": spec.num_experts,
            "moe_intermediate_size": spec.expert_ffn, "shared_expert_intermediate_size": spec.shared_ffn,
            "intermediate_size": tier.d_ff, "decoder_sparse_step": 1, "norm_topk_prob": spec.renormalize,
            "mlp_only_layers": list(range(spec.dense_first_layers)), "qkv_bias": False, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": tier.n_layers}


def _swiglu(prefix: str, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> dict[str, torch.Tensor]:
    gate, up = w_gate_up.chunk(2, dim=0)  # rows: gate | up
    return {f"{prefix}.gate_proj.weight": gate, f"{prefix}.up_proj.weight": up, f"{prefix}.down_proj.weight": w_down}


def expected_block_keys(tier, layer: int) -> set[str]:
    """Our state-dict keys of block `layer`'s feed-forward (model/moe.py, model/layers.py)."""
    spec, src = tier.moe, f"blocks.{layer}.mlp."
    if not spec.is_moe_layer(layer):
        return {src + "w_gate_up.weight", src + "w_down.weight"}
    keys = {src + "router.weight", src + "experts.w_gate_up", src + "experts.w_down"}
    if spec.shared_experts:
        keys |= {src + "shared.w_gate_up.weight", src + "shared.w_down.weight", src + "shared_gate.weight"}
    if spec.selection_bias:
        keys.add(src + "expert_bias")
    return keys


def moe_block_weights(state: dict[str, torch.Tensor], tier, arch: str, layer: int) -> dict[str, torch.Tensor]:
    """Block `layer`'s feed-forward in `arch`'s names (per expert, the Hub's layout)."""
    spec, src, dst = tier.moe, f"blocks.{layer}.mlp.", f"model.layers.{layer}."
    if not spec.is_moe_layer(layer):  # a dense first layer: Qwen2-MoE's mlp_only_layers, Llama's names
        return _swiglu(dst + "mlp", state[src + "w_gate_up.weight"], state[src + "w_down.weight"])
    w_gate_up, w_down = state[src + "experts.w_gate_up"], state[src + "experts.w_down"]  # (E, 2F, D), (E, D, F)
    out: dict[str, torch.Tensor] = {}
    if arch == MIXTRAL:
        moe = dst + "block_sparse_moe."
        out[moe + "gate.weight"] = state[src + "router.weight"]
        for e in range(spec.num_experts):
            gate, up = w_gate_up[e].chunk(2, dim=0)
            out.update({f"{moe}experts.{e}.w1.weight": gate, f"{moe}experts.{e}.w3.weight": up,
                        f"{moe}experts.{e}.w2.weight": w_down[e]})
        return out
    moe = dst + "mlp."
    out[moe + "gate.weight"] = state[src + "router.weight"]
    for e in range(spec.num_experts):
        out.update(_swiglu(f"{moe}experts.{e}", w_gate_up[e], w_down[e]))
    out.update(_swiglu(moe + "shared_expert", state[src + "shared.w_gate_up.weight"],
                       state[src + "shared.w_down.weight"]))
    out[moe + "shared_expert_gate.weight"] = state[src + "shared_gate.weight"]
    return out
