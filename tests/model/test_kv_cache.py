"""KV-cache decoding equals recomputing the full prefix (fp32 CPU; tolerance 1e-5 absolute on hidden states)."""
from __future__ import annotations

import pytest
import torch

from tests.model.tiny import VOCAB, make_model, packed_row

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
