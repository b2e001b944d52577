"""Training FLOPs per token for a tier: the numerator of model-FLOPs utilization (MFU).

    from model.flops import flops_per_token
    flops_per_token(get_tier("B"), seq_len=32768, vocab_size=32000)   # FLOPs per token, causal-equivalent
    pairs = within_document_causal_pairs(doc_ids)                      # (B, T) -> 0-dim int64, on the device
    executed = training_flops(tier, vocab_size, tokens=B * T, attention_pairs=pairs)   # what was computed

Counting convention (PaLM appendix B, halved attention for causality):
  * every weight matrix used in a matmul costs 2 FLOPs per parameter per token forward and 4 backward
    (gradients w.r.t. inputs and w.r.t. weights): 6 * matmul_params. The output projection (V x D) is a
    matmul whether or not it is tied to the embedding; the embedding lookup is not a matmul and costs 0.
  * attention: every (query, key) pair that is computed costs 2 * head_dim FLOPs for its QK^T score and
    2 * head_dim for its share of AV, per head and layer, forward; x3 for fwd + bwd: 12 * L * n_heads * head_dim
    per pair (`attention_flops_per_pair`). Which pairs are computed is the convention that matters:
      - executed (what `train/mfu` counts): causal pairs inside each document, sum over documents of
        n(n+1)/2 (`within_document_causal_pairs`, from the batch's doc_ids, on the device). Without document
        masking a row is one document of T tokens: T(T+1)/2 pairs.
      - causal-equivalent (`train/mfu_causal_equiv`, and `flops_per_token` below): half of the whole T x T row,
        T^2/2 pairs, i.e. 6 * L * (n_heads * head_dim) * T per token whatever the documents are (this
        project's figure before doc-aware counting). With document masking it overstates the work (only
        within-document pairs are computed); without it the two differ by T/2 pairs per row (1/T of the
        attention term). nanoGPT and torchtitan count the full T x T square (12 * L * H * hd * T per token,
        no causal halving), twice this attention term, so their MFU reads higher still at long context.
Norms, RoPE, softmax and the SwiGLU product are elementwise and left out (a few percent at most).

Mixture of experts (a tier with a MoESpec, model/moe.py): a token runs its k routed experts, the shared experts and
the router, so the FLOPs count the ACTIVE matmul parameters (`matmul_params(..., active=True)`, the default): per MoE
layer k x 3 D F + 3 D F_shared + D (the shared gate) + E D (the router), where a dense layer has 3 D d_ff. Memory
counts every parameter (`param_count`: E x 3 D F per MoE layer). With a capacity factor a dropped assignment runs no
expert; the training engine subtracts the dropped assignments' 6 x 3 D F from the executed FLOPs it reports.
"""
from __future__ import annotations

import torch

from model.tiers import ResonanceTier, Tier


def feed_forward_params(tier: Tier | ResonanceTier, active: bool = False) -> int:
    """The feed-forwards' matmul parameters summed over the layers: 3 D d_ff per dense layer; per MoE layer the
    router (E D), the experts (E x 3 D F in total, k of them active), the shared experts (3 D F_shared) and their
    gate (D)."""
    d, spec = tier.d_model, getattr(tier, "moe", None)
    if spec is None:
        return tier.n_layers * 3 * d * tier.d_ff
    dense = spec.dense_first_layers * 3 * d * tier.d_ff
    experts = spec.experts_per_token if active else spec.num_experts
    shared = 3 * d * spec.shared_ffn + (d if spec.shared_experts else 0)
    per_moe = spec.num_experts * d + experts * 3 * d * spec.expert_ffn + shared
    return dense + spec.moe_layers(tier.n_layers) * per_moe


def expert_params(tier: Tier | ResonanceTier) -> int:
    """Parameters of the routed experts (all layers): what expert parallelism splits over its ranks; 0 if dense."""
    spec = getattr(tier, "moe", None)
    return 0 if spec is None else spec.moe_layers(tier.n_layers) * spec.num_experts * 3 * tier.d_model * spec.expert_ffn


