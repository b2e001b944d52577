"""What one decode step writes, dispatches and syncs, counted on CPU (bench/decode_step_counts.py and its counter,
bench/step_counts.py).

A decode step must write its new K/V entries, its logits and the row's activations; nothing of the size of the
cache. The H200's batch-64 generation ran at a quarter of its speed because the compiled step copied the whole
stacked cache once per layer (bench/decode_step_counts.py at 1fbae28: 36 MB written per row after 8,192 cached
tokens for tier nano, 1.2 MB eager). Held here, at batches 1, 2, 5 and cache lengths 16 and 700:
    - the fused path writes the same bytes at every cache length, grows linearly with the batch, and no op writes
      more per row than one activation vector or one row of logits;
    - the split-K path (CUDA's small batches) grows with the cache only by its scores: a few fp32 values per query
      head and slot, less than one copy of the keys;
    - the ops dispatched are the same at every batch and cache length, and none syncs the host.
The eager step is counted in the quick tier; the forward graph torch.compile hands inductor (where the copy hid) in
the system tier (it compiles once per shape).
"""
from __future__ import annotations

import pytest
import torch

from bench.decode_step_counts import count_shape, traffic_model
from model.decoder import Decoder
from model.tiers import Tier

# head_dim 32: a copy of the keys (64 B a slot, layer and key head) stands well above the split-K path's scores (a
# few fp32 values a slot, layer and query head). The fused path is checked grouped-query (2 query heads share 1
# key/value head); the split-K path as every tier of model/tiers.py is, one key head per query head: with grouped
# heads and more than one chunk its probabilities do not fold into torch.matmul's batch and are copied once a layer
# at batch > 1 (a score-sized tensor, one more op; model/kv_cache.py)
GQA = Tier("counts_gqa", d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=96, max_seq_len=4096)
MHA = Tier("counts_mha", d_model=64, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=96, max_seq_len=4096)
TIERS = {"fused": GQA, "split_k": MHA}
VOCAB = 500
BATCHES, LENS = (1, 2, 5), (16, 700)
SCORE_TENSORS = 6  # fp32 (B, H, span) tensors a split-K layer may write: scores, +bias, softmax's max/exp/sum/out


def _model(tier: Tier) -> Decoder:
    torch.manual_seed(0)
    return Decoder(tier, VOCAB).eval()


def _rows(part: str, attention: str) -> dict[tuple[int, int], dict]:
    model = _model(TIERS[attention])
    return {(B, L): row for B in BATCHES for L in LENS
            for row in count_shape(model, B, L, attention, VOCAB, parts=(part,))}


def _same_ops_no_syncs(rows: dict) -> None:
    assert len({r["ops"] for r in rows.values()}) == 1, {k: r["ops"] for k, r in rows.items()}
    assert all(r["syncs"] == 0 for r in rows.values())


def _nothing_grows_with_the_cache(rows: dict) -> None:
    t = GQA
    widest = max(t.d_model, 2 * t.d_ff, (t.n_heads + 2 * t.n_kv_heads) * t.head_dim)
    per_op_row_limit = 4 * max(widest, VOCAB)  # one fp32 activation vector or one row of logits
    for B in BATCHES:
        assert rows[(B, LENS[0])]["bytes_written"] == rows[(B, LENS[1])]["bytes_written"], B
    total = {B: rows[(B, LENS[1])]["bytes_written"] for B in BATCHES}
    per_row = (total[5] - total[1]) / 4
    assert total[2] - total[1] == per_row  # linear in the batch
    lo, hi = rows[(1, LENS[1])]["by_op"], rows[(5, LENS[1])]["by_op"]
    for op, v in hi.items():
        assert (v["bytes"] - lo[op]["bytes"]) / 4 / v["calls"] <= per_op_row_limit, (op, v)
    model_bytes = traffic_model(_model(t), VOCAB)
    assert per_row >= model_bytes["kv_entry_bytes_per_row"] + model_bytes["logits_bytes_per_row"]


def _grows_only_by_scores(rows: dict) -> None:
    span = {L: rows[(1, L)]["span"] for L in LENS}
    extra_slots = span[LENS[1]] - span[LENS[0]]
    t = MHA
    keys_per_slot_layer = t.n_kv_heads * t.head_dim * 4
    for B in BATCHES:
        growth = rows[(B, LENS[1])]["bytes_written"] - rows[(B, LENS[0])]["bytes_written"]
        per = growth / (B * t.n_layers * extra_slots)  # bytes a row, layer and slot
        assert 0 < per <= SCORE_TENSORS * 4 * t.n_heads < keys_per_slot_layer, (B, per)


@pytest.mark.parametrize("part", ["model_eager", "sampler_emit"])
def test_the_fused_eager_step_writes_rows_not_cache(part):
    rows = _rows(part, "fused")
    _same_ops_no_syncs(rows)
    if part == "model_eager":
        _nothing_grows_with_the_cache(rows)
    else:  # the reference sampler and the loop's bookkeeping: per row, passes over the logits
        for B in BATCHES:
            assert rows[(B, LENS[0])]["bytes_written"] == rows[(B, LENS[1])]["bytes_written"]


def test_the_split_k_eager_step_grows_with_the_cache_only_by_its_scores():
    rows = _rows("model_eager", "split_k")
    _same_ops_no_syncs(rows)
    _grows_only_by_scores(rows)


@pytest.mark.system  # ~20 s: one AOTAutograd trace per shape
@pytest.mark.parametrize("attention", ["fused", "split_k"])
def test_the_compiled_step_writes_rows_not_cache(attention):
    """The graph inductor compiles: the stacked-cache copy lived here and nowhere in the eager step."""
    rows = _rows("model_compiled", attention)
    _same_ops_no_syncs(rows)
    if attention == "fused":
        _nothing_grows_with_the_cache(rows)
    else:
        _grows_only_by_scores(rows)
