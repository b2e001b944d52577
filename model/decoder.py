"""Llama-style decoder-only transformer that returns hidden states, not logits.

    from model.decoder import build_model
    model = build_model("nano", vocab_size=2000)
    hidden = model(tokens[:, :-1], doc_ids[:, :-1])          # (B, T, D) after the final RMSNorm
    # the loss head is cuda_ops.cross_entropy.linear_cross_entropy(hidden, model.output_weight, ...)

Architecture: token embedding -> n_layers x [x + Attn(RMSNorm(x)), x + SwiGLU(RMSNorm(x))] -> RMSNorm.
No biases; RoPE (rotate-half form) on queries and keys; grouped-query attention when n_kv_heads < n_heads;
the output projection is the token embedding (tied, default) or a separate (V, D) weight.

Packed rows and document masking. A training row packs several documents; `doc_ids` (B, T) int32 says which
document each token belongs to (0-based, non-decreasing along the row). With doc masking on, a token attends
only to earlier tokens of its own document, and RoPE positions restart at 0 at every document start, so a
document's outputs do not depend on its neighbours. Attention backends (`attention=`):
    auto   flex_attention + BlockMask on CUDA with doc masking; SDPA(is_causal) without doc masking;
           a dense boolean (B, 1, T, T) mask through SDPA on CPU with doc masking
    flex   flex_attention (compiled on CUDA; the eager, unfused reference on CPU, for tests only)
    varlen variable-length FlashAttention over the documents laid end to end (torch.nn.attention.varlen,
           torch >= 2.10; bf16/fp16 on CUDA); on CPU one SDPA(is_causal) per document (test path)
    cudnn  SDPA(is_causal) pinned to the cuDNN kernel (CUDA only); plain causal, so doc masking off only
    sdpa   SDPA(is_causal) without doc masking; a dense mask through SDPA with doc masking
    dense  always a dense boolean mask through SDPA (the simple, obviously correct path)
Which of flex / varlen is fastest at 32k is measured by bench/train_speed.py (--attention); `auto` keeps flex
on CUDA until that table says otherwise.

Generation (no doc masking; one prompt per row) with a KV cache:
    cache = model.new_kv_cache(batch_size=B, max_len=P + N, left_pad=pad)   # pad: (B,) int64 or None
    h = model(prompt, kv_cache=cache)                  # prompt (B, P): prefill, keys/values cached
    next_tok = model.logits(h[:, -1]).argmax(-1)       # (B,)
    h = model(next_tok[:, None], kv_cache=cache)       # one new token per row; positions continue
Prompts of different lengths are LEFT-padded to a common length P (any token id in the pad slots) and
`left_pad[b]` gives row b's number of pad tokens: real tokens never attend to pad slots and their RoPE
positions start at 0 at the first real token, so each row matches running its prompt alone. Equal-length
prompts need no left_pad. The cache (model/kv_cache.py) is static: allocated at max_len, in the dtype the keys
are computed in (the autocast dtype under autocast), with its RoPE tables; a one-token call is a fixed-shape
masked step over a bucket of filled slots with split-K attention (`decode_step`; `decode_compute` is its
graph-safe part, what model/decode_loop.py compiles and captures in a CUDA graph), so it never rebuilds an
attention plan, and runs the blocks' submodules eagerly even after `compile_blocks`.
"""
from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from model.context import NOT_SPLIT, ContextMask, RowSplit, attend_gathered, split_mask
from model.kv_cache import KVCache, decode_compute, decode_step
from model.rope import RopeConfig, apply_rope, rope_cos_sin, rope_table  # noqa: F401 (rope_table re-exported)
from model.layers import FEED_FORWARD_WRITERS, RMSNorm, TokenModel, eager_only
from model.moe import feed_forward
from model.tiers import Tier, get_tier

ATTENTION_BACKENDS = ("auto", "flex", "varlen", "cudnn", "sdpa", "dense")

# ----------------------------------------------------------------------------------------------
# Positions and masks from document ids (computed once per forward, shared by every layer)


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int document ids -> (B, T) int64 position of each token within its document (0 at each start)."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)  # (B, T)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # index of the most recent document start at or before each token: a running max over start indices
    start = torch.where(is_start, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, T)
    return idx - start


def dense_mask(doc_ids: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor:
    """Boolean (B, 1, T, T) mask (True = may attend): causal, and same document when doc_ids is given."""
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T) causal
    if doc_ids is None:
        return mask[None, None]  # (1, 1, T, T)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (same_doc & mask)[:, None]  # (B, 1, T, T)


