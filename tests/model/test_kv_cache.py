"""KV-cache decoding equals recomputing the full prefix (fp32 CPU; tolerance 1e-5 absolute on hidden states)."""
from __future__ import annotations

import pytest
import torch

from tests.model.tiny import VOCAB, compiled_forward_ops, make_model, packed_row

ATOL = 1e-5  # same math, different matrix shapes (one row vs a whole prefix): fp32 rounding only


def test_token_by_token_equals_full_forward():
    model = make_model()
    tokens, _ = packed_row([20], batch=2)
    cache = model.new_kv_cache(batch_size=2, max_len=20)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, t:t + 1], kv_cache=cache) for t in range(20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=ATOL)


def test_prefill_then_chunks_equals_full_forward():
    """A multi-token chunk after a cached prefix needs the bottom-right aligned causal mask."""
    model = make_model()
    tokens, _ = packed_row([16], batch=2, seed=3)
    cache = model.new_kv_cache(batch_size=2, max_len=32)
    with torch.no_grad():
        full = model(tokens)
        parts = [model(tokens[:, a:b], kv_cache=cache) for a, b in ((0, 7), (7, 11), (11, 12), (12, 16))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=ATOL)


def test_greedy_decoding_with_cache_equals_recomputing_the_prefix():
    model = make_model()
    prompt, _ = packed_row([6], batch=3, seed=1)
    cache = model.new_kv_cache(batch_size=3, max_len=6 + 10)
    seq = prompt
    with torch.no_grad():
        h = model(prompt, kv_cache=cache)
        for _ in range(10):
            logits_cached = model.logits(h[:, -1])  # (B, V)
            logits_full = model.logits(model(seq)[:, -1])  # recompute everything
            torch.testing.assert_close(logits_cached, logits_full, rtol=0, atol=1e-4)
            nxt = logits_cached.argmax(-1)
            assert torch.equal(nxt, logits_full.argmax(-1))
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            h = model(nxt[:, None], kv_cache=cache)
    assert seq.shape == (3, 16)


def test_left_padded_batch_matches_each_prompt_alone():
    model = make_model()
    lengths = [4, 9, 7]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    P, new = max(lengths), 5
    pad = torch.tensor([P - n for n in lengths])
    batch = torch.stack([torch.cat([torch.full((P - len(p),), 3), p]) for p in prompts])  # (3, P), pad id 3
    cache = model.new_kv_cache(batch_size=3, max_len=P + new, left_pad=pad)
    with torch.no_grad():
        h = model(batch, kv_cache=cache)
        outs = [h[:, -1]]
        for _ in range(new):
            nxt = model.logits(outs[-1]).argmax(-1)
            outs.append(model(nxt[:, None], kv_cache=cache)[:, -1])
        for b, p in enumerate(prompts):  # each prompt alone, greedy, with its own cache
            alone = model.new_kv_cache(batch_size=1, max_len=P + new)
            ha = model(p[None], kv_cache=alone)
            torch.testing.assert_close(h[b, P - len(p):], ha[0], rtol=0, atol=ATOL)
            last = ha[:, -1]
            for step in range(new):
                torch.testing.assert_close(outs[step][b], last[0], rtol=0, atol=ATOL)
                last = model(model.logits(last).argmax(-1)[:, None], kv_cache=alone)[:, -1]


def test_rows_selected_from_a_left_padded_cache_continue_as_their_prompt_alone():
    """select_rows copies each chosen row's keys, values, pads and slot visibility: a continuation on the selected
    rows (a chunk, then one-token steps) equals the same prompt and continuation run alone."""
    model = make_model()
    lengths = [3, 8]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    P = max(lengths)
    pad = torch.tensor([P - n for n in lengths])
    batch = torch.stack([torch.cat([torch.full((P - len(p),), 3), p]) for p in prompts])
    owner = torch.tensor([0, 1, 0, 0])  # the short prompt continued three ways, the long one once
    conts = torch.randint(0, VOCAB, (4, 3), generator=g)
    with torch.no_grad():
        cache = model.new_kv_cache(batch_size=2, max_len=P + 4, left_pad=pad)
        model(batch, kv_cache=cache)
        rows = cache.select_rows(owner)
        chunk = model(conts[:, :2], kv_cache=rows)  # (4, 2, D)
        step = model(conts[:, 2:], kv_cache=rows)[:, 0]  # one more token on the selected rows
        for r, b in enumerate(owner.tolist()):
            alone = model(torch.cat([prompts[b], conts[r]])[None])[0]  # no cache
            n = len(prompts[b])
            torch.testing.assert_close(chunk[r], alone[n:n + 2], rtol=0, atol=ATOL)
            torch.testing.assert_close(step[r], alone[n + 2], rtol=0, atol=ATOL)


