"""model/resonance_state.py: the resonance family's static generation state and its fixed-shape decode step —
allocated once, updated in place, the same step (and the same FLOPs) after any prompt length, compiled once without
a recompile (what lets model/decode_loop.py replay it as a CUDA graph), and equal to the full forward."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model.resonance_state import decode_compute
from tests.model.test_resonance import TINY, VOCAB, tiny_model
from tests.model.tiny import compiled_forward_ops


def test_state_is_allocated_once_and_the_step_writes_in_place():
    model = tiny_model().float()
    tokens = torch.randint(0, VOCAB, (2, 12))
    cache = model.new_kv_cache(batch_size=2, max_len=12)
    assert len(cache.state) == TINY.n_layers  # one base buffer per layer
    assert all(s.shape == (2, TINY.n_groups, TINY.n_eigen, 2) and s._base is None for s in cache.state)
    buffers = ([s.data_ptr() for s in cache.state], cache.pos.data_ptr(), cache.w_step.data_ptr(),
               cache.lam.data_ptr())
    with torch.no_grad():
        model(tokens[:, :5], kv_cache=cache)
        for t in range(5, 12):
            model.decode_step(tokens[:, t], cache)
    assert ([s.data_ptr() for s in cache.state], cache.pos.data_ptr(), cache.w_step.data_ptr(),
            cache.lam.data_ptr()) == buffers
    assert cache.length == int(cache.pos) == 12
    with pytest.raises(ValueError, match="full"):
        model.decode_step(tokens[:, 0], cache)
    with pytest.raises(ValueError, match="batch size 2"):
        model(tokens[:1, :3], kv_cache=model.new_kv_cache(batch_size=2, max_len=12))


def test_projections_follow_autocast_and_the_state_stays_fp32():
    model = tiny_model().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model.new_kv_cache(batch_size=1, max_len=8)
    assert cache.w_step.dtype == cache.w_out.dtype == torch.bfloat16  # read once per token: half the bytes
    assert cache.state[0].dtype == cache.lam.dtype == torch.float32
    tokens = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens[:, :4], kv_cache=cache)
        steps = [model.decode_step(tokens[:, t], cache) for t in range(4, 8)]
        full = model(tokens)[0, 4:]
    assert all(s.dtype == torch.float32 for s in cache.state)
    torch.testing.assert_close(torch.stack(steps, 1)[0], full, rtol=0, atol=0.05)  # bf16 matmuls, one document


def test_compiled_step_updates_each_layer_state_in_place_not_through_a_scatter_of_a_stack():
    """The compiled step's state writes, read from its forward graph (tests/model/tiny.py): no scatter, which a
    write into a view of one stacked (n_layers, ...) state becomes, and inductor runs as a copy of the whole
    stack per layer."""
    model = tiny_model().float()
    cache = model.new_kv_cache(batch_size=2, max_len=8)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, 3)), kv_cache=cache)
    ops = compiled_forward_ops(decode_compute, model, torch.tensor([1, 2]), cache)
    # the graph is the whole step: per layer one matmul for the folded input side (block.w_in and the mixer's B) and
    # one batched matmul for the mixer's C
    assert ops.get("aten.bmm.default") == TINY.n_layers, ops
    assert not [op for op in ops if "scatter" in op], ops


def test_one_compiled_step_serves_every_prompt_length_with_constant_flops():
    """Compiled once (fullgraph: no graph break; dynamic=False: shapes fixed), the step runs after prompts of 3 and
    40 tokens without a recompile and matches the eager step; its FLOPs do not depend on the prompt length."""
    import torch._dynamo

    model = tiny_model().float()
    torch._dynamo.reset()
    compiled = torch.compile(decode_compute, backend="eager", fullgraph=True, dynamic=False)
    flops = []
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for prompt_len in (3, 40):
            prompt = torch.randint(0, VOCAB, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
            eager_cache, graph_cache = (model.new_kv_cache(batch_size=2, max_len=prompt_len + 4) for _ in range(2))
            model(prompt, kv_cache=eager_cache)
            model(prompt, kv_cache=graph_cache)
            tok = torch.tensor([5, 6])
            for _ in range(4):
                with FlopCounterMode(display=False) as counter:
                    eager = model.decode_step(tok, eager_cache)
                flops.append(counter.get_total_flops())
                got = compiled(model, tok, graph_cache)
                graph_cache.length += 1  # as a CUDA-graph replay keeps it: host state moves, the step never reads it
                torch.testing.assert_close(got, eager, rtol=0, atol=1e-6)
                tok = model.logits(eager).argmax(-1)
            assert int(graph_cache.pos) == prompt_len + 4
    assert len(set(flops)) == 1 and flops[0] > 0, flops
    torch._dynamo.reset()


def test_left_padded_decode_keeps_pad_states_at_zero():
    model = tiny_model().float()
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (6, 2)]
    pad = torch.tensor([0, 4])
    idx = torch.stack([prompts[0], torch.cat([torch.full((4,), 9), prompts[1]])])
    with torch.no_grad():
        cache = model.new_kv_cache(batch_size=2, max_len=9, left_pad=pad)
        model(idx[:, :3], kv_cache=cache)  # row 1 is all pads so far: its state must still be zero
        assert all(torch.count_nonzero(s[1]) == 0 and torch.count_nonzero(s[0]) > 0 for s in cache.state)
        out = [model(idx[:, 3:], kv_cache=cache)[:, -1]]
        tok = torch.tensor([7, 8])
        for _ in range(3):
            out.append(model.decode_step(tok, cache))
        alone = model(torch.cat([prompts[1], torch.tensor([8, 8, 8])])[None])[0]  # row 1's prompt, then its 8s
    torch.testing.assert_close(torch.stack(out, 1)[1], alone[1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 64])
def test_decode_at_batch_1_and_64_equals_the_full_forward(batch):
    model = tiny_model().float()
    tokens = torch.randint(0, VOCAB, (batch, 9), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        cache = model.new_kv_cache(batch_size=batch, max_len=9)
        steps = [model(tokens[:, :5], kv_cache=cache)[:, -1]]
        steps += [model.decode_step(tokens[:, t], cache) for t in range(5, 9)]
        full = model(tokens)[:, 4:]
    # the step's folded input matmul (model/resonance_state.py) rounds in another order than block.w_in then the
    # mixer's B: fp32 differences of a few 1e-6 relative to the hidden states (|h| ~ 3); in fp64 the two agree
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=0, atol=3e-5)
    model64 = tiny_model().double()
    with torch.no_grad():
        cache = model64.new_kv_cache(batch_size=batch, max_len=9)
        model64(tokens[:, :5], kv_cache=cache)
        steps64 = [model64.decode_step(tokens[:, t], cache) for t in range(5, 9)]
        torch.testing.assert_close(torch.stack(steps64, 1), model64(tokens)[:, 5:], rtol=0, atol=1e-10)