def matmul_params(tier: Tier, vocab_size: int, active: bool = True) -> int:
    """Parameters that take part in a token's matmuls: q/k/v/o and the feed-forward (the three SwiGLU matrices, or
    a MoE layer's active ones; active=False: every expert) of every layer, plus the (V, D) output projection."""
    d, hd = tier.d_model, tier.head_dim
    attn = d * tier.n_heads * hd + 2 * d * tier.n_kv_heads * hd + tier.n_heads * hd * d  # wq, wk, wv, wo
    return tier.n_layers * attn + feed_forward_params(tier, active) + vocab_size * d


def param_count(tier: Tier | ResonanceTier, vocab_size: int, tie_embeddings: bool = True) -> int:
    """Exact parameter count of the model build_model makes for `tier` (either family), without building it:
    the matmul weights (output projection included), the RMSNorm weights (two per block, the resonance block's
    per-group norm, the final norm), the resonance mixer's per-channel eigenvalue parameters (alpha, omega,
    log_dt), and a separate (V, D) embedding when untied. Building even on the meta device costs ~2 CPU-s (its
    initialisation imports torch._dynamo), paid in every run and sweep trial that logs the count;
    tests/model/test_flops_and_cli.py checks this equals `build_model(...).num_params()` for every tier."""
    d = tier.d_model
    if isinstance(tier, ResonanceTier):
        matmul = resonance_matmul_params(tier, vocab_size, active=False)
        per_layer = 2 * d + tier.group_dim + 3 * tier.eigen_per_layer
    else:
        matmul = matmul_params(tier, vocab_size, active=False)
        per_layer = 2 * d
    return matmul + tier.n_layers * per_layer + d + (0 if tie_embeddings else vocab_size * d)


def active_param_count(tier: Tier | ResonanceTier, vocab_size: int, tie_embeddings: bool = True) -> int:
    """The parameters one token uses: param_count less the routed experts it does not run (= param_count for a
    dense tier). What "equal active parameters" compares between a dense and a MoE model."""
    total = param_count(tier, vocab_size, tie_embeddings)
    return total - (feed_forward_params(tier, active=False) - feed_forward_params(tier, active=True))


def flops_per_token(tier: Tier, seq_len: int, vocab_size: int, tie_embeddings: bool = True) -> float:
    """Training (forward + backward = 3 x forward) FLOPs per token at context `seq_len`.

    tie_embeddings does not change the count (the output projection is a matmul either way, the embedding
    lookup never is); it is accepted so callers can pass the model config through unchanged.
    """
    del tie_embeddings
    attention = 6 * tier.n_layers * tier.n_heads * tier.head_dim * seq_len
    return float(6 * matmul_params(tier, vocab_size) + attention)


# ----------------------------------------------------------------------------------------------
# Attention FLOPs from the documents of a batch (what `train/mfu` counts)


def attention_flops_per_pair(tier: Tier) -> int:
    """Training FLOPs of one computed (query, key) pair, summed over heads and layers: 4 * head_dim forward
    (2 for the QK^T score, 2 for the AV sum) per head, x3 for forward + backward."""
    return 12 * tier.n_layers * tier.n_heads * tier.head_dim


def causal_pairs(seq_len: int) -> int:
    """(query, key) pairs with key <= query in one row of seq_len tokens: T(T+1)/2 (the diagonal included)."""
    return seq_len * (seq_len + 1) // 2


def within_document_causal_pairs(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) int, non-decreasing along each row -> 0-dim int64 tensor on doc_ids' device: the number of
    (query, key) pairs with key <= query in the same document, summed over rows = sum over documents of n(n+1)/2.

    Computed as sum over tokens of (position within its document + 1), the number of keys each query sees.
    Device ops only (no .item(), no data-dependent shapes): on CUDA it queues behind the step without a host sync.
    """
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)  # (B, T)
    is_start = torch.ones(B, T, dtype=torch.bool, device=doc_ids.device)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(is_start, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, T) index of doc start
    return (idx - start + 1).sum(dtype=torch.int64)


def matmul_flops_per_token(tier: Tier, vocab_size: int) -> int:
    """Training FLOPs per token outside attention's score/AV products: 6 x matmul parameters."""
    return 6 * matmul_params(tier, vocab_size)