def flex_mask(doc_ids: torch.Tensor | None, T: int, device: torch.device) -> BlockMask:
    """BlockMask for flex_attention: causal, and same document when doc_ids is given."""

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def causal_same_doc(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    on_cuda = torch.device(device).type == "cuda"
    if doc_ids is None:
        return create_block_mask(causal, None, None, T, T, device=device, _compile=on_cuda)
    # _compile on CUDA builds the block mask without materializing a (T, T) grid per row (32k^2 otherwise)
    return create_block_mask(causal_same_doc, doc_ids.shape[0], None, T, T, device=device, _compile=on_cuda)


_compiled_flex = None  # torch.compile(flex_attention), created on first CUDA use


@eager_only
def _flex_attention_eager(q, k, v, *, block_mask: BlockMask, enable_gqa: bool) -> torch.Tensor:
    # Kept out of compiled graphs: inductor's CPU flex template (torch 2.13) returns wrong values when q and k
    # are both computed inside the same graph (RoPE in a compiled block). CPU flex is a test path only.
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def _flex_attention_for(device: torch.device):
    """flex_attention is only fast compiled (eager runs an unfused reference); compile it once, lazily.
    Off CUDA: the eager reference, also inside compiled blocks (see _flex_attention_eager)."""
    global _compiled_flex
    if torch.device(device).type != "cuda":
        return _flex_attention_eager
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


# ----------------------------------------------------------------------------------------------
# Variable-length attention: the documents of a batch laid end to end (no (T, T) mask at all)


def resolve_attention(attention: str, device: torch.device | str, doc_masking: bool) -> str:
    """The backend `attention` runs for a training/eval forward on `device`. auto: flex on CUDA with doc masking
    (on an H100, tier B at 32,768 on web-length documents: flex 424k tokens/s, varlen 98k; bench/results/
    train_speed-nvidia-h100-*), the dense mask on CPU with doc masking, SDPA(is_causal) without doc masking."""
    if attention != "auto":
        return attention
    if not doc_masking:
        return "sdpa"
    return "flex" if torch.device(device).type == "cuda" else "dense"


class DocSpans(NamedTuple):
    """The mask for the varlen backend. cu_seqlens: (N+1,) int32 offsets of the batch's N documents in the
    flattened (B*T) token axis, 0 first and B*T last (a row end is always a document end); max_len: the longest
    document in tokens, a host int (flash-attention sizes its grid with it)."""
    cu_seqlens: torch.Tensor
    max_len: int


def doc_spans(doc_ids: torch.Tensor | None, B: int, T: int, device: torch.device) -> DocSpans:
    """(B, T) document ids (or None: each row is one document) -> DocSpans on `device`.

    With doc_ids the number of documents is data-dependent, so this makes one small device-to-host copy per
    forward (the (B, T) start flags, B*T bytes), before any layer runs; without doc_ids nothing is copied.
    """
    if doc_ids is None:
        return DocSpans(torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device), T)
    is_start = torch.ones(B, T, dtype=torch.bool, device=doc_ids.device)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = is_start.flatten().cpu().nonzero().flatten()  # (N,) flat index of every document start
    cu = torch.cat([starts, torch.tensor([B * T])]).to(torch.int32)  # (N+1,)
    max_len = int((cu[1:] - cu[:-1]).max())
    return DocSpans(cu.to(device, non_blocking=True), max_len)


_VARLEN_CAUSAL: dict = {}  # keyword arguments that ask torch's varlen_attn for causal attention (set lazily)
_varlen_attn = None  # torch.nn.attention.varlen.varlen_attn, imported on first use (it loads torch._dynamo)


def _prepare_varlen(device: torch.device) -> None:
    """Resolve varlen_attn's calling convention once, eagerly (outside compiled blocks): torch 2.10/2.11 take
    is_causal=True and no GQA; later versions a (-1, 0) window and enable_gqa."""
    global _varlen_attn
    if torch.device(device).type != "cuda" or _VARLEN_CAUSAL:
        return
    from torch.nn.attention.varlen import varlen_attn

    _varlen_attn = varlen_attn
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        _VARLEN_CAUSAL.update(window_size=(-1, 0), native_gqa="enable_gqa" in params)
    else:
        _VARLEN_CAUSAL.update(is_causal=True, native_gqa=False)


