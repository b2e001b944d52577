"""Every attention backend against the dense reference (SDPA with an explicit causal-and-same-document mask).

CPU: varlen runs its per-document reference and must equal dense to fp32 rounding, forward and backward.
GPU (`-m gpu`, skipped without CUDA): flash-attention varlen, cuDNN and flex in bf16 against dense fp32 on CPU.
"""
from __future__ import annotations

import pytest
import torch

from model.decoder import CUDNN_CAUSAL, Decoder, dense_mask, doc_spans, varlen_attention
from model.tiers import Tier
from pipeline.config import ConfigError, load_config
from tests.model.tiny import TINY, VOCAB, make_model, packed_row


def random_doc_ids(B: int, T: int, seed: int) -> torch.Tensor:
    """(B, T) int32 document ids with random boundaries per row, one-token documents likely."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, T, generator=g) < 0.15
    starts[:, 0] = False
    return starts.cumsum(dim=1).to(torch.int32)


def test_doc_spans_lays_documents_end_to_end():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    spans = doc_spans(doc_ids, 2, 6, torch.device("cpu"))
    # row 1's first document starts at flat index 6 even though row 0 ended in document 2
    assert spans.cu_seqlens.tolist() == [0, 2, 5, 6, 7, 12] and spans.cu_seqlens.dtype == torch.int32
    assert spans.max_len == 5
    whole_rows = doc_spans(None, 3, 4, torch.device("cpu"))
    assert whole_rows.cu_seqlens.tolist() == [0, 4, 8, 12] and whole_rows.max_len == 4


def test_varlen_layer_equals_dense_mask_on_random_boundaries():
    B, H, Hkv, T, hd = 3, 4, 2, 40, 8
    doc_ids = random_doc_ids(B, T, seed=1)
    g = torch.Generator().manual_seed(0)
    # the (B, T, heads, hd) -> (B, heads, T, hd) views Attention passes
    q, k, v = (torch.randn(B, T, h, hd, generator=g).transpose(1, 2) for h in (H, Hkv, Hkv))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(doc_ids, T, torch.device("cpu")), enable_gqa=True)
    got = varlen_attention(q, k, v, doc_spans(doc_ids, B, T, q.device), enable_gqa=True)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_varlen_model_equals_dense_forward_and_backward(seed):
    tokens, _ = packed_row([48], batch=2, seed=seed)
    doc_ids = random_doc_ids(2, 48, seed=seed)
    dense, varlen = make_model(attention="dense"), make_model(attention="varlen")
    out_d, out_v = dense(tokens, doc_ids), varlen(tokens, doc_ids)
    torch.testing.assert_close(out_v, out_d, rtol=0, atol=2e-5)
    out_d.square().sum().backward()
    out_v.square().sum().backward()
    for (name, pd), pv in zip(dense.named_parameters(), varlen.parameters()):
        torch.testing.assert_close(pv.grad, pd.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_varlen_without_doc_masking_is_plain_causal():
    tokens, doc_ids = packed_row([9, 13, 10], batch=2)
    with torch.no_grad():
        got = make_model(attention="varlen", doc_masking=False)(tokens, doc_ids)
        ref = make_model(attention="sdpa", doc_masking=False)(tokens, None)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)


def test_varlen_isolates_documents_bit_for_bit():
    tokens, doc_ids = packed_row([9, 13, 10], batch=2)
    model = make_model(attention="varlen")
    changed = tokens.clone()
    changed[:, :9] = (changed[:, :9] + 1) % VOCAB
    with torch.no_grad():
        assert torch.equal(model(changed, doc_ids)[:, 9:], model(tokens, doc_ids)[:, 9:])


def test_cudnn_backend_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="attention='cudnn' computes plain causal attention"):
        Decoder(TINY, VOCAB, attention="cudnn")  # doc masking is on by default
    model = make_model(attention="cudnn", doc_masking=False)
    tokens, _ = packed_row([16])
    with pytest.raises(ValueError, match="attention='cudnn' needs a CUDA device"):
        model(tokens)


def test_config_accepts_the_new_backends_and_rejects_cudnn_with_doc_masking():
    assert load_config("cpu", {"model.attention": "varlen"}).model.attention == "varlen"
    assert load_config("cpu", {"model.attention": "cudnn", "model.doc_masking": False}).model.attention == "cudnn"
    with pytest.raises(ConfigError, match="model.attention=cudnn runs plain causal attention"):
        load_config("cpu", {"model.attention": "cudnn"})


# ---------------------------------------------------------------------------------------------- GPU

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# head_dim 16: the smallest flex_attention takes on CUDA (TINY's 8 is below it)
TINY16 = Tier("tiny16", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=1024)


def _gpu_doc_ids() -> torch.Tensor:
    doc_ids = random_doc_ids(2, 512, seed=3)
    doc_ids[1] = torch.cat([torch.zeros(200), torch.ones(311), torch.full((1,), 2)]).to(torch.int32)
    return doc_ids


@pytest.mark.gpu
@requires_cuda
def test_flash_varlen_on_cuda_matches_dense_cpu_attention_in_bf16():
    B, H, Hkv, T, hd = 2, 4, 2, 512, 64
    doc_ids = _gpu_doc_ids()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, h, hd, generator=g).transpose(1, 2) for h in (H, Hkv, Hkv))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(doc_ids, T, torch.device("cpu")), enable_gqa=True)
    dev = torch.device("cuda")
    from model.decoder import _prepare_varlen

    _prepare_varlen(dev)
    spans = doc_spans(doc_ids.to(dev), B, T, dev)
    got = varlen_attention(*(t.to(dev, torch.bfloat16) for t in (q, k, v)), spans, enable_gqa=True)
    # outputs are convex combinations of v (|v| ~ 1): bf16 rounds at ~1e-2; a leak moves rows by O(0.1-1)
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)


def _model(attention: str, doc_masking: bool = True) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(TINY16, VOCAB, attention=attention, doc_masking=doc_masking)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model


def _next_token_loss(model: Decoder, tokens: torch.Tensor, doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, cross-entropy against the next token): a loss whose gradient reaches every layer. (The mean
    square of the final hidden states does not: RMSNorm makes it nearly independent of the trunk, whose
    gradients are then ~1e-8 and pure rounding noise in bf16.)"""
    logits = model.logits(model(tokens, doc_ids))                                # (B, T, V)
    targets = torch.roll(tokens, -1, dims=1)                                     # (B, T)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return logits, loss


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("attention", ["flex", "varlen"])
@pytest.mark.parametrize("compiled", [False, True])
def test_doc_masked_backends_on_cuda_match_dense_cpu_forward_and_backward(attention, compiled):
    tokens, _ = packed_row([512], batch=2, seed=1)
    doc_ids = _gpu_doc_ids()
    ref_model, model = _model("dense"), _model(attention).cuda()
    if compiled:
        model.compile_blocks()
    ref, ref_loss = _next_token_loss(ref_model, tokens, doc_ids)
    ref_loss.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, loss = _next_token_loss(model, tokens.cuda(), doc_ids.cuda())
    loss.backward()
    # Whole model in bf16 against fp32 on CPU. On CPU, bf16 autocast of the dense model itself moves the logits
    # by 0.9% and each parameter's gradient by <= 1.4% of its norm; dropping the document mask moves the
    # logits by ~100% and every gradient by >= 40% (the CPU twin below).
    assert ((got.float().cpu() - ref.detach()).norm() / ref.norm()).item() < 0.05
    for (name, pr), pg in zip(ref_model.named_parameters(), model.parameters()):
        rel = ((pg.grad.float().cpu() - pr.grad).norm() / pr.grad.norm()).item()
        assert rel < 0.1, f"{name}: gradient differs by {rel:.3f} of its norm"