def training_flops(tier: Tier, vocab_size: int, tokens, attention_pairs):
    """FLOPs actually computed for `tokens` trained tokens whose attention computed `attention_pairs` pairs
    (ints, or tensors: the result is then a tensor on their device, with no host sync)."""
    return matmul_flops_per_token(tier, vocab_size) * tokens + attention_flops_per_pair(tier) * attention_pairs


# ----------------------------------------------------------------------------------------------
# The resonance family (model/resonance.py, model.mixer=resonance)
#
# Matmuls as above: w_in (2D x D), w_out (D x D), the SwiGLU matrices, the output projection, and the mixer's
# complex input/output weights, which are real matmuls too: z = u @ (B_re, B_im) and Re(c . s) = s.re @ C_re -
# s.im @ C_im, 4 * D * K weights per layer (K eigenvalues per group, D / G channels per group). What is left is
# the complex core on G * K channels per layer, counted in real FLOPs per token, forward:
#   fft   FFT and inverse FFT of length 2T (5 N log2 N each, the usual count for a complex FFT), the product of
#         the 2T spectra (6 per bin), and the kernel's FFT once per row: 30 log2(2T) + 12 per channel (the
#         kernel's share is per row, so this is exact at batch 1 and slightly over at larger batches);
#   scan  ceil(log2 chunk) Hillis-Steele steps of a complex multiply-add (8) and a multiply (6), then the
#         incoming chunk state (8): 14 ceil(log2 chunk) + 8 per channel; the scan across chunks is O(T / chunk).
#         This is the torch reference (CPU, or LONGTRAIN_KERNELS=reference).
#   kernel the Numba scan of cuda_ops/resonance_scan.py, counted as executed: forward 14 (reduce: the state's
#         complex multiply-add and the chunk product's complex multiply) + 8 (apply: the multiply-add) = 22;
#         backward 12 (reduce: two conjugate multiplies) + 26 (apply: adjoint add, conj(z) Q and Q's update,
#         the carry multiply) = 38; 60 for training, independent of T and of the chunk length.
# Training is 3x forward, as for matmuls, except the kernel's executed 60. The FFT grows like log T, the scans not
# at all with T: this is the point of the family.


def resonance_matmul_params(tier: ResonanceTier, vocab_size: int, active: bool = True) -> int:
    """Parameters that take part in a token's matmuls in a resonance model (see above; active=False: every expert of
    a MoE tier), output projection included."""
    d = tier.d_model
    per_layer = 3 * d * d + 4 * d * tier.n_eigen
    return tier.n_layers * per_layer + feed_forward_params(tier, active) + vocab_size * d


KERNEL_FORWARD_FLOPS, KERNEL_TRAINING_FLOPS = 22, 60  # per channel and token, see above


def resonance_core_flops_per_token(tier: "ResonanceTier", seq_len: int, form: str) -> float:
    """Forward FLOPs per token of the complex core (all layers) in the `fft`, `scan` or `kernel` form."""
    import math

    channels = tier.n_groups * tier.n_eigen
    if form == "fft":
        per_channel = 30 * math.log2(2 * seq_len) + 12
    elif form == "scan":
        per_channel = 14 * math.ceil(math.log2(max(2, tier.chunk_size))) + 8
    elif form == "kernel":
        per_channel = KERNEL_FORWARD_FLOPS
    else:
        raise ValueError(f"form={form!r}: choose fft, scan or kernel")
    return float(tier.n_layers * channels * per_channel)


def resonance_flops_per_token(tier: "ResonanceTier", seq_len: int, vocab_size: int, doc_masking: bool = True,
                              form: str | None = None) -> float:
    """Training FLOPs per token of a resonance model. form: what the core runs (ResonanceLM.training_form:
    fft, scan or kernel); None means the reference's choice, the scan with document masking and the FFT without."""
    form = form or ("scan" if doc_masking else "fft")
    if form == "kernel":
        core = tier.n_layers * tier.n_groups * tier.n_eigen * KERNEL_TRAINING_FLOPS
    else:
        core = 3 * resonance_core_flops_per_token(tier, seq_len, form)
    return float(6 * resonance_matmul_params(tier, vocab_size) + core)