def test_cache_misuse_raises_clear_errors():
    model = make_model()
    tokens, doc_ids = packed_row([5], batch=2)
    cache = model.new_kv_cache(batch_size=2, max_len=6)
    with torch.no_grad():
        with pytest.raises(ValueError, match="no document masking"):
            model(tokens, doc_ids, kv_cache=cache)
        with pytest.raises(ValueError, match="batch size 2"):
            model(tokens[:1], kv_cache=cache)
        model(tokens, kv_cache=cache)
        with pytest.raises(ValueError, match="KV cache is full"):
            model(tokens[:, :2], kv_cache=cache)
        cache.reset()
        model(tokens[:, :2], kv_cache=cache)
    with pytest.raises(ValueError, match="left_pad must have shape"):
        model.new_kv_cache(batch_size=2, max_len=6, left_pad=torch.zeros(3, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------- static cache


def _left_padded(lengths: list[int], seed: int, pad_id: int = 3) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    P = max(lengths)
    batch = torch.stack([torch.cat([torch.full((P - len(p),), pad_id), p]) for p in prompts])  # (B, P)
    return prompts, batch, torch.tensor([P - n for n in lengths])


def test_static_decode_of_left_padded_prompts_equals_full_prefix_recompute():
    """Prompts of lengths 2, 9 and 5 in one left-padded batch, greedy decoding through the fixed-shape step:
    at every step each row's logits equal a full forward (no cache) over that row's real tokens so far."""
    model = make_model()
    prompts, batch, pad = _left_padded([2, 9, 5], seed=7)
    new = 6
    cache = model.new_kv_cache(batch_size=3, max_len=batch.shape[1] + new, left_pad=pad)
    seqs = [p.clone() for p in prompts]
    with torch.no_grad():
        h = model(batch, kv_cache=cache)[:, -1]  # (B, D) prefill
        for step in range(new):
            logits = model.logits(h)
            for b, seq in enumerate(seqs):
                full = model.logits(model(seq[None])[:, -1])[0]  # recompute everything, this row alone
                torch.testing.assert_close(logits[b], full, rtol=0, atol=1e-4, msg=f"row {b} step {step}")
            nxt = logits.argmax(-1)
            seqs = [torch.cat([s, nxt[b:b + 1]]) for b, s in enumerate(seqs)]
            h = model.decode_step(nxt, cache)
    assert cache.length == batch.shape[1] + new and int(cache.pos) == cache.length


def test_cache_is_allocated_once_at_max_len_and_decode_writes_in_place():
    model = make_model()
    tokens, _ = packed_row([10], batch=2, seed=2)
    cache = model.new_kv_cache(batch_size=2, max_len=16)
    tier = model.tier
    assert len(cache.k) == len(cache.v) == tier.n_layers
    for buf in cache.k + cache.v:  # one base buffer per layer: 16 slots -> 256
        assert buf.shape == (2, tier.n_kv_heads, 256, tier.head_dim) and buf._base is None
    buffers = [b.data_ptr() for b in cache.k + cache.v] + [cache.pos.data_ptr()]
    with torch.no_grad():
        model(tokens[:, :4], kv_cache=cache)
        for t in range(4, 10):
            model.decode_step(tokens[:, t], cache)
    assert [b.data_ptr() for b in cache.k + cache.v] + [cache.pos.data_ptr()] == buffers
    assert all(bool(b[:, :, 10:].eq(0).all()) for b in cache.k + cache.v)  # slots past the filled length
    assert all(bool(b[:, :, :10].ne(0).any()) for b in cache.k + cache.v)  # the filled ones were written


def test_cache_dtype_follows_autocast_and_rope_tables_match_per_position_angles():
    from model.rope import rope_cos_sin

    model = make_model()
    assert model.new_kv_cache(batch_size=1, max_len=8).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model.new_kv_cache(batch_size=1, max_len=8)
    assert cache.dtype == torch.bfloat16 and cache.k[0].dtype == cache.cos.dtype == torch.bfloat16
    fp32 = model.new_kv_cache(batch_size=1, max_len=300)  # 512 slots: max_len rounded up to the span quantum
    cos, sin = rope_cos_sin(torch.arange(512)[None], model.tier.head_dim, model.tier.rope_base)
    assert torch.equal(fp32.cos, cos[0, :, 0]) and torch.equal(fp32.sin, sin[0, :, 0])  # bit for bit


def test_compiled_decode_step_never_recompiles_and_matches_eager():
    """The fixed-shape step reads no host state that changes: compiled once (fullgraph, no graph break), it runs
    every later step of a span bucket without a recompile — what lets a CUDA graph replay it — and gives the
    eager results."""
    import torch._dynamo

    from model.kv_cache import decode_compute

    model = make_model()
    prompts, batch, pad = _left_padded([3, 6], seed=4)
    caches = [model.new_kv_cache(batch_size=2, max_len=12, left_pad=pad) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(decode_compute, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for cache in caches:
            model(batch, kv_cache=cache)
        tok = torch.tensor([5, 6])
        span = caches[1].decode_span()  # host int, chosen outside the compiled step (a graph per span bucket)
        for _ in range(5):
            assert caches[1].decode_span() == span == 256
            eager = model.decode_step(tok, caches[0])
            got = compiled(model, tok, caches[1], span)
            caches[1].length += 1  # as the CUDA-graph replay keeps it: host state moves, the step must not read it
            torch.testing.assert_close(got, eager, rtol=0, atol=ATOL)
            tok = model.logits(eager).argmax(-1)
    assert int(caches[1].pos) == 6 + 5
    torch._dynamo.reset()


def test_compiled_decode_step_writes_the_cache_in_place_not_through_a_scatter_of_a_stack():
    """The compiled step's cache writes, read from its forward graph: one index_copy per layer and buffer, no
    scatter. Through a view of one stacked (n_layers, ...) cache they become a select_scatter each, which inductor
    runs as a copy of the whole stack per layer: 12 x the cache's bytes a step for tier B (57 tokens/s after a
    32k prompt on an H100, bench/results/gpu_check_partial-nvidia-h100-80gb-hbm3-20261127.json)."""
    from model.kv_cache import decode_compute

    model = make_model()
    cache = model.new_kv_cache(batch_size=2, max_len=12)
    with torch.no_grad():
        model(packed_row([5], batch=2)[0], kv_cache=cache)
    ops = compiled_forward_ops(decode_compute, model, torch.tensor([1, 2]), cache, cache.decode_span())
    assert ops.get("aten.index_copy.default") == 2 * model.tier.n_layers, ops
    assert not [op for op in ops if "scatter" in op], ops


def test_span_buckets_cover_the_filled_slots_with_bounded_waste():
    from model.kv_cache import SPAN_QUANTUM, span_bucket

    limit = 40 * 1024
    prev = 0
    for n in list(range(1, 3000, 7)) + [32768, 32769, 40000]:
        L = span_bucket(n, limit)
        assert n <= L <= limit and L % SPAN_QUANTUM == 0 and L >= prev
        assert L <= max(n * 1.125, SPAN_QUANTUM) + 1 or L == -(-n // SPAN_QUANTUM) * SPAN_QUANTUM
        prev = L
    assert span_bucket(33, limit) == 256 and span_bucket(32769, 32896) == 32896
    assert len({span_bucket(n, limit) for n in range(8193, 16385)}) == 8  # a graph per eighth of a doubling


@pytest.mark.parametrize("attention", ["fused", "split_k"])
def test_attention_over_a_span_equals_the_full_cache(attention):
    """The same step attending over a 256-slot span and over all 768 slots (extra slots masked) agree: the span
    reads only what is visible, and split-K sums the chunks exactly as one matmul would (fp32 here)."""
    from model.kv_cache import decode_compute

    model = make_model()
    tokens, _ = packed_row([8], batch=2, seed=6)
    caches = [model.new_kv_cache(batch_size=2, max_len=700) for _ in range(2)]
    with torch.no_grad():
        outs = []
        for cache, span in zip(caches, (256, 768)):
            cache.attention = attention
            model(tokens[:, :5], kv_cache=cache)
            outs.append(torch.stack([decode_compute(model, tokens[:, t], cache, span) for t in range(5, 8)]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=ATOL)


def test_fused_and_split_k_decode_agree_on_left_padded_rows_and_the_bias_tracks_the_filled_slots():
    """Both attention paths of a decode step give the same hidden states (left-padded rows, grouped-query heads,
    several chunks); key_bias opens exactly the filled non-pad slots, the decode steps' own slots included."""
    from model.kv_cache import decode_compute

    model = make_model()
    prompts, batch, pad = _left_padded([3, 9, 6], seed=8)
    caches = [model.new_kv_cache(batch_size=3, max_len=600, left_pad=pad) for _ in range(2)]
    with torch.no_grad():
        outs = []
        for cache, attention in zip(caches, ("fused", "split_k")):
            cache.attention = attention
            model(batch, kv_cache=cache)
            tok = torch.tensor([1, 2, 3])
            outs.append(torch.stack([decode_compute(model, tok + t, cache, 512) for t in range(4)]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=ATOL)
    filled = 9 + 4
    want = torch.full((3, 512), float("-inf"))
    for b, p in enumerate(pad.tolist()):
        want[b, p:filled] = 0.0
    assert torch.equal(caches[0].key_bias[:, 0, 0, :512], want)
    caches[0].reset()
    assert bool(caches[0].key_bias.eq(float("-inf")).all())


def test_the_decode_attention_path_follows_the_device_and_the_batch(monkeypatch):
    from model import kv_cache

    assert kv_cache.decode_attention(1, 6, torch.device("cpu")) == "fused"

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    cuda = torch.device("cuda", 0)
    assert kv_cache.decode_attention(1, 6, cuda) == kv_cache.decode_attention(8, 6, cuda) == "split_k"
    assert kv_cache.decode_attention(22, 6, cuda) == kv_cache.decode_attention(64, 6, cuda) == "fused"
