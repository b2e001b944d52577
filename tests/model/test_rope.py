"""RoPE base and scaling (model/rope.py): one set of tables for every path. The cache's table rows equal the
per-forward angles bit for bit under each scaling, the default keeps the plain formula exactly, a scaled model's
KV-cached decoding (prefill, then the fixed-shape step) equals its full forward past the original length, and
document masking restarts the scaled positions at each document. transformers' agreement, type by type, is
tests/pipeline/train/test_rope_export.py."""
from __future__ import annotations

import pytest
import torch

from model.rope import RopeConfig, rope_cos_sin, rope_table
from tests.model.tiny import make_model, packed_row

SCALINGS = {
    "none": RopeConfig(theta=10_000.0),
    "linear": RopeConfig(theta=10_000.0, scaling="linear", factor=4.0),
    "yarn": RopeConfig(theta=10_000.0, scaling="yarn", factor=4.0, original_max_len=16),
    "llama3": RopeConfig(theta=10_000.0, scaling="llama3", factor=8.0, original_max_len=16),
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_cache_tables_equal_the_forward_angles_bit_for_bit(name):
    rope = SCALINGS[name]
    positions = torch.arange(200)[None]
    cos, sin = rope_cos_sin(positions, 16, rope)
    cos_t, sin_t = rope_table(200, 16, rope, dtype=torch.float32, device="cpu")
    assert torch.equal(cos_t, cos[0, :, 0]) and torch.equal(sin_t, sin[0, :, 0])
    if rope.scaling == "yarn":  # cos^2 + sin^2 = mscale^2, YaRN's attention temperature
        torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full_like(cos, rope.attention_scaling ** 2))


def test_the_default_is_the_plain_formula_and_a_bare_base_means_it():
    base, hd = 500_000.0, 16
    positions = torch.arange(4096)[None]
    angles = positions.double()[..., None] * base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    cos, sin = rope_cos_sin(positions, hd, RopeConfig())
    assert torch.equal(cos[:, :, 0], angles.cos().float()) and torch.equal(sin[:, :, 0], angles.sin().float())
    assert torch.equal(rope_cos_sin(positions, hd, base)[0], cos)


def test_scalings_keep_fast_dimensions_and_slow_the_slow_ones():
    plain = SCALINGS["none"].inv_freq(16)
    for rope in (RopeConfig(theta=10_000.0, scaling="yarn", factor=4.0, original_max_len=64),
                 RopeConfig(theta=10_000.0, scaling="llama3", factor=8.0, original_max_len=64)):
        scaled = rope.inv_freq(16)
        assert scaled[0] == plain[0]  # the fastest dimension (wavelength 2 pi) turns 10 times in 64: kept
        torch.testing.assert_close(scaled[-1], plain[-1] / rope.factor)  # the slowest: interpolated
        assert bool(((scaled <= plain) & (scaled >= plain / rope.factor * (1 - 1e-12))).all())
        assert bool((scaled[1:-1] < plain[1:-1]).any() & (scaled[1:-1] > plain[1:-1] / rope.factor).any())  # blend
    torch.testing.assert_close(SCALINGS["linear"].inv_freq(16), plain / 4)


@pytest.mark.parametrize("name", ["yarn", "llama3"])
def test_scaled_kv_cache_decoding_equals_the_full_forward(name):
    from tests.model.tiny import TINY_GPU

    model = make_model(TINY_GPU, rope=SCALINGS[name])  # head_dim 16
    tokens, _ = packed_row([80], batch=2, seed=2)  # 5x the original length of 16
    cache = model.new_kv_cache(batch_size=2, max_len=80)
    with torch.no_grad():
        full = model(tokens)
        prefill = model(tokens[:, :60], kv_cache=cache)  # the cache's tables through prefill...
        steps = [model.decode_step(tokens[:, t], cache)[:, None] for t in range(60, 80)]  # ...and the fixed step
    # the fixed-shape step's split-K matmuls round differently from the full forward's: 1e-4, as test_kv_cache.py
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=0, atol=1e-4)
    other = make_model(TINY_GPU, rope=SCALINGS["none"])
    with torch.no_grad():
        assert float((other(tokens) - full).abs().max()) > 1e-3  # the scaling is really in the forward


def test_document_masking_restarts_scaled_positions():
    model = make_model(rope=SCALINGS["yarn"])
    tokens, doc_ids = packed_row([30, 50], seed=4)
    with torch.no_grad():
        packed = model(tokens, doc_ids)
        alone = model(tokens[:, 30:])
    torch.testing.assert_close(packed[:, 30:], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw, message", [
    (dict(scaling="ntk"), "scaling='ntk' is not one of none, linear, yarn, llama3"),
    (dict(theta=1.0), "theta=1.0 must be a finite base > 1"),
    (dict(scaling="yarn", factor=4.0), "yarn needs original_max_len"),
    (dict(scaling="llama3", factor=4.0, original_max_len=8, low_freq_factor=4.0), "high_freq_factor > low_freq"),
])
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        RopeConfig(**kw)
