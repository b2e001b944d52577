"""Parameter counts, initialization, tied/untied output weight, activation checkpointing, argument errors."""
from __future__ import annotations

import math

import pytest
import torch

import model.decoder as decoder_module
from model.decoder import Decoder, build_model
from model.tiers import TIERS
from tests.model.tiny import TINY, VOCAB, make_model, packed_row


def expected_params(tier, vocab: int, tied: bool) -> int:
    """Closed form: per layer wq, wk, wv, wo + SwiGLU gate/up/down (a MoE tier: the router and E experts' gate/up/down)
    + two RMSNorm weights; final norm; embedding(s)."""
    d, hd = tier.d_model, tier.head_dim
    ffn = 3 * d * tier.d_ff if tier.moe is None else tier.moe.num_experts * (d + 3 * d * tier.moe.expert_ffn)
    per_layer = 2 * d * tier.n_heads * hd + 2 * d * tier.n_kv_heads * hd + ffn + 2 * d
    return tier.n_layers * per_layer + d + vocab * d * (1 if tied else 2)


@pytest.mark.parametrize("name", list(TIERS))
@pytest.mark.parametrize("tied", [True, False])
def test_exact_parameter_counts_match_the_formula(name, tied):
    with torch.device("meta"):
        model = build_model(name, 32000, tie_embeddings=tied)
    assert model.num_params() == expected_params(TIERS[name], 32000, tied)
    assert model.num_params(exclude_embedding=True) == expected_params(TIERS[name], 0, tied)


def test_known_parameter_counts():
    """Pinned so a change to the architecture or the tier table is a deliberate, visible edit."""
    counts = {}
    for name in TIERS:
        with torch.device("meta"):
            counts[name] = build_model(name, 32000).num_params()
    assert counts == {"nano": 2_154_816, "A": 26_450_304, "B": 109_529_856, "C": 341_099_520, "D": 757_016_064,
                      "E": 1_504_299_008, "F": 2_936_855_040, "nano-moe": 2_377_024, "A-moe": 130_455_936,
                      "B-moe": 732_973_824, "C-moe": 2_550_973_440}


def test_gqa_shrinks_key_value_projections():
    model = Decoder(TINY, VOCAB)
    hd = TINY.head_dim
    assert model.blocks[0].attn.wqkv.weight.shape == ((TINY.n_heads + 2 * TINY.n_kv_heads) * hd, TINY.d_model)


def test_tied_and_untied_output_weight():
    tied, untied = Decoder(TINY, VOCAB), Decoder(TINY, VOCAB, tie_embeddings=False)
    assert tied.output_weight is tied.tok_emb.weight
    assert untied.output_weight is untied.lm_head.weight
    assert untied.output_weight.shape == (VOCAB, TINY.d_model)
    assert untied.num_params() - tied.num_params() == VOCAB * TINY.d_model


def test_forward_returns_normalized_hidden_states_not_logits():
    model = make_model()  # weights ~0.3: the residual stream is large enough that norm_eps is negligible
    tokens, doc_ids = packed_row([5, 7], batch=3)
    h = model(tokens, doc_ids)
    assert h.shape == (3, 12, TINY.d_model) and h.dtype == torch.float32
    # final RMSNorm with unit weight: every row has root-mean-square 1
    torch.testing.assert_close(h.pow(2).mean(-1).sqrt(), torch.ones(3, 12), rtol=0, atol=1e-3)


def test_initialization_scales():
    torch.manual_seed(0)
    tier = TIERS["A"]
    model = Decoder(tier, 4000)
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 1e-3
    assert abs(model.blocks[0].attn.wqkv.weight.std().item() - 0.02) < 1e-3
    resid = 0.02 / math.sqrt(2 * tier.n_layers)
    for block in model.blocks:
        assert abs(block.attn.wo.weight.std().item() - resid) < 0.05 * resid
        assert abs(block.mlp.w_down.weight.std().item() - resid) < 0.05 * resid
        assert torch.equal(block.attn_norm.weight, torch.ones(tier.d_model))


def _grads(model, tokens, doc_ids):
    model.zero_grad(set_to_none=True)
    h = model(tokens, doc_ids)
    loss = torch.nn.functional.cross_entropy(model.logits(h).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("spec, expected_calls", [("all", 3), ("every_2", 2), ("every_1", 3), ("every_5", 1)])
def test_activation_checkpointing_keeps_gradients(monkeypatch, spec, expected_calls):
    """Recompute-in-backward changes no gradient: identical ops on CPU, so we allow 1e-6 absolute at most."""
    tokens, doc_ids = packed_row([9, 13, 10], batch=2)
    ref = _grads(make_model().train(), tokens, doc_ids)
    calls = []

    def counting_checkpoint(fn, *args, **kw):
        calls.append(kw.get("use_reentrant"))
        return torch.utils.checkpoint.checkpoint(fn, *args, **kw)

    monkeypatch.setattr(decoder_module, "checkpoint", counting_checkpoint)
    model = make_model(activation_checkpointing=spec).train()
    got = _grads(model, tokens, doc_ids)
    assert calls == [False] * expected_calls  # blocks 0, k, 2k, ... with use_reentrant=False
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-6, msg=name)
    calls.clear()
    with torch.no_grad():
        model.eval()(tokens, doc_ids)
    assert calls == []  # evaluation never checkpoints


def test_invalid_arguments_raise_one_clear_message():
    with pytest.raises(ValueError, match="attention='fast' is not allowed"):
        Decoder(TINY, VOCAB, attention="fast")
    with pytest.raises(ValueError, match="activation_checkpointing='every_0' is not allowed"):
        Decoder(TINY, VOCAB, activation_checkpointing="every_0")
    with pytest.raises(ValueError, match="unknown tier 'Z'"):
        build_model("Z", VOCAB)
    model = Decoder(TINY, VOCAB)
    tokens, doc_ids = packed_row([4, 4])
    with pytest.raises(ValueError, match="doc_ids shape"):
        model(tokens, doc_ids[:, :-1])
    with pytest.raises(ValueError, match=r"idx must be \(B, T\)"):
        model(tokens[0])