def _flash_varlen(q, k, v, spans: DocSpans, enable_gqa: bool) -> torch.Tensor:
    """q (N_tok, H, hd), k, v (N_tok, Hkv, hd) bf16/fp16 on CUDA -> (N_tok, H, hd) through flash-attention varlen."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention='varlen' runs flash-attention, which takes bf16/fp16, got {q.dtype}; "
                         "train with precision bf16, or choose attention flex")
    kw = dict(_VARLEN_CAUSAL)
    native_gqa = kw.pop("native_gqa")
    if enable_gqa and native_gqa:
        kw["enable_gqa"] = True
    elif enable_gqa:  # older torch: give every query head its own copy of its key/value head
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = spans.cu_seqlens
    return _varlen_attn(q, k, v, cu, cu, spans.max_len, spans.max_len, **kw)


@eager_only
def _varlen_reference(q, k, v, spans: DocSpans, enable_gqa: bool) -> torch.Tensor:
    """The same contract as _flash_varlen, one SDPA(is_causal) per document: the CPU path and a test oracle.
    Kept out of compiled graphs (a host loop over data-dependent bounds)."""
    bounds = spans.cu_seqlens.tolist()
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        seg = [x[lo:hi].transpose(0, 1) for x in (q, k, v)]  # (heads, n, hd) each
        outs.append(F.scaled_dot_product_attention(*seg, is_causal=True, enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(outs, dim=0)  # (N_tok, H, hd)


def varlen_attention(q, k, v, spans: DocSpans, enable_gqa: bool) -> torch.Tensor:
    """q (B, H, T, hd), k, v (B, Hkv, T, hd) -> (B, H, T, hd): causal attention inside each span of `spans`.

    q, k, v are the transposed views Attention makes of (B, T, heads, hd) tensors, so packing them into the
    (B*T, heads, hd) layout varlen takes is a view, not a copy; so is unpacking the output.
    """
    B, H, T, hd = q.shape
    packed = [x.transpose(1, 2).reshape(B * T, x.shape[1], hd) for x in (q, k, v)]  # (B*T, heads, hd)
    attend = _flash_varlen if q.device.type == "cuda" else _varlen_reference
    return attend(*packed, spans, enable_gqa).view(B, T, H, hd).transpose(1, 2)


CUDNN_CAUSAL = "cudnn_causal"  # the cudnn backend's mask: plain causal attention through SDPA's cuDNN kernel


# RoPE (rope_cos_sin, apply_rope, rope_table) is in model/rope.py; the static KVCache and the one-token decode
# step are in model/kv_cache.py (both imported above).


# ----------------------------------------------------------------------------------------------
# The blocks


class Attention(nn.Module):
    def __init__(self, tier: Tier):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = tier.n_heads, tier.n_kv_heads, tier.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.wqkv = nn.Linear(tier.d_model, q_dim + 2 * kv_dim, bias=False)  # one matmul for q, k, v
        self.wo = nn.Linear(q_dim, tier.d_model, bias=False)

    def forward(self, x, cos, sin, mask, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q = apply_rope(q.view(B, T, H, hd), cos, sin).transpose(1, 2)  # (B, H, T, hd)
        k = apply_rope(k.view(B, T, Hkv, hd), cos, sin).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, Hkv, hd).transpose(1, 2)  # (B, Hkv, T, hd)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)  # (B, Hkv, S, hd), S = cached + T
        gqa = H != Hkv
        if isinstance(mask, ContextMask):  # a row split over ranks: against every rank's K and V (model/context.py)
            y = attend_gathered(q, k, v, mask, lambda q_, k_, v_: self._attend(q_, k_, v_, mask.mask, gqa))
        else:
            y = self._attend(q, k, v, mask, gqa)
        y = y.transpose(1, 2).reshape(B, T, H * hd)  # (B, T, H * hd)
        return self.wo(y)

    def _attend(self, q, k, v, mask, gqa: bool) -> torch.Tensor:
        """q (B, H, Tq, hd), k, v (B, Hkv, Tk, hd) -> (B, H, Tq, hd) through the backend `mask` names."""
        H, Hkv = q.shape[1], k.shape[1]
        if isinstance(mask, BlockMask):
            y = _flex_attention_for(q.device)(q, k, v, block_mask=mask, enable_gqa=gqa)
        elif isinstance(mask, DocSpans):
            y = varlen_attention(q, k, v, mask, gqa)  # (B, H, T, hd)
        elif isinstance(mask, str) and mask == CUDNN_CAUSAL:
            if gqa:  # expanded here so the cuDNN kernel never has to support GQA itself
                k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # mask None: causal when queries and keys line up, else one new token that sees the whole cache
            is_causal = mask is None and q.size(2) == k.size(2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
        return y


class Block(nn.Module):
    def __init__(self, tier: Tier, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(tier.d_model, tier.norm_eps)
        self.attn = Attention(tier)
        self.mlp_norm = RMSNorm(tier.d_model, tier.norm_eps)
        self.mlp = feed_forward(tier, layer)  # SwiGLU, or the mixture of experts (model/moe.py)

    def forward(self, x, cos, sin, mask, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, kv_cache, layer)  # (B, T, D)
        return x + self.mlp(self.mlp_norm(x))


# ----------------------------------------------------------------------------------------------
# The model


class Decoder(TokenModel):
    """Token ids (B, T) -> hidden states (B, T, D) after the final RMSNorm; see the module docstring.
    Under bf16 autocast the residual stream stays fp32 (embeddings and norm weights are fp32), so the
    hidden states come out fp32 while the matmuls inside run in bf16."""

    RESIDUAL_WRITERS = ("attn.wo.weight", *FEED_FORWARD_WRITERS)
    CONTEXT_LAYOUT = "balanced"  # a row split over ranks: dealt in a snake order, even causal work (model/context.py)

    def __init__(self, tier: Tier, vocab_size: int, *, tie_embeddings: bool = True, doc_masking: bool = True,
                 attention: str = "auto", activation_checkpointing: str = "none", rope: RopeConfig | None = None):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention={attention!r} is not allowed; choose one of: {', '.join(ATTENTION_BACKENDS)}")
        if attention == "cudnn" and doc_masking:
            raise ValueError("attention='cudnn' computes plain causal attention (torch's cuDNN kernel takes no "
                             "document mask at 32k); set doc_masking off, or choose attention varlen or flex")
        if tier.d_model % tier.n_heads or tier.n_heads % tier.n_kv_heads or tier.head_dim % 2:
            raise ValueError(f"tier {tier.name}: d_model must split into n_heads even-sized heads and n_heads "
                             "must be a multiple of n_kv_heads")
        self.tier, self.vocab_size = tier, vocab_size
        self.tie_embeddings, self.doc_masking, self.attention = tie_embeddings, doc_masking, attention
        # RoPE base and scaling (model/rope.py): not weights, so a checkpoint carries over to other settings
        self.rope = rope if rope is not None else RopeConfig(theta=tier.rope_base)
        self._build_shell(tier, vocab_size, tie_embeddings, activation_checkpointing, Block)
        self.init_weights()

    def new_kv_cache(self, batch_size: int, max_len: int, left_pad: torch.Tensor | None = None, *,
                     dtype: torch.dtype | None = None) -> KVCache:
        """A static cache on the model's device, allocated here at max_len. dtype defaults to the dtype the keys
        will be computed in: the autocast dtype when autocast is on for that device (create the cache inside the
        autocast region), else the model's."""
        weight = self.output_weight
        if dtype is None:
            autocast = torch.is_autocast_enabled(weight.device.type)
            dtype = torch.get_autocast_dtype(weight.device.type) if autocast else weight.dtype
        t = self.tier
        return KVCache(t.n_layers, batch_size, max_len, left_pad, n_kv_heads=t.n_kv_heads, head_dim=t.head_dim,
                       rope=self.rope, dtype=dtype, device=weight.device)

    def decode_step(self, tok: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """tok (B,) int64, one new token per row -> hidden (B, D): the fixed-shape step of model/kv_cache.py
        (what `self(tok[:, None], kv_cache=cache)` runs, without the sequence axis)."""
        return decode_step(self, tok, kv_cache)

    def decode_compute(self, tok: torch.Tensor, kv_cache: KVCache, span: int | None = None) -> torch.Tensor:
        """The graph-safe part of `decode_step` (model/kv_cache.py): advances only device state, attends over
        `span` slots (default kv_cache.decode_span()); the caller keeps kv_cache.length."""
        return decode_compute(self, tok, kv_cache, span)

    def _mask(self, doc_ids: torch.Tensor | None, T: int, device: torch.device, B: int = 1):
        """The attention mask for a training/eval forward: None (SDPA is_causal), dense tensor, BlockMask,
        DocSpans (varlen) or CUDNN_CAUSAL."""
        backend = resolve_attention(self.attention, device, doc_masking=doc_ids is not None)
        if backend == "varlen":
            _prepare_varlen(device)
            return doc_spans(doc_ids, B, T, device)
        if backend == "cudnn":
            if device.type != "cuda":
                raise ValueError("attention='cudnn' needs a CUDA device (SDPA's cuDNN kernel); on CPU choose "
                                 "attention auto, sdpa or dense")
            return CUDNN_CAUSAL
        if backend == "flex":
            _flex_attention_for(device)  # create the compiled kernel here, outside any compiled block
            return flex_mask(doc_ids, T, device)
        if backend == "sdpa" and doc_ids is None:
            return None
        return dense_mask(doc_ids, T, device)

    def _split_mask(self, doc_ids: torch.Tensor | None, T: int, device: torch.device, context: RowSplit):
        """The ContextMask of a row split over ranks: flex where auto picks it (CUDA), else a dense boolean mask."""
        backend = resolve_attention(self.attention, device, doc_masking=doc_ids is not None)
        if backend in ("varlen", "cudnn"):
            raise ValueError(f"attention={backend!r} cannot attend across a row split over ranks (context "
                             "parallelism); choose attention auto, flex, sdpa or dense")
        if backend == "flex":
            _flex_attention_for(device)
        return split_mask(doc_ids, T, context, device, flex=backend == "flex")

    def forward(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, context: RowSplit = NOT_SPLIT) -> torch.Tensor:
        """idx (B, T) int64, doc_ids (B, T) int32 or None -> hidden states (B, T, D) after the final RMSNorm.
        context (model/context.py): a row split over ranks; idx and doc_ids are then the whole row and the output
        holds this rank's tokens, (B, T / context.degree, D) in context.positions(T) order."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if doc_ids is not None and doc_ids.shape != idx.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} must equal idx shape {tuple(idx.shape)}")
        if kv_cache is not None:
            if doc_ids is not None:
                raise ValueError("generation with a KV cache has no document masking; pass doc_ids=None")
            if context.degree > 1:
                raise ValueError("generation runs on one rank: a KV cache takes no row split (context)")
            if T == 1:
                return decode_step(self, idx[:, 0], kv_cache)[:, None]  # (B, 1, D): the static decode step
            positions, mask = kv_cache.positions_and_mask(B, T, idx.device)
            cos, sin = kv_cache.rope(positions)  # (B|1, T, 1, hd/2) in the cache dtype
        else:
            if not self.doc_masking:
                doc_ids = None
            positions = doc_positions(doc_ids) if doc_ids is not None else torch.arange(T, device=idx.device)[None]
            if context.degree > 1:  # positions and masks of the whole row; this rank's tokens of it from here on
                mask = self._split_mask(doc_ids, T, idx.device, context)
                local = context.positions(T, idx.device)
                idx, positions = idx[:, local], positions[:, local]  # (B, T/d), (B|1, T/d)
            else:
                mask = self._mask(doc_ids, T, idx.device, B)
            cos, sin = rope_cos_sin(positions, self.tier.head_dim, self.rope)  # (B|1, T, 1, hd/2)

        x = self.tok_emb(idx)  # (B, T, D)
        for i, block in enumerate(self.blocks):
            if kv_cache is not None:
                x = block.forward(x, cos, sin, mask, kv_cache, i)  # .forward: eager even if compiled
            elif self.training and i in self.checkpointed and torch.is_grad_enabled():
                kept = mask._replace(keep_gathered=True) if isinstance(mask, ContextMask) else mask
                x = checkpoint(block, x, cos, sin, kept, use_reentrant=False)  # recompute in backward
            else:
                x = block(x, cos, sin, mask)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm(x)  # (B, T, D)


def build_model(tier_name: "str | Tier", vocab_size: int, *, mixer: str = "attention", rope: RopeConfig | None = None,
                **kw) -> nn.Module:
    """Decoder for the tier (model/tiers.py: its name, or the Tier/ResonanceTier itself as an engine that resolved it
    once passes it); rope: the RoPE base and scaling (model/rope.py; None = the
    tier's base, unscaled); kw: tie_embeddings, doc_masking, attention, activation_checkpointing. mixer="resonance"
    builds model/resonance.py's ResonanceLM of that name instead (the same forward, generation and loss-head
    interface); it has no positions to rotate, so `rope` does not apply to it (pipeline/train/engine.py
    model_rope says so once)."""
    if mixer == "resonance":
        from model.resonance import build_resonance_model  # imports this module: resolved lazily

        return build_resonance_model(tier_name, vocab_size, **kw)
    if mixer != "attention":
        raise ValueError(f"mixer={mixer!r} is not allowed; choose attention or resonance")
    return Decoder(get_tier(tier_name) if isinstance(tier_name, str) else tier_name, vocab_size, rope=rope, **kw)
