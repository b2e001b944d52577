"""Rows longer than training used (pipeline/eval/long_rows.py) and the engine's per-token path
(pipeline/eval/positions.py evaluate_by_position) on a synthetic dataset, Ray-free.

    .venv/bin/python -m pytest -q tests/pipeline/eval/test_long_rows.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import load_config
from pipeline.data.shards import ShardReader, eval_reader
from pipeline.data.synthetic import EOS_ID, synthetic_row, write_synthetic_dataset
from pipeline.eval.long_rows import LongRows, doc_ids_from_eos, seq_ids_of
from pipeline.eval.positions import PositionStats, evaluate_by_position

SEQ, VOCAB, N_TRAIN, N_VAL = 32, 256, 40, 10


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    ds = str(tmp_path_factory.mktemp("long_rows") / "ds")
    # seq_ids 0..39 train, 40..49 val; documents of ~12 tokens, so many cross a window's edge
    write_synthetic_dataset(ds, n_train=N_TRAIN, n_val=N_VAL, seq_len=SEQ, vocab_size=VOCAB, seed=4, rows_per_shard=16,
                            doc_lengths="12")
    return ds


def stream(seq_id: int) -> np.ndarray:
    return synthetic_row(seq_id, SEQ, VOCAB, 4, doc_lengths="12")[0]


def test_a_long_row_is_the_stream_before_its_validation_window(dataset):
    rows = LongRows(dataset, factor=3, batch_size=4)
    assert rows.row_len == 3 * (SEQ + 1) - 1 and rows.score_from == 2 * (SEQ + 1) and rows.skipped == 0
    val_ids = seq_ids_of(dataset, "val")
    batches = list(rows)
    assert len(batches) == 3 and [int(b["pad"].sum()) for b in batches] == [0, 0, 2]  # 10 rows, batches of 4
    got = torch.cat([b["tokens"] for b in batches])[:N_VAL].numpy()
    for i, r in enumerate(rows.rows):  # in stream order
        sid = int(val_ids[r])
        np.testing.assert_array_equal(got[i], np.concatenate([stream(sid - 2), stream(sid - 1), stream(sid)]))
    ids = torch.cat([b["doc_ids"] for b in batches])[:N_VAL].numpy()
    np.testing.assert_array_equal(ids, doc_ids_from_eos(got, EOS_ID))


def test_at_1x_the_rows_and_documents_are_the_validation_split(dataset):
    reader = ShardReader(dataset, "val", 1, drop_last=False)
    stored = reader.read_rows(np.arange(N_VAL))
    np.testing.assert_array_equal(doc_ids_from_eos(stored["tokens"], EOS_ID), stored["doc_ids"])
    batch = next(iter(LongRows(dataset, factor=1, batch_size=N_VAL)))
    order = np.argsort(stored["seq_id"])
    np.testing.assert_array_equal(batch["tokens"].numpy(), stored["tokens"][order])


def test_windows_without_enough_stream_before_them_are_left_out(dataset):
    rows = LongRows(dataset, factor=N_TRAIN + 3, batch_size=2)  # val seq_id s needs s - 42 >= 0
    assert rows.skipped == 2 and len(rows.rows) == N_VAL - 2
    assert next(iter(rows))["tokens"].shape == (2, (N_TRAIN + 3) * (SEQ + 1))


def test_ranks_split_the_rows_and_pad_the_same_number_of_batches(dataset):
    one = [b["tokens"] for b in LongRows(dataset, 2, 2)]
    two = [[b for b in LongRows(dataset, 2, 2, rank=r, world_size=2)] for r in range(2)]
    assert len(two[0]) == len(two[1]) == 3  # 10 rows, global batches of 4: the last one half padding
    assert [int(b["pad"].sum()) for b in two[0]] == [0, 0, 0] and [int(b["pad"].sum()) for b in two[1]] == [0, 0, 2]
    rebuilt = [torch.cat([two[0][i]["tokens"], two[1][i]["tokens"]]) for i in range(3)]
    assert torch.equal(torch.cat(rebuilt)[:N_VAL], torch.cat(one)[:N_VAL])


@pytest.mark.parametrize("mixer", ["attention", "resonance"])
def test_engine_by_position_matches_the_fused_head_and_full_logits(dataset, mixer):
    from pipeline.train.engine import Engine

    cfg = load_config("test", {"model.tier": "nano", "model.mixer": mixer, "model.tie_embeddings": mixer == "attention",
                               "data.seq_len": SEQ, "data.vocab_size": VOCAB, "train.batch_size": 4,
                               "model.compile": "off", "tracking.enabled": False})
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    res = evaluate_by_position(engine, eval_reader(dataset, 4), SEQ)
    assert res.scored_tokens == N_VAL * SEQ
    assert res.loss == pytest.approx(engine.evaluate(eval_reader(dataset, 4))["val/loss"], rel=1e-5)
    # The same statistics from logits over the whole vocabulary, row by row
    want = PositionStats(SEQ)
    with torch.no_grad():
        for batch in eval_reader(dataset, 4):
            hidden = engine.module.decoder(batch["tokens"][:, :-1], batch["doc_ids"][:, :-1])
            logits = hidden @ engine.module.decoder.output_weight.T
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["tokens"][:, 1:], reduction="none")
            want.add(losses.masked_fill(batch["pad"][:, None], 0), batch["doc_ids"], batch["pad"])
    expected = want.result()
    for got, ref in zip(res.buckets, expected.buckets):
        assert (got.name, got.docs, got.tokens) == (ref.name, ref.docs, ref.tokens) and got.tokens > 0
        assert got.loss == pytest.approx(ref.loss, rel=1e-5)
    # 2x rows score the same targets with more context: same count, a loss of the same model on them
    long = LongRows(dataset, 2, 2)
    res2 = evaluate_by_position(engine, long, long.row_len, score_from=long.score_from)
    assert res2.scored_tokens == N_VAL * SEQ and res2.row_len == 2 * SEQ + 1
    assert [b.name for b in res2.buckets] == ["1-64", "64-65"]
