"""Loss by position in the document (pipeline/eval/positions.py) on constructed cases whose every per-token loss is
known, checked exactly against the definitions written out by hand; the per-token head against full logits; and
the engine path against the fused head's mean.

    .venv/bin/python -m pytest -q tests/pipeline/eval/test_positions.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.eval.positions import (PositionStats, bucket_edges, bucket_names, cumulative_lengths, token_losses)

T = 80  # targets per row: buckets 1-64 and 64-80 (the last one holds position 80 too)


def known_losses(B: int) -> torch.Tensor:
    """loss[b, j] = b + j / 128: dyadic, so every sum below is exact in float64 whatever its order."""
    return torch.arange(B, dtype=torch.float64)[:, None] + torch.arange(T, dtype=torch.float64)[None] / 128


def doc_ids_for(starts_per_row: list[list[int]]) -> torch.Tensor:
    """(B, T+1) document ids from the token indices where documents start (0 implied)."""
    ids = torch.zeros(len(starts_per_row), T + 1, dtype=torch.int32)
    for b, starts in enumerate(starts_per_row):
        for s in starts:
            ids[b, s:] += 1
    return ids


def test_bucket_edges_are_log_spaced_up_to_the_row_length():
    assert bucket_edges(80) == [1, 64, 81] and bucket_names(80) == ["1-64", "64-80"]
    assert bucket_edges(64) == [1, 65] and bucket_names(64) == ["1-64"]
    assert bucket_names(32768) == ["1-64", "64-256", "256-1024", "1024-4096", "4096-16384", "16384-32768"]
    assert bucket_names(1000) == ["1-64", "64-256", "256-1000"]
    assert cumulative_lengths(80) == [16, 32, 64, 80] and cumulative_lengths(64) == [16, 32, 64]


def test_buckets_count_only_documents_that_reach_their_end_exactly():
    # Row 0: document A = tokens 0..69 (EOS at 69), B = 70..80 (cut by the row end). Row 1: one document over the
    # whole row. Row 2: three documents of 27 tokens. Row 3: padding (a copy of row 1), never counted.
    doc_ids = doc_ids_for([[70], [], [27, 54], []])
    losses = known_losses(4)
    stats = PositionStats(T)
    stats.add(losses, doc_ids, pad=torch.tensor([False, False, False, True]))
    res = stats.result()
    loss = lambda b, j: b + j / 128  # noqa: E731  the loss of row b's target j (the token after input j)

    # Position p of target j = tokens of its document before it. A: targets j = 0..68 at p = j + 1 (j = 69, the
    # token after A's EOS, starts B: no position); B: j = 70..79 at p = 1..10; row 1: j = 0..79 at p = 1..80.
    b1 = [loss(0, j) for j in range(0, 63)] + [loss(1, j) for j in range(0, 63)]  # p = 1..63: A and row 1 reach 63
    b2 = [loss(1, j) for j in range(63, 80)]  # p = 64..80: only row 1 reaches 80 (A ends at 69, row 2 at 26)
    assert [(b.name, b.lo, b.hi, b.docs, b.tokens) for b in res.buckets] == [("1-64", 1, 64, 2, 126),
                                                                            ("64-80", 64, 81, 1, 17)]
    assert res.buckets[0].loss == sum(b1) / len(b1) and res.buckets[1].loss == sum(b2) / len(b2)

    # Cumulative mean at L: positions 1..L of the documents reaching L. L = 16: A, B? (no: B reaches 10), row 1 and
    # row 2's three documents (p = 1..26 each; the last one is cut at the row end with p up to 26).
    docs_at = {16: [(0, 0), (1, 0), (2, 0), (2, 27), (2, 54)], 32: [(0, 0), (1, 0)], 64: [(0, 0), (1, 0)],
               80: [(1, 0)]}
    for point in res.cumulative:
        members = docs_at[point.length]
        values = [loss(b, start + p - 1) for b, start in members for p in range(1, point.length + 1)]
        assert (point.docs, point.tokens) == (len(members), len(values)), point
        assert point.ppl == math.exp(sum(values) / len(values)), point
    # Every scored target (next-document ones included), for the mean the engine reports too
    scored = [loss(b, j) for b in range(3) for j in range(T)]
    assert res.scored_tokens == 3 * T and res.loss == sum(scored) / len(scored)

    m = res.metrics("val")
    assert m["val/pos_loss/1-64"] == res.buckets[0].loss and m["val/pos_docs/64-80"] == 1.0
    assert m["val/pos_tokens/1-64"] == 126.0 and m["val/cum_ppl/80"] == res.cumulative[-1].ppl
    assert set(m) == {f"val/{kind}/{b}" for kind in ("pos_loss", "pos_docs", "pos_tokens") for b in ("1-64", "64-80")
                      } | {f"val/cum_ppl/{n}" for n in (16, 32, 64, 80)}


def test_a_scored_suffix_and_rows_without_documents():
    losses = known_losses(2)
    # No document masking: each row is one document, every target counts at p = j + 1.
    stats = PositionStats(T)
    stats.add(losses, None)
    res = stats.result()
    assert [(b.docs, b.tokens) for b in res.buckets] == [(2, 126), (2, 34)]
    assert res.buckets[1].loss == sum(b + j / 128 for b in range(2) for j in range(63, 80)) / 34
    # Only targets j >= 70 scored (the long rows of --seq-len kx): the documents still reach p = 80, and the
    # context before 70 is positions nobody scores.
    stats = PositionStats(T)
    stats.add(losses, None, score_from=70)
    res = stats.result()
    assert [(b.docs, b.tokens) for b in res.buckets] == [(0, 0), (2, 20)]
    assert math.isnan(res.buckets[0].loss) and "val/pos_loss/1-64" not in res.metrics("val")
    assert res.buckets[1].loss == sum(b + j / 128 for b in range(2) for j in range(70, 80)) / 20
    assert [(c.length, c.docs, c.tokens) for c in res.cumulative] == [(16, 0, 0), (32, 0, 0), (64, 0, 0), (80, 2, 20)]


def test_adding_batches_one_by_one_equals_adding_them_together():
    doc_ids = doc_ids_for([[70], [], [27, 54], [5, 6, 40]])
    losses = known_losses(4)
    together, apart = PositionStats(T), PositionStats(T)
    together.add(losses, doc_ids)
    for b in range(4):
        apart.add(losses[b:b + 1], doc_ids[b:b + 1])
    assert together.result() == apart.result()


@pytest.mark.parametrize("chunk", [0, 7, 1000])
def test_token_losses_equal_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 20, 16, generator=g), torch.randn(50, 16, generator=g)
    targets = torch.randint(0, 50, (3, 20), generator=g)
    targets[1] = -100  # an ignored (padding) row: zero loss
    want = F.cross_entropy((hidden @ weight.T).reshape(-1, 50), targets.reshape(-1), reduction="none",
                           ignore_index=-100).view(3, 20)
    torch.testing.assert_close(token_losses(hidden, weight, targets, chunk), want, rtol=1e-5, atol=1e-5)


def test_plot_lines_group_the_history_by_evaluation_and_draw(tmp_path):
    from pipeline.tracking.long_context_plots import plot_passkey_heatmap, plot_position_loss, position_lines

    history = {"val/pos_loss/1-64": [(50, 5.0), (100, 4.5)], "val/pos_loss/64-256": [(50, 4.8), (100, 4.2)],
               "val/cum_ppl/256": [(100, 90.0)], "eval_2x/pos_loss/256-513": [(100, 4.9)],
               "val/pos_docs/1-64": [(50, 3.0)], "val/loss": [(50, 5.0)], "val/pos_loss/1-64x": [(50, 1.0)]}
    lines = position_lines(history)
    assert [(ln.label, ln.buckets, ln.cumulative) for ln in lines] == [
        ("step 50", [(1, 64, 5.0), (64, 256, 4.8)], []),
        ("step 100", [(1, 64, 4.5), (64, 256, 4.2)], [(256, 90.0)]),
        ("eval 2x rows, step 100", [(256, 513, 4.9)], [])]
    png = plot_position_loss(lines, tmp_path / "position_loss.png", title="t")
    heat = plot_passkey_heatmap({"lengths": [64, 128], "depths": [0.0, 0.5, 1.0], "trials": 2,
                                 "accuracy": [[1.0, 0.5, 0.0], [0.0, 0.0, 0.5]], "trained_len": 64},
                                tmp_path / "passkey_heatmap.png")
    for path in (png, heat):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passkey_heatmap.png", "position_loss.png"]  # no temp files
