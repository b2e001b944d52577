"""Training FLOPs per token for a tier: the numerator of model-FLOPs utilization (MFU).

    from model.flops import flops_per_token
    flops_per_token(get_tier("B"), seq_len=32768, vocab_size=32000)   # FLOPs per trained token

Counting convention (PaLM appendix B, halved attention for causality):
  * every weight matrix used in a matmul costs 2 FLOPs per parameter per token forward and 4 backward
    (gradients w.r.t. inputs and w.r.t. weights): 6 * matmul_params. The output projection (V x D) is a
    matmul whether or not it is tied to the embedding; the embedding lookup is not a matmul and costs 0.
  * attention scores QK^T and the weighted sum AV each cost 2 * T * (n_heads * head_dim) FLOPs per token
    forward for a full T x T score matrix, so 12 * L * (n_heads * head_dim) * T for fwd + bwd. A causal mask
    leaves half the matrix, so we count 6 * L * (n_heads * head_dim) * T. Document masking skips more (only
    within-document pairs are computed), but MFU conventionally counts the causal figure for the row length.
Norms, RoPE, softmax and the SwiGLU product are elementwise and left out (a few percent at most).
"""
from __future__ import annotations

from model.tiers import Tier


def matmul_params(tier: Tier, vocab_size: int) -> int:
    """Parameters that take part in matmuls: q/k/v/o and the three SwiGLU matrices of every layer, plus
    the (V, D) output projection."""
    d, hd = tier.d_model, tier.head_dim
    attn = d * tier.n_heads * hd + 2 * d * tier.n_kv_heads * hd + tier.n_heads * hd * d  # wq, wk, wv, wo
    mlp = 3 * d * tier.d_ff  # gate, up, down
    return tier.n_layers * (attn + mlp) + vocab_size * d


def flops_per_token(tier: Tier, seq_len: int, vocab_size: int, tie_embeddings: bool = True) -> float:
    """Training (forward + backward = 3 x forward) FLOPs per token at context `seq_len`.

    tie_embeddings does not change the count (the output projection is a matmul either way, the embedding
    lookup never is); it is accepted so callers can pass the model config through unchanged.
    """
    del tie_embeddings
    attention = 6 * tier.n_layers * tier.n_heads * tier.head_dim * seq_len
    return float(6 * matmul_params(tier, vocab_size) + attention)
