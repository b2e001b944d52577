"""Tiny, deterministic models and packed rows shared by the model tests (CPU, fp32)."""
from __future__ import annotations

import torch

from model.decoder import Decoder
from model.tiers import Tier

VOCAB = 97
# GQA (4 query heads share 2 key/value heads), 3 layers so every_2 checkpoints a strict subset
TINY = Tier("tiny", d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=256)
# The GPU tests' model: TINY's width with head_dim 16, the smallest flex_attention's CUDA kernels accept (TINY's 8
# fails there); still GQA (2 query heads share 1 key/value head)
TINY_GPU = Tier("tiny_gpu", d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=1024)


def make_model(tier: Tier = TINY, **kw) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(tier, VOCAB, **kw).eval()
    # init_weights' 0.02 std makes every block nearly the identity; larger weights make the tests sharper
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


def compiled_forward_ops(fn, *args) -> dict[str, int]:
    """Run torch.compile(fn)(*args) once (fullgraph, static shapes) and count the aten ops of the forward graph that
    AOTAutograd hands the backend: what functionalisation made of fn's in-place writes. An in-place write into a
    view of a stacked graph input shows up as a select_scatter/slice_scatter, which inductor runs as a copy of the
    whole stack; a write into a base buffer stays one index_copy (reinplaced by inductor)."""
    from collections import Counter

    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    ops: Counter = Counter()

    def forward_graph(gm, example_inputs):
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(fn, backend=aot_autograd(fw_compiler=forward_graph), fullgraph=True, dynamic=False)(*args)
    finally:
        torch._dynamo.reset()
    return dict(ops)


def packed_row(lengths: list[int], batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (batch, sum(lengths)) int64 and doc_ids (batch, sum(lengths)) int32 for documents of these lengths."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    tokens = torch.randint(0, VOCAB, (batch, T), generator=g)
    doc_ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    return tokens, doc_ids.expand(batch, T).contiguous()
