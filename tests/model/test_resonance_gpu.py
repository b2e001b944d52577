"""The resonance family on a real GPU: the Numba scan kernel inside the model (bf16 autocast, compiled blocks)
against the FFT form and the reference scan, document isolation through the kernel, and the recurrent decode step
captured in a CUDA graph by model/decode_loop.py.

    .venv/bin/python -m pytest tests/model/test_resonance_gpu.py -q -m gpu

Skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from model.resonance import ResonanceLM, build_resonance_model
from model.tiers import RESONANCE_TIERS
from tests.model.test_resonance import TINY, VOCAB

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def tier_b_block_outputs(form: str, x: torch.Tensor, starts=None):
    torch.manual_seed(0)
    model = build_resonance_model("B", 32000).cuda()
    block = model.blocks[0]
    block.compile()
    xx = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, last = block(xx, form, starts)
    out.float().square().mean().backward()
    return out.detach().float(), xx.grad.float(), block.mixer.alpha.grad.clone()


def test_the_kernel_scan_equals_the_fft_form_in_a_compiled_tier_b_block():
    """bf16 projections around an fp32 core: the two forms see the same bf16 z, so their outputs differ only by
    the rounding of s to bf16 (2^-8 relative) and its effect downstream."""
    x = torch.randn(1, 8192, 768, device="cuda")
    kernel = tier_b_block_outputs("scan", x)
    fft = tier_b_block_outputs("fft", x)
    for a, b in zip(kernel, fft):
        assert float((a - b).abs().max() / b.abs().max()) < 2e-2


def test_documents_stay_isolated_through_the_kernel():
    torch.manual_seed(0)
    model = ResonanceLM(TINY, VOCAB).cuda().eval()
    lengths = [50, 1, 300, 673]
    tokens = torch.randint(0, VOCAB, (1, sum(lengths)), device="cuda")
    doc_ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]).cuda()[None]
    with torch.no_grad():
        packed = model(tokens, doc_ids)  # the kernel scan with resets
        start = 0
        for n in lengths:
            alone = model(tokens[:, start:start + n])  # the kernel scan, one document
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


def test_decode_is_captured_in_a_cuda_graph_and_matches_eager():
    from model.decode_loop import generate_ids_timed

    torch.manual_seed(0)
    model = build_resonance_model("nano", 300).cuda().eval()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8]]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graph_ids, graph_t = generate_ids_timed(model, prompts, max_new_tokens=12, temperature=0.0, cuda_graph=True)
        eager_ids, eager_t = generate_ids_timed(model, prompts, max_new_tokens=12, temperature=0.0, cuda_graph=False)
    assert graph_t.cuda_graph and not eager_t.cuda_graph
    assert torch.equal(graph_ids, eager_ids)


def test_tier_b_trains_a_step_at_131072_tokens_with_the_kernel():
    """One training step of tier B at batch 1 and 131,072 tokens (bf16 autocast, compiled blocks): finite
    gradients everywhere; bench/mixer.py measures its speed and memory."""
    from cuda_ops.cross_entropy import linear_cross_entropy

    torch.manual_seed(0)
    model = ResonanceLM(RESONANCE_TIERS["B"], 32000).cuda().compile_blocks()
    tokens = torch.randint(0, 32000, (1, 131073), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = model(tokens[:, :-1])
        res = linear_cross_entropy(hidden.reshape(-1, 768), model.output_weight, tokens[:, 1:].reshape(-1))
    res.mean().backward()
    assert model.training_form(torch.device("cuda")) == "kernel"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
