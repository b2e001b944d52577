"""KV-cached batched generation: same greedy tokens as recomputing the full prefix every step."""
from __future__ import annotations

import pytest
import torch

from model.decoder import build_model
from model.decode_loop import generate_ids, generate_ids_timed


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


class CacheProtocolOnly(torch.nn.Module):
    """A model that keeps only the generic generation protocol (new_kv_cache + model(ids, kv_cache=cache),
    logits, output_weight) and no decode_compute (any model from outside this project): the loop runs it eagerly."""

    def __init__(self, decoder):
        super().__init__()
        self.inner = decoder

    @property
    def output_weight(self):
        return self.inner.output_weight

    def new_kv_cache(self, batch_size, max_len, left_pad=None):
        return self.inner.new_kv_cache(batch_size, max_len, left_pad)

    def logits(self, hidden):
        return self.inner.logits(hidden)

    def forward(self, ids, kv_cache=None):
        return self.inner(ids, kv_cache=kv_cache)


class GraphSafeStep(CacheProtocolOnly):
    """A model with a graph-safe `decode_compute(tok, state, span=None)` whose state names no span bucket (no
    decode_span), as a recurrent-state model would: the loop takes the graph path's step (one graph, span None)."""

    def new_kv_cache(self, batch_size, max_len, left_pad=None):
        return StateWithoutSpan(self.inner.new_kv_cache(batch_size, max_len, left_pad))

    def forward(self, ids, kv_cache=None):
        return self.inner(ids, kv_cache=kv_cache.cache)

    def decode_compute(self, tok, state, span=None):
        assert span is None
        return self.inner.decode_compute(tok, state.cache)


class StateWithoutSpan:
    def __init__(self, cache):
        self.cache = cache

    length = property(lambda self: self.cache.length, lambda self, v: setattr(self.cache, "length", v))
    max_len = property(lambda self: self.cache.max_len)


@torch.no_grad()
def test_a_model_with_its_own_graph_safe_step_gives_the_same_tokens():
    decoder = make_decoder(6)
    prompts = [[4, 5, 6], [9, 10, 11, 12]]
    kw = dict(max_new_tokens=7, temperature=1.0, top_k=30, seed=2)
    assert torch.equal(generate_ids(GraphSafeStep(decoder), prompts, **kw), generate_ids(decoder, prompts, **kw))


@torch.no_grad()
def test_generic_cache_protocol_model_gives_the_same_tokens():
    decoder = make_decoder(3)
    prompts = [[4, 5, 6, 7, 8], [9, 10, 11]]
    kw = dict(max_new_tokens=7, temperature=1.0, top_p=0.9, seed=5)
    assert torch.equal(generate_ids(CacheProtocolOnly(decoder), prompts, **kw), generate_ids(decoder, prompts, **kw))


@torch.no_grad()
def test_timings_count_every_phase_and_cpu_decodes_eagerly():
    decoder = make_decoder(4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    ids, timings = generate_ids_timed(decoder, prompts, max_new_tokens=10, temperature=0.0)
    assert torch.equal(ids, generate_ids(decoder, prompts, max_new_tokens=10, temperature=0.0))
    assert timings.prefill_tokens == 9 and not timings.cuda_graph
    assert timings.warmup_tokens + timings.decode_tokens == 2 * 10 and timings.decode_tokens > 0
    assert min(timings.prefill_s, timings.warmup_s, timings.decode_s) >= 0
    one = generate_ids_timed(decoder, prompts[:1], max_new_tokens=1, temperature=0.0)[1]
    assert one.decode_tokens == 0 and one.decode_tokens_per_s == 0.0
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
        generate_ids(decoder, prompts, max_new_tokens=3, cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_cuda_graph_decoding_equals_eager_decoding_in_bf16():
    """The captured decode step replays real steps: the same greedy and sampled tokens as the eager loop, for a
    left-padded batch (tiny model with head_dim 16, in bf16 as load_for_generation prepares it)."""
    from pipeline.train.handoff.text_generation import prepare_for_generation
    from tests.model.tiny import TINY_GPU, make_model

    decoder = prepare_for_generation(make_model(TINY_GPU), torch.device("cuda"))
    prompts = [[7, 8, 9, 10, 11, 12, 13], [40, 41], [60, 3, 70, 71]]
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=2)):
        eager = generate_ids(decoder, prompts, max_new_tokens=12, cuda_graph=False, **kw)
        graphed, timings = generate_ids_timed(decoder, prompts, max_new_tokens=12, cuda_graph=True, **kw)
        assert timings.cuda_graph
        assert torch.equal(graphed, eager), kw


