"""FLOPs per token against counted matmuls, and the `python -m model` tier table."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.decoder import Decoder, build_model
from model.flops import active_param_count, flops_per_token, matmul_params, param_count
from model.tiers import MIXERS, TIERS, get_mixer_tier, tiers_for
from tests.model.tiny import TINY

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(TIERS))
def test_matmul_params_are_the_model_matrices_plus_the_output_projection(name):
    """Every 2-D weight except the embedding lookup is a matmul; the output projection is one even when tied."""
    with torch.device("meta"):
        model = Decoder(TIERS[name], 32000, tie_embeddings=False)
    in_matmuls = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and n != "tok_emb.weight")
    assert matmul_params(TIERS[name], 32000, active=False) == in_matmuls  # a MoE tier: every expert
    if TIERS[name].moe is None:
        assert matmul_params(TIERS[name], 32000) == in_matmuls  # dense: every matrix is active


@pytest.mark.parametrize("mixer,name", [(m, n) for m in MIXERS for n in tiers_for(m)])
@pytest.mark.parametrize("tie", [True, False])
def test_param_count_is_the_built_models_count(mixer, name, tie):
    """The analytic count that runs and sweep trials log equals the parameters of the model actually built."""
    with torch.device("meta"):
        model = build_model(name, 1003, mixer=mixer, tie_embeddings=tie)
    assert param_count(get_mixer_tier(name, mixer), 1003, tie_embeddings=tie) == model.num_params()


def test_param_count_of_a_grouped_query_tier():
    with torch.device("meta"):
        model = Decoder(TINY, 100, tie_embeddings=False)
    assert param_count(TINY, 100, tie_embeddings=False) == model.num_params()


def test_flops_per_token_formula():
    tier, V = TIERS["B"], 32000
    d, L = tier.d_model, tier.n_layers
    n = L * (4 * d * d + 3 * d * tier.d_ff) + V * d  # MHA tier: q, k, v, o are d x d
    assert flops_per_token(tier, 4096, V) == 6 * n + 6 * L * d * 4096
    # attention grows linearly with context: exactly 6 * L * d FLOPs per extra token of context
    assert flops_per_token(tier, 32768, V) - flops_per_token(tier, 32767, V) == 6 * L * d
    assert flops_per_token(tier, 4096, V, tie_embeddings=False) == flops_per_token(tier, 4096, V)


def test_gqa_flops_count_the_smaller_key_value_projections():
    hd = TINY.head_dim
    attn = TINY.d_model * hd * (2 * TINY.n_heads + 2 * TINY.n_kv_heads)
    assert matmul_params(TINY, 100) == TINY.n_layers * (attn + 3 * TINY.d_model * TINY.d_ff) + 100 * TINY.d_model


def test_flops_match_a_measured_forward_count():
    """torch's FlopCounterMode counts the matmuls of a real forward (SDPA's math backend runs attention as
    two full T x T batched matmuls, so no causal discount):
    forward = 2 * matmul_params + 4 * L * (H * hd) * T per token, i.e. one third of training with unmasked
    attention; our formula halves the attention term for causality."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = Decoder(TINY, 100)
    T = 64
    tokens = torch.randint(0, 100, (1, T))
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        h = model(tokens)
        model.logits(h)
    measured_fwd_per_token = counter.get_total_flops() / T
    attn_fwd_full = 4 * TINY.n_layers * TINY.n_heads * TINY.head_dim * T
    assert measured_fwd_per_token == 2 * matmul_params(TINY, 100) + attn_fwd_full
    assert flops_per_token(TINY, T, 100) == 3 * measured_fwd_per_token - 3 * attn_fwd_full / 2


@pytest.mark.system  # docs/tests.md: over ~5 s (6.7 s in the quick tier on 2 idle cores)
def test_python_m_model_prints_every_tier():
    out = subprocess.run([sys.executable, "-m", "model", "--vocab", "32000"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    lines = out.strip().split("\n\n")[0].splitlines()  # the attention table; the resonance one follows
    assert "vocab_size=32,000" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    dense = {name: tier for name, tier in TIERS.items() if tier.moe is None}
    assert list(rows) == list(dense)
    for name, tier in dense.items():
        with torch.device("meta"):
            model = Decoder(tier, 32000)
        cells = rows[name]
        assert cells[1:8] == [str(v) for v in (tier.d_model, tier.n_layers, tier.n_heads, tier.n_kv_heads,
                                               tier.head_dim, tier.d_ff, tier.max_seq_len)]
        assert cells[8] == f"{model.num_params():,}"
        assert cells[9] == f"{model.num_params(exclude_embedding=True):,}"
        assert cells[10] == f"{flops_per_token(tier, 4096, 32000) / 1e9:.3f}"
        assert cells[11] == f"{flops_per_token(tier, 32768, 32000) / 1e9:.3f}"
    moe = out.strip().split("\n\n")[2].splitlines()  # the mixture-of-experts table, both families
    moe_rows = {(line.split()[0], line.split()[1]): line.split() for line in moe[2:]}
    assert list(moe_rows) == [(n, m) for m in MIXERS for n, t in tiers_for(m).items() if t.moe is not None]
    for (name, mixer), cells in moe_rows.items():
        tier = get_mixer_tier(name, mixer)
        assert cells[4:7] == [str(tier.moe.num_experts), str(tier.moe.experts_per_token), str(tier.moe.expert_ffn)]
        assert cells[9] == f"{param_count(tier, 32000):,}" and cells[10] == f"{active_param_count(tier, 32000):,}"


@pytest.mark.parametrize("name", ["E", "F"])
def test_tiers_e_and_f_on_the_meta_device_have_exact_counts_without_memory(name):
    """Built on the meta device nothing is allocated (every parameter is a meta tensor), and the count is the
    closed form: per block 4 d^2 (q, k, v, o) + 3 d d_ff (SwiGLU) + 2 d (norms), plus the tied (V, d) embedding and
    the final norm. Resonance twins sit within 1% of it."""
    t, V = TIERS[name], 32000
    with torch.device("meta"):
        model = Decoder(t, V)
    assert all(p.is_meta for p in model.parameters())
    d = t.d_model
    closed = t.n_layers * (4 * d * d + 3 * d * t.d_ff + 2 * d) + V * d + d
    assert model.num_params() == closed == param_count(t, V)
    assert closed == {"E": 1_504_299_008, "F": 2_936_855_040}[name]
    assert t.head_dim == 128 and t.max_seq_len == 32768
    resonance = param_count(get_mixer_tier(name, "resonance"), V)
    assert abs(resonance - closed) / closed < 0.01


def test_every_resonance_tier_is_within_one_percent_of_its_attention_twin():
    for name, tier in tiers_for("resonance").items():
        if name in TIERS:
            a, r = param_count(TIERS[name], 32000), param_count(tier, 32000)
            assert abs(r - a) / a < 0.01, name
