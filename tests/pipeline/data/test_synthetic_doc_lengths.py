"""Document-length distributions of the synthetic rows the benchmarks train on."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipeline.data.shards import ShardReader
from pipeline.data.synthetic import (EOS_ID, WEB_DOC_LENGTHS, DocLengthsError, parse_doc_lengths, synthetic_batches,
                                     synthetic_row, write_synthetic_dataset)


def row_doc_lengths(doc_ids: np.ndarray) -> np.ndarray:
    return np.bincount(doc_ids)


def test_specs_parse_to_the_named_distributions():
    assert parse_doc_lengths("web") is WEB_DOC_LENGTHS
    g = parse_doc_lengths("8192")
    assert (g.kind, g.mean, g.mean_tokens) == ("geometric", 8192.0, 8192.0)
    ln = parse_doc_lengths("lognormal:600:1.2")
    assert (ln.kind, ln.median, ln.sigma) == ("lognormal", 600.0, 1.2)
    assert ln.mean_tokens == pytest.approx(600 * math.exp(0.72))
    assert "median 400" in WEB_DOC_LENGTHS.describe()
    for bad in ("webby", "0", "lognormal:600", "lognormal:600:-1", "lognormal:a:b", ""):
        with pytest.raises(DocLengthsError, match="is not a document-length distribution"):
            parse_doc_lengths(bad)


def test_rows_follow_the_distribution_and_mark_every_boundary_with_eos():
    T = 4096
    lengths, tokens_ok = [], True
    for seq_id in range(300):
        tokens, doc_ids = synthetic_row(seq_id, T, 1000, seed=1, doc_lengths="lognormal:100:0.8")
        assert doc_ids[0] == 0 and np.all(np.diff(doc_ids) >= 0) and np.all(np.diff(doc_ids) <= 1)
        starts = np.flatnonzero(np.diff(doc_ids)) + 1
        tokens_ok &= bool(np.all(tokens[starts - 1] == EOS_ID)) and int((tokens == EOS_ID).sum()) == len(starts)
        lengths += row_doc_lengths(doc_ids)[1:-1].tolist()  # whole documents only (not cut by the row ends)
    assert tokens_ok
    logs = np.log(lengths)
    # ~8,500 documents: median and spread within a few percent of the spec (whole documents inside a row lean
    # slightly short: a long one is more often cut by a row end)
    assert math.exp(np.median(logs)) == pytest.approx(100, rel=0.06)
    assert logs.std() == pytest.approx(0.8, rel=0.06)


def test_rows_are_deterministic_and_the_default_rows_are_unchanged():
    a = synthetic_row(5, 256, 500, seed=2, doc_lengths="web")
    b = synthetic_row(5, 256, 500, seed=2, doc_lengths="web")
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    # no doc_lengths: the geometric rows (mean seq_len // 4) every other test was written against
    _, doc_ids = synthetic_row(5, 256, 500, seed=2)
    rng = np.random.default_rng([2, 5])
    rng.integers(4, 500, size=257, dtype=np.int64)
    expected, pos = np.zeros(257, np.int32), 0
    while (pos := pos + int(rng.geometric(1 / 64))) < 257:
        expected[pos:] += 1
    assert expected.max() > 0 and np.array_equal(doc_ids, expected)


def test_web_rows_hold_short_documents_and_few_within_document_pairs():
    T = 32768
    pairs, docs = [], []
    for seq_id in range(8):
        _, doc_ids = synthetic_row(seq_id, T, 32000, doc_lengths="web")
        n = row_doc_lengths(doc_ids[:-1])
        pairs.append((n * (n + 1) // 2).sum() / (T * (T + 1) // 2))
        docs.append(len(n))
    assert 30 < np.mean(docs) < 70  # ~48 documents of ~700 tokens
    assert 0.02 < np.mean(pairs) < 0.12  # vs ~0.36 for geometric rows with mean T / 4


def test_manifest_spec_fits_the_recorded_statistics(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"doc_length": {"count": 1000, "mean": 900.0, "min": 3, "max": 40000, "p50_approx": 512, "p90_approx": 2048,
                        "p99_approx": 8192}}))
    d = parse_doc_lengths(f"manifest:{tmp_path}")
    assert d.kind == "lognormal" and d.label == f"manifest:{tmp_path}"
    assert d.sigma == pytest.approx(math.log(4) / 1.2815515655446004)
    assert d.mean_tokens == pytest.approx(900.0)  # the exact recorded mean is kept
    with pytest.raises(DocLengthsError, match="no manifest"):
        parse_doc_lengths(f"manifest:{tmp_path / 'missing'}")
    (tmp_path / "manifest.json").write_text(json.dumps({"doc_length": {}}))
    with pytest.raises(DocLengthsError, match="has no doc_length"):
        parse_doc_lengths(f"manifest:{tmp_path}")


def test_dataset_and_batches_carry_the_distribution(tmp_path):
    write_synthetic_dataset(tmp_path, n_train=4, n_val=2, seq_len=512, vocab_size=300, doc_lengths="lognormal:40:0.5")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert "log-normal, median 40" in manifest["source"]["doc_lengths"]
    from_shards = next(iter(ShardReader(tmp_path, "train", 2, seed=0, epoch=0, start=0)))
    rows = [synthetic_row(int(i), 512, 300, doc_lengths="lognormal:40:0.5") for i in from_shards["seq_id"]]
    assert np.array_equal(from_shards["doc_ids"].numpy(), np.stack([r[1] for r in rows]))
    batch = next(synthetic_batches(n_sequences=4, seq_len=512, vocab_size=300, batch_size=2,
                                   doc_lengths="lognormal:40:0.5"))
    assert batch["doc_ids"].max() > 5  # ~13 documents per 512-token row