@torch.no_grad()
def test_compiled_step_gives_the_same_tokens_and_compiles_once():
    """compile_step (torch.compile of model + logits; the "eager" backend here: inductor's C++ build takes minutes
    on 2 cores) keeps the tokens, and a second generation of the same shape reuses the compiled step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    decoder = make_decoder(5)
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=7)
    torch._dynamo.reset()
    counters.clear()
    compiled = generate_ids(decoder, prompts, compile_step="eager", **kw)
    frames = counters["stats"]["unique_graphs"]
    assert torch.equal(compiled, generate_ids(decoder, prompts, compile_step=False, **kw))
    with torch._dynamo.config.patch(error_on_recompile=True):
        again, timings = generate_ids_timed(decoder, prompts, compile_step="eager", **kw)
    assert torch.equal(again, compiled) and timings.compiled and frames == counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.system  # ~9 s: two generations traced with symbolic lengths
@torch.no_grad()
def test_the_compiled_step_compiles_once_whatever_the_prompt_length():
    """The cache's length dimensions and the span are dynamic from the first compile: prompts of 3 and 500 tokens
    (caches of 256 and 768 slots; spans 256 and 512, and 768 crossed within the second generation) run one compiled
    step, never recompiled, and give the tokens of the uncompiled step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    decoder = make_decoder(6)
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=3)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate((3, 500)):
        prompts = torch.randint(0, 90, (2, n), generator=g).tolist()
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = generate_ids(decoder, prompts, compile_step="eager", **kw)
        assert torch.equal(got, generate_ids(decoder, prompts, compile_step=False, **kw)), n
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_a_long_prompt_is_prefilled_in_chunks_with_the_tokens_of_one_forward(monkeypatch):
    """Prompts longer than PREFILL_CHUNK run in chunks (each attends to the cache so far): the same greedy tokens as
    one forward over the whole prompt, left-padded rows included, and the timings count the chunks."""
    from model import decode_loop

    decoder = make_decoder(7)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (37, 23)]
    whole, t_whole = generate_ids_timed(decoder, prompts, max_new_tokens=5, temperature=0.0)
    monkeypatch.setattr(decode_loop, "PREFILL_CHUNK", 8)
    chunked, t_chunked = generate_ids_timed(decoder, prompts, max_new_tokens=5, temperature=0.0)
    assert torch.equal(chunked, whole)
    assert (t_whole.prefill_chunks, t_chunked.prefill_chunks) == (1, 5)
    assert t_chunked.cache_s > 0 and t_chunked.first_sample_s > 0 and t_chunked.first_step_s > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_compiled_whole_step_graph_equals_eager_across_span_buckets():
    """A 250-token prompt and 40 new tokens cross the 256-slot span bucket: two graphs of the inductor-compiled
    step, and the same greedy and sampled tokens as the same compiled step run eagerly (inductor's fused kernels
    round differently from the uncompiled ops, so the comparison is compiled against compiled)."""
    from pipeline.train.handoff.text_generation import prepare_for_generation
    from tests.model.tiny import TINY_GPU, make_model

    decoder = prepare_for_generation(make_model(TINY_GPU), torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 90, (250,), generator=g).tolist(), torch.randint(0, 90, (240,), generator=g).tolist()]
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, top_k=20, seed=4)):
        eager = generate_ids(decoder, prompts, max_new_tokens=40, cuda_graph=False, compile_step=True, **kw)
        graphed, timings = generate_ids_timed(decoder, prompts, max_new_tokens=40, cuda_graph=True,
                                              compile_step=True, **kw)
        assert timings.cuda_graph and timings.compiled and timings.graphs == 2
        assert torch.equal(graphed, eager), kw


@pytest.mark.system
def test_a_decode_graph_is_captured_only_for_a_span_that_ran_at_every_prompt_length():
    """The decode plan of a graphed generation (what generate_ids_timed follows), for every prompt length up to
    9,000 and 64 new tokens, from the spans the real KV cache gives: the first WARMUP_STEPS steps run eagerly, a
    span is captured only after a step ran it eagerly (never compiled or first launched inside a capture; prompt
    lengths 254, 510, 766, ... cross a bucket right after the warm-up), captured once, and replayed after."""
    from model.kv_cache import KVCache
    from model.decode_loop import CAPTURE, EAGER, REPLAY, WARMUP_STEPS, _DecodeLoop, decode_plan

    new = 64
    crossing = 0
    for prompt_len in range(1, 9001):
        cache = KVCache(1, 1, prompt_len + new, n_kv_heads=1, head_dim=2, rope=10000.0)
        cache.length = prompt_len  # after the prefill
        loop = _DecodeLoop.__new__(_DecodeLoop)
        loop.cache, loop.span_at = cache, cache.span_for
        spans = loop.spans(new - 1)
        assert spans[0] == cache.decode_span()
        plan = decode_plan(spans)
        assert plan[:WARMUP_STEPS] == [EAGER] * WARMUP_STEPS, prompt_len
        ran, captured = set(), set()
        for span, action in zip(spans, plan):
            if action == EAGER:
                ran.add(span)
            elif action == CAPTURE:
                assert span in ran and span not in captured, (prompt_len, span)
                captured.add(span)
            else:
                assert action == REPLAY and span in captured, (prompt_len, span)
        assert captured, prompt_len  # 63 steps always reach a replay
        crossing += spans[WARMUP_STEPS] != spans[WARMUP_STEPS - 1]
    assert crossing >= 24  # the prompt lengths whose first capture would have met a new span


def test_a_model_without_spans_captures_after_the_warm_up():
    from model.decode_loop import CAPTURE, EAGER, REPLAY, decode_plan

    assert decode_plan([None] * 6, warmup=2) == [EAGER, EAGER, CAPTURE, REPLAY, REPLAY, REPLAY]
    assert decode_plan([None] * 2, warmup=2) == [EAGER, EAGER]
