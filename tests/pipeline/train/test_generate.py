"""KV-cached batched generation: same greedy tokens as recomputing the full prefix every step."""
from __future__ import annotations

import torch

from model.decoder import build_model
from pipeline.train.generate import generate_ids


def full_recompute_greedy(decoder, prompt: list[int], n: int) -> list[int]:
    seq = torch.tensor([prompt])
    out = []
    for _ in range(n):
        nxt = int(decoder.logits(decoder(seq)[:, -1]).argmax(-1))
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


def make_decoder(seed=0):
    torch.manual_seed(seed)
    return build_model("nano", 97).eval()


@torch.no_grad()
def test_cached_greedy_equals_full_recompute():
    decoder = make_decoder()
    prompt = [5, 17, 33, 2, 90, 41]
    cached = generate_ids(decoder, [prompt], max_new_tokens=12, temperature=0.0)[0].tolist()
    assert cached == full_recompute_greedy(decoder, prompt, 12)


@torch.no_grad()
def test_left_padded_batch_equals_each_prompt_alone():
    decoder = make_decoder(1)
    prompts = [[7, 8, 9, 10, 11, 12, 13], [40, 41], [60, 3, 70, 71]]
    batch = generate_ids(decoder, prompts, max_new_tokens=8, temperature=0.0).tolist()
    for p, row in zip(prompts, batch):
        assert row == full_recompute_greedy(decoder, p, 8), p


@torch.no_grad()
def test_seeded_sampling_repeats_and_eos_stops_rows():
    decoder = make_decoder(2)
    prompts = [[5, 6, 7], [9, 10]]
    a = generate_ids(decoder, prompts, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    b = generate_ids(decoder, prompts, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    c = generate_ids(decoder, prompts, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # With EOS = the first greedy token of row 0, row 0 stops at once and stays EOS.
    first = int(generate_ids(decoder, prompts[:1], max_new_tokens=1, temperature=0.0)[0, 0])
    out = generate_ids(decoder, prompts, max_new_tokens=6, temperature=0.0, eos_id=first)
    assert out[0].tolist() == [first] * 6