def test_the_gpu_gradient_check_can_tell_a_missing_document_mask_from_bf16_rounding():
    """The CPU twin of the test above: the same loss, tolerances and model, so that its thresholds are known to
    pass bf16 rounding and to fail a model that attends across documents."""
    tokens, _ = packed_row([512], batch=2, seed=1)
    doc_ids = _gpu_doc_ids()
    ref_model = _model("dense")
    ref, ref_loss = _next_token_loss(ref_model, tokens, doc_ids)
    ref_loss.backward()

    def worst(model: Decoder, autocast: bool) -> tuple[float, float]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got, loss = _next_token_loss(model, tokens, doc_ids)
        loss.backward()
        fwd = ((got.float() - ref.detach()).norm() / ref.norm()).item()
        grads = [((pg.grad.float() - pr.grad).norm() / pr.grad.norm()).item()
                 for pr, pg in zip(ref_model.parameters(), model.parameters())]
        return fwd, grads

    fwd, grads = worst(_model("dense"), autocast=True)
    assert fwd < 0.05 and max(grads) < 0.1, (fwd, grads)
    fwd, grads = worst(_model("dense", doc_masking=False), autocast=False)
    assert fwd > 0.05 and min(grads) > 0.1, (fwd, grads)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("attention", ["cudnn", "varlen", "flex"])
def test_causal_backends_on_cuda_match_dense_cpu_without_doc_masking(attention):
    tokens, _ = packed_row([512], batch=2, seed=2)
    ref = _model("dense", doc_masking=False)(tokens)
    model = _model(attention, doc_masking=False).cuda()
    if attention == "cudnn":
        assert model._mask(None, 512, torch.device("cuda"), 2) == CUDNN_CAUSAL
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        got = model(tokens.cuda())
    assert ((got.float().cpu() - ref.detach()).norm() / ref.norm()).item() < 0.05

