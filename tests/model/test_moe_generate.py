"""Generation with mixture-of-experts tiers (both families): the KV-cached / recurrent decode loop gives the tokens of
recomputing the whole prefix, its step reads nothing on the host (so it can be captured in a CUDA graph), and a
compiled step compiles once.

    .venv/bin/python -m pytest tests/model/test_moe_generate.py -q
"""
from __future__ import annotations

import pytest
import torch

from model.decode_loop import generate_ids, generate_ids_timed
from model.decoder import build_model
from model.moe import moe_layers

VOCAB = 97


def _model(mixer: str, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model("nano-moe", VOCAB, mixer=mixer).eval()
    with torch.no_grad():  # decisive, varied greedy steps (a fresh init repeats one token)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model


def _recompute_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq, out = torch.tensor([prompt]), []
    for _ in range(n):
        nxt = int(model.logits(model(seq)[:, -1]).argmax(-1))
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.mark.parametrize("mixer,impl", [("attention", "auto"), ("resonance", "auto"), ("attention", "gathered"),
                                        ("attention", "per_expert")])
@torch.no_grad()
def test_cached_greedy_equals_full_recompute(mixer, impl):
    model = _model(mixer)
    for layer in moe_layers(model):
        layer.impl = impl
    prompt = [5, 17, 33, 2, 90, 41]
    got = generate_ids(model, [prompt], max_new_tokens=10, temperature=0.0)[0].tolist()
    want = _recompute_greedy(model, prompt, 10)
    assert got == want and len(set(want)) >= 4


@pytest.mark.parametrize("mixer", ["attention", "resonance"])
@torch.no_grad()
def test_left_padded_batch_equals_each_prompt_alone(mixer):
    model = _model(mixer, 1)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]
    batch = generate_ids(model, prompts, max_new_tokens=6, temperature=0.0).tolist()
    assert batch == [generate_ids(model, [p], max_new_tokens=6, temperature=0.0)[0].tolist() for p in prompts]


@pytest.mark.parametrize("mixer", ["attention", "resonance"])
@pytest.mark.parametrize("impl", ["grouped", "gathered"])
@torch.no_grad()
def test_the_decode_step_reads_nothing_on_the_host(mixer, impl, monkeypatch):
    """The step a CUDA graph captures (decode_compute) routes by top-k on the device and dispatches with fixed shapes:
    no .item(), .tolist(), bool() or copy to the host inside it, on either fixed-shape expert path."""
    model = _model(mixer)
    for layer in moe_layers(model):
        layer.impl = impl
    cache = model.new_kv_cache(2, 16)
    model(torch.tensor([[1, 2, 3], [4, 5, 6]]), kv_cache=cache)
    tok = torch.tensor([7, 8])
    states = [s.clone() for s in getattr(cache, "state", [])]  # the resonance state advances in place
    want = model.decode_compute(tok, cache)
    cache.pos -= 1  # the same step again, watched
    for buffer, before in zip(getattr(cache, "state", []), states):
        buffer.copy_(before)

    def host_read(self, *a, **k):
        raise AssertionError("the decode step read a tensor on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    got = model.decode_compute(tok, cache)
    monkeypatch.undo()
    assert torch.equal(got, want)


@pytest.mark.system  # docs/tests.md: over ~5 s (dynamo traces the whole step)
@torch.no_grad()
def test_a_compiled_moe_step_gives_the_same_tokens_and_compiles_once():
    """torch.compile of the step (the "eager" backend: inductor's C++ build takes minutes on 2 cores) traces the MoE
    layer without a graph break on its fixed-shape path, keeps the tokens, and does not recompile."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = _model("attention", 2)
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    kw = dict(max_new_tokens=5, temperature=1.0, top_p=0.9, seed=7)
    torch._dynamo.reset()
    counters.clear()
    compiled = generate_ids(model, prompts, compile_step="eager", **kw)
    frames = counters["stats"]["unique_graphs"]
    assert torch.equal(compiled, generate_ids(model, prompts, compile_step=False, **kw))
    with torch._dynamo.config.patch(error_on_recompile=True):
        again, timings = generate_ids_timed(model, prompts, compile_step="eager", **kw)
    assert torch.equal(again, compiled) and timings.compiled and frames == counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
