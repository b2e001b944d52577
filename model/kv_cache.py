"""The static KV cache of model/decoder.py and its one-token decode step.

    cache = model.new_kv_cache(batch_size=B, max_len=P + N, left_pad=pad)   # every buffer allocated here, once
    h = model(prompt, kv_cache=cache)                 # prefill (B, P): eager, any length
    h = model.decode_step(tok, cache)                 # tok (B,) -> (B, D); the same as model(tok[:, None], ...)

Why static. Decoding one token at a time with a cache that grows by one slot per step gives every step new
shapes: a new cuDNN attention plan per key length (78% of the time in the first H100 run), a new allocation per
step, and a recompile per step under torch.compile. Here the cache is one (B, n_kv_heads, slots, hd) buffer per
layer for keys and one for values, allocated zeroed once (slots = max_len rounded up to SPAN_QUANTUM); a decode
step writes its key/value at slot `pos` (a device tensor) and attends over the first `span` slots. The step reads no
Python state that changes, so it can be captured in a CUDA graph and replayed (model/decode_loop.py does that on
CUDA) and a torch.compile'd step does not recompile while its span stays (tests/model/test_kv_cache.py checks that on
CPU).

What a step writes. A step must write its new keys and values (B x n_layers x 2 x n_kv_heads x hd) and the logits;
nothing it writes should grow with the cache (bench/decode_step_counts.py counts it, tests/model/test_decode_counts.py
holds it). So the visibility of every slot is state, not recomputed: `key_bias` (B, 1, 1, slots) in the cache dtype
is 0 on a slot a row may attend to and -inf elsewhere (empty slots, left pads); the eager calls that fill slots
(prefill, chunks) open them, and a decode step opens its own slot `pos` (B values) before attending.

Two attention paths for the one new token (`cache.attention`, chosen at construction by `decode_attention`):
    fused    F.scaled_dot_product_attention over the span with key_bias as its mask: one op, which writes only its
             (B, H, 1, hd) output (on CPU the flash kernel; on CUDA the memory-efficient kernel, one block per row
             and head). Chosen on CPU, and on CUDA when the batch's (row, key head) pairs fill every SM.
    split_k  flash-decoding by hand for small batches on CUDA, where one block per (row, head) would leave most SMs
             idle over a long cache: the scores are one batched matmul tiled along the keys, and the probabilities
             times values one matmul per chunk of SPAN_QUANTUM slots (batched), summed in fp32, so every SM works on
             a share of a long cache even at batch 1. It writes the scores and probabilities (B x H x span x ~6 B a
             layer compiled): about 1 % of the keys and values the step reads (hd = 128, bf16).

Span buckets. `cache.decode_span()` is the number of slots the next step reads: the filled length + 1 rounded up to
a bucket (a multiple of max(SPAN_QUANTUM, 2**(floor(log2 n) - 3))), so a step reads at most ~12.5% more than the
filled slots, and a generation crosses a few buckets: one graph per bucket. With a 32,768-token prompt and 128 new
tokens a step reads at most 32,896 slots; after a 32-token prompt, 256.

State. `length` (host int) and `pos` (a (1,) int64 device tensor) both count the filled slots, pad slots
included. Eager calls (prefill, chunks, `decode_step`) advance both; `decode_compute`, the graph-safe part,
advances only `pos`, and whoever replays it keeps `length` in step (see model/decode_loop.py).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from model.rope import RopeConfig, apply_rope, rope_table

SPAN_QUANTUM = 256  # slots per split-K chunk; spans and the allocated slots are multiples of it
FUSED, SPLIT_K = "fused", "split_k"  # the decode attention paths (module docstring)


def decode_attention(batch_size: int, n_kv_heads: int, device: torch.device) -> str:
    """The decode attention path for a cache: FUSED on CPU, and on CUDA when batch x key heads reaches the SM count
    (the fused kernel runs one block per row and head: fewer pairs leave SMs idle); SPLIT_K below that."""
    if device.type != "cuda":
        return FUSED
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return FUSED if batch_size * n_kv_heads >= sms else SPLIT_K


def span_bucket(n: int, limit: int) -> int:
    """Slots a step reads when n slots are filled (n >= 1): n rounded up to a multiple of
    max(SPAN_QUANTUM, 2**(floor(log2 n) - 3)), at most `limit` (a multiple of SPAN_QUANTUM)."""
    grain = max(SPAN_QUANTUM, 1 << max(n.bit_length() - 4, 0))
    return min(-(-n // grain) * grain, limit)


class KVCache:
    """Keys/values of every layer for incremental decoding, preallocated to max_len.

    k, v: lists of n_layers buffers (B, n_kv_heads, slots, head_dim) in `dtype` (the dtype the keys are computed
    in: the model's, or the autocast dtype), slots = max_len rounded up to SPAN_QUANTUM (the extra slots are never
    visible). left_pad: optional (B,) int64, the number of left-pad tokens at the start of each row's prompt.
    cos/sin: (slots, head_dim/2) RoPE tables in `dtype`, from `rope` (a RopeConfig, or a bare base).
    key_bias: (B, 1, 1, slots) in `dtype`, 0 on the slots a decode step may attend to, -inf elsewhere.
    attention: FUSED or SPLIT_K (decode_attention's choice; may be set before the first decode step).
    """

    def __init__(self, n_layers: int, batch_size: int, max_len: int, left_pad: torch.Tensor | None = None, *,
                 n_kv_heads: int, head_dim: int, rope: RopeConfig | float, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if left_pad is not None and tuple(left_pad.shape) != (batch_size,):
            raise ValueError(f"left_pad must have shape ({batch_size},), got {tuple(left_pad.shape)}")
        if max_len < 1:
            raise ValueError(f"KV cache max_len must be >= 1, got {max_len}")
        self.batch_size, self.max_len, self.dtype = batch_size, max_len, dtype
        self.device = torch.device(device)
        self.length = 0
        # zeroed, not empty: masked slots get probability 0, and 0 * NaN garbage would still be NaN
        self.n_slots = -(-max_len // SPAN_QUANTUM) * SPAN_QUANTUM
        # one buffer per layer, not one stacked (n_layers, ...) tensor: under torch.compile a decode step's write
        # into a view of a stacked graph input is functionalised into a copy of the whole stack per layer (12 x the
        # cache's bytes a step for tier B: 57 tokens/s after a 32k prompt on an H100); into a base it stays in place
        shape = (batch_size, n_kv_heads, self.n_slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.left_pad = None if left_pad is None else left_pad.to(device=device, dtype=torch.int64)
        self.pad = self.left_pad if self.left_pad is not None else torch.zeros(batch_size, dtype=torch.int64,
                                                                                device=device)  # (B,)
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)  # the next slot to write
        self.slots = torch.arange(self.n_slots, device=device)  # (S,)
        # (S, hd/2): the model's RoPE base and scaling (model/rope.py), the same angles its training forward uses
        self.cos, self.sin = rope_table(self.n_slots, head_dim, rope, dtype=dtype, device=device)
        self.key_bias = torch.full((batch_size, 1, 1, self.n_slots), float("-inf"), dtype=dtype, device=device)
        self.attention = decode_attention(batch_size, n_kv_heads, self.device)

    def reset(self) -> None:
        self.length = 0
        self.pos.zero_()
        self.key_bias.fill_(float("-inf"))

    def check(self, B: int, T: int) -> None:
        """A clear error for a batch of the wrong size or a cache without room for T more tokens (host-side)."""
        if B != self.batch_size:
            raise ValueError(f"KV cache was made for batch size {self.batch_size}, got a batch of {B}")
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache is full: {self.length} + {T} tokens > max_len={self.max_len}; "
                             "create the cache with a larger max_len")

    def decode_span(self) -> int:
        """Slots the next one-token step attends over (a host int from `length`: see span_bucket)."""
        return self.span_for(self.length)

    def span_for(self, length: int) -> int:
        """Slots a one-token step attends over when `length` tokens are cached (what decode_span says then)."""
        return span_bucket(length + 1, self.n_slots)

    def advance(self, T: int) -> None:
        """T more slots were filled by an eager call: open them to later decode steps (not a row's left pads)."""
        filled = self.slots[self.length:self.length + T]  # (T,)
        self.key_bias[:, 0, 0, self.length:self.length + T] = torch.where(
            filled[None] >= self.pad[:, None], 0.0, float("-inf")).to(self.dtype)
        self.length += T
        self.pos += T

    def select_rows(self, index: torch.Tensor) -> "KVCache":
        """A cache whose row i is a copy of this cache's row index[i] (index (R,) int64): one prompt's prefix, computed
        once, continued by several rows (the choices of a multiple-choice question, pipeline/eval/harness_model.py).
        The RoPE tables are shared; keys, values, pads and key_bias are copied."""
        rows = copy.copy(self)
        rows.batch_size = int(index.numel())
        rows.k = [k.index_select(0, index) for k in self.k]
        rows.v = [v.index_select(0, index) for v in self.v]
        rows.left_pad = None if self.left_pad is None else self.left_pad.index_select(0, index)
        rows.pad = self.pad.index_select(0, index)
        rows.key_bias = self.key_bias.index_select(0, index)  # per row: which slots it may attend to
        rows.pos = self.pos.clone()
        return rows

    # -- prefill and multi-token chunks (eager; shapes follow the chunk) ----------------------------------------

    def positions_and_mask(self, B: int, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RoPE positions (B|1, T) of the next T tokens, and the mask over the length+T filled slots: None (plain
        causal: an empty cache without left padding), torch's lower-right causal bias (a chunk after a prefix, no
        padding: nothing materialised where SDPA runs flash or memory-efficient attention), or a boolean
        (B, 1, T, length+T) mask with left padding (B x T x slots bytes: model/decode_loop.py prefills long prompts
        in chunks so that it stays bounded)."""
        self.check(B, T)
        q_abs = torch.arange(self.length, self.length + T, device=device)  # (T,) slot of each new token
        k_abs = self.slots[: self.length + T]  # (S,)
        if self.left_pad is None:
            mask = None
            if self.length > 0:  # new tokens after a prefix: bottom-right aligned causal
                from torch.nn.attention.bias import causal_lower_right  # here: it loads torch._dynamo

                mask = causal_lower_right(T, self.length + T)
            return q_abs[None], mask
        pad = self.left_pad[:, None]  # (B, 1)
        positions = (q_abs[None] - pad).clamp_min(0)  # (B, T): real tokens start at 0
        causal = k_abs[None, :] <= q_abs[:, None]  # (T, S)
        # real keys only; a pad query also sees itself so its softmax row is never empty (its output is unused)
        real_key = (k_abs[None, None, :] >= pad[:, :, None]) | (k_abs[None, None, :] == q_abs[None, :, None])
        return positions, (causal[None] & real_key)[:, None]  # (B, 1, T, S)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B|1, T) -> cos, sin each (B|1, T, 1, hd/2) in the cache dtype, from the tables."""
        return self.cos[positions][:, :, None], self.sin[positions][:, :, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv_heads, T, head_dim) at slots [length, length+T); return the filled slots as views
        (B, n_kv_heads, length+T, head_dim) in k's dtype (no copy when it is the cache dtype)."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end].to(k.dtype), self.v[layer][:, :, :end].to(v.dtype)


# ----------------------------------------------------------------------------------------------------------------
# The one-token decode step: fixed shapes, device state only


def _attend_one(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                span: int) -> torch.Tensor:
    """One new token per row through model/decoder.py's Attention `attn`: x (B, 1, D) -> (B, 1, D).

    Writes this token's key/value at slot cache.pos, then attends over the first `span` slots (a multiple of
    SPAN_QUANTUM) with cache.key_bias, by cache.attention's path (module docstring). Grouped-query attention reads
    key head h // G for query head h, as SDPA's enable_gqa does, without copying keys."""
    B = x.shape[0]
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    G, L = H // Hkv, span
    qk, v = attn.wqkv(x).split([(H + Hkv) * hd, Hkv * hd], dim=-1)  # (B, 1, *)
    qk = apply_rope(qk.view(B, 1, H + Hkv, hd), cos, sin)  # queries and keys rotated together: half the ops
    q, k = qk.split([H, Hkv], dim=2)  # (B, 1, H, hd), (B, 1, Hkv, hd)
    keys, values = cache.k[layer], cache.v[layer]  # (B, Hkv, S, hd): the layer's own buffers (written in place)
    keys.index_copy_(2, cache.pos, k.transpose(1, 2).to(keys.dtype))
    values.index_copy_(2, cache.pos, v.view(B, 1, Hkv, hd).transpose(1, 2).to(values.dtype))
    keys, values = keys[:, :, :L], values[:, :, :L]  # (B, Hkv, L, hd): the span only
    key_bias = cache.key_bias[..., :L]  # (B, 1, 1, L)
    if cache.attention == FUSED:
        y = F.scaled_dot_product_attention(q.transpose(1, 2).to(keys.dtype), keys, values, attn_mask=key_bias,
                                           enable_gqa=G > 1)  # (B, H, 1, hd)
        return attn.wo(y.transpose(1, 2).reshape(B, 1, H * hd).to(x.dtype))
    n_chunks = L // SPAN_QUANTUM
    q = q.reshape(B, Hkv, G, hd).to(keys.dtype) * (1.0 / math.sqrt(hd))  # (B, Hkv, G, hd)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() + key_bias  # (B, Hkv, G, L) fp32
    probs = scores.softmax(dim=-1).to(values.dtype)
    # split-K: (B, Hkv, n, G, c) @ (B, Hkv, n, c, hd) -> (B, Hkv, n, G, hd), summed over the n chunks in fp32
    p_chunks = probs.view(B, Hkv, G, n_chunks, SPAN_QUANTUM).transpose(2, 3)
    v_chunks = values.reshape(B, Hkv, n_chunks, SPAN_QUANTUM, hd)
    y = torch.matmul(p_chunks, v_chunks).sum(dim=2, dtype=torch.float32).to(values.dtype)  # (B, Hkv, G, hd)
    return attn.wo(y.reshape(B, 1, H * hd).to(x.dtype))


def decode_compute(decoder, tok: torch.Tensor, cache: KVCache, span: int | None = None) -> torch.Tensor:
    """The graph-safe part of a decode step: tok (B,) int64 -> hidden (B, D) after the final RMSNorm.

    span: slots attended (a multiple of SPAN_QUANTUM covering the filled ones; default cache.decode_span()).
    Reads and advances only device state (cache.pos += 1 in place); no host sync, no shape that depends on the
    step. Does not check capacity and does not advance cache.length: use `decode_step` unless you replay this
    in a CUDA graph (and then keep cache.length yourself, and a span that covers it)."""
    L = cache.decode_span() if span is None else span
    pos = cache.pos  # (1,)
    rope_pos = (pos - cache.pad).clamp_min(0)  # (B,) position of the new token in its own prompt
    cos = cache.cos.index_select(0, rope_pos)[:, None, None]  # (B, 1, 1, hd/2)
    sin = cache.sin.index_select(0, rope_pos)[:, None, None]
    cache.key_bias.index_fill_(3, pos, 0.0)  # this step's slot opens to every row (pos is past every left pad)
    x = decoder.tok_emb(tok[:, None])  # (B, 1, D)
    for i, block in enumerate(decoder.blocks):
        # the block's submodules, not block(): eager even after compile_blocks
        x = x + _attend_one(block.attn, block.attn_norm(x), cos, sin, cache, i, L)
        x = x + block.mlp(block.mlp_norm(x))
    pos += 1
    return decoder.norm(x)[:, 0]  # (B, D)


def decode_step(decoder, tok: torch.Tensor, cache) -> torch.Tensor:
    """tok (B,) int64, one new token per row -> hidden (B, D); checks capacity and advances the cache. Any model
    with a graph-safe `decoder.decode_compute(tok, cache)` (both families) and a cache with check() and length."""
    if tok.dim() != 1:
        raise ValueError(f"decode_step takes one token per row, shape (B,), got {tuple(tok.shape)}")
    cache.check(tok.shape[0], 1)
    hidden = decoder.decode_compute(tok, cache)
    cache.length += 1
    return hidden
