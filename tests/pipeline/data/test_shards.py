"""Shards: schema any Arrow tool reads, the two readers (same batches, same order), manifest and validation."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data.stages import validate_main
from pipeline.data.validate_dataset import validate_dataset
from pipeline.data.shards import (DatasetError, ShardReader, check_compatible, check_trainable, epoch_order,
                                  eval_reader, load_manifest, ray_batches)
from pipeline.data.tokenizer import train_tokenizer
from tests.pipeline.data.helpers import SEQ_LEN, read_rows, sample_docs

WIDTH = SEQ_LEN + 1


@pytest.fixture(scope="module")
def dataset(files_dataset):
    """The session's files dataset (tests/pipeline/conftest.py): 60 help topics on the session tokenizer, 100 rows a
    shard, 10% validation; read here, damaged only in private copies (copy_of)."""
    return files_dataset.dataset


@pytest.fixture
def copy_of(dataset, tmp_path):
    """A private copy to damage."""
    return shutil.copytree(dataset, tmp_path / "copy")


def test_schema_and_any_arrow_tool_reads_the_shards(dataset, tmp_path, monkeypatch):
    m = load_manifest(dataset)
    first = dataset / m.shards["train"][0].file
    schema = pq.read_schema(first)
    assert schema.field("tokens").type == pa.list_(pa.uint16(), WIDTH)
    assert schema.field("doc_starts").type == pa.list_(pa.int32())
    assert schema.field("seq_id").type == pa.int64()
    table = pq.read_table(first)
    df = pd.read_parquet(first)
    assert len(df) == table.num_rows == m.shards["train"][0].rows
    assert list(df["tokens"].iloc[3]) == table.column("tokens")[3].as_py()
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    hf = datasets.load_dataset("parquet", data_files=[str(dataset / s.file) for s in m.shards["train"]],
                               split="train")
    assert len(hf) == m.rows("train")
    assert hf[5]["tokens"] == table.column("tokens")[5].as_py() and hf[5]["seq_id"] == table.column("seq_id")[5].as_py()


def test_reader_batches_shapes_dtypes_and_doc_ids(dataset):
    m = load_manifest(dataset)
    reader = ShardReader(dataset, "train", batch_size=4, seed=3)
    assert reader.num_rows == m.rows("train") and len(reader) == m.rows("train") // 4
    rows = read_rows(dataset)
    by_id = dict(zip(rows["seq_id"].tolist(), range(len(rows["seq_id"]))))
    for batch in list(reader)[:10]:
        assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (4, WIDTH)
        assert batch["doc_ids"].dtype == torch.int32 and batch["doc_ids"].shape == (4, WIDTH)
        assert batch["seq_id"].dtype == torch.int64 and batch["seq_id"].shape == (4,)
        for tokens, doc_ids, sid in zip(batch["tokens"].numpy(), batch["doc_ids"].numpy(), batch["seq_id"].tolist()):
            assert np.array_equal(tokens, rows["tokens"][by_id[sid]])
            assert doc_ids[0] == 0 and np.all(np.diff(doc_ids) >= 0)
            new_doc = np.flatnonzero(np.diff(doc_ids)) + 1
            assert new_doc.tolist() == rows["doc_starts"][by_id[sid]]
            assert np.all(tokens[new_doc - 1] == m.eos_id)


def test_epoch_order_covers_every_row_once_and_depends_on_seed_and_epoch(dataset):
    n = load_manifest(dataset).rows("train")
    seen = torch.cat([b["seq_id"] for b in ShardReader(dataset, "train", batch_size=8, seed=1, epoch=0)])
    reader = ShardReader(dataset, "train", batch_size=8, seed=1, epoch=0)
    assert len(seen) == reader.sequences_per_epoch == n // 8 * 8 and len(set(seen.tolist())) == len(seen)
    again = torch.cat([b["seq_id"] for b in ShardReader(dataset, "train", batch_size=8, seed=1, epoch=0)])
    assert torch.equal(seen, again)
    other_epoch = torch.cat([b["seq_id"] for b in ShardReader(dataset, "train", batch_size=8, seed=1, epoch=1)])
    other_seed = torch.cat([b["seq_id"] for b in ShardReader(dataset, "train", batch_size=8, seed=2, epoch=0)])
    assert not torch.equal(seen, other_epoch) and not torch.equal(seen, other_seed)
    assert np.array_equal(epoch_order(n, 1, 0), epoch_order(n, 1, 0))


def test_cursor_restarts_at_any_sequence(dataset):
    full = ShardReader(dataset, "train", batch_size=4, seed=5)
    batches = []
    for b in full:
        batches.append(b["seq_id"])
        if len(batches) == 7:
            break
    assert full.position == 28 and len(full) == (full.num_rows - 28) // 4
    resumed = ShardReader(dataset, "train", batch_size=4, seed=5, start=full.position)
    rest_a = [b["seq_id"] for b in full]
    rest_b = [b["seq_id"] for b in resumed]
    assert len(rest_a) == len(rest_b) > 0 and all(torch.equal(x, y) for x, y in zip(rest_a, rest_b))
    odd = ShardReader(dataset, "train", batch_size=4, seed=5, start=3)  # not a batch boundary: still exact
    order = epoch_order(full.num_rows, 5, 0)
    assert next(iter(odd))["seq_id"].tolist() == full.read_rows(order[3:7])["seq_id"].tolist()
    assert odd.position == 7


def test_ranks_split_each_global_batch(dataset):
    whole = [b["seq_id"] for b in ShardReader(dataset, "train", batch_size=6, seed=9)]
    r0 = [b["seq_id"] for b in ShardReader(dataset, "train", batch_size=3, seed=9, rank=0, world_size=2)]
    r1 = [b["seq_id"] for b in ShardReader(dataset, "train", batch_size=3, seed=9, rank=1, world_size=2)]
    assert len(r0) == len(r1) == len(whole)  # the last incomplete global batch is dropped on every rank
    for w, a, b in zip(whole, r0, r1):
        assert torch.equal(w, torch.cat([a, b]))


@pytest.mark.parametrize("batch,world", [(4, 1), (5, 3), (64, 2)])
def test_eval_reader_reads_every_val_row_once_across_ranks(dataset, batch, world):
    """A split that does not fill its last global batch, or not even one (64 x 2 here), is read whole: every rank
    yields the same number of full-shape batches and flags the rows that only fill its share."""
    rows = load_manifest(dataset).rows("val")
    assert rows % (batch * world), rows  # a short last global batch in each case
    per_rank = [list(eval_reader(dataset, batch, rank, world)) for rank in range(world)]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == -(-rows // (batch * world))
    counted = []
    for p in per_rank:
        for b in p:
            assert b["tokens"].shape == (batch, WIDTH) and b["pad"].shape == (batch,) and b["pad"].dtype == torch.bool
            counted += b["seq_id"][~b["pad"]].tolist()
    every = read_rows(dataset)
    assert sorted(counted) == [i for i, sp in zip(every["seq_id"].tolist(), every["split"]) if sp == "val"]
    assert len(counted) == rows


def test_a_dataset_that_cannot_train_is_refused_in_one_line(dataset, copy_of):
    m = load_manifest(dataset)
    check_trainable(m, dataset, batch_size=4, world_size=2)
    with pytest.raises(DatasetError, match=r"^\d+ training rows, fewer than one global micro-batch "
                                           r"\(train.batch_size=4096 x 2 worker\(s\)\), in dataset '"):
        check_trainable(m, dataset, batch_size=4096, world_size=2)
    m.shards["val"] = []
    with pytest.raises(DatasetError, match=r"^no validation rows \(\d+ training rows, data.val_fraction=0.1\) in "
                                           "dataset .*: training needs some"):
        check_trainable(m, dataset, batch_size=4)
    manifest = json.loads((copy_of / "manifest.json").read_text())
    manifest["shards"]["val"] = []
    (copy_of / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="split 'val' of .* has 0 sequences"):  # its reader refuses too
        eval_reader(copy_of, 4)


@pytest.mark.parametrize("split,start,rank,world", [("train", 0, 0, 1), ("train", 5, 1, 2), ("val", 0, 0, 1)])
def test_ray_data_reader_yields_the_same_batches(dataset, split, start, rank, world):
    kw = dict(batch_size=3, seed=4, epoch=2, start=start, rank=rank, world_size=world)
    expected = list(ShardReader(dataset, split, **kw))
    ds = ray_batches(dataset, split, **kw)
    got = list(ds.iter_torch_batches(batch_size=3))
    assert len(got) == len(expected) > 0
    # one fused operator of at most READ_TASKS tasks at a time, not a range stage on worker processes of its own
    assert "Operator 1 ReadRange->MapBatches(_read_batches):" in ds.stats(), ds.stats()
    for e, g in zip(expected, got):
        assert set(g) == {"tokens", "doc_ids", "seq_id"}
        for k in e:
            assert g[k].dtype == e[k].dtype and torch.equal(g[k], e[k]), k


def test_manifest_errors_are_clear(dataset, copy_of, tmp_path):
    m = load_manifest(dataset)
    check_compatible(m, vocab_size=m.vocab_size, seq_len=SEQ_LEN, tokenizer_sha256=m.tokenizer_sha256)
    with pytest.raises(DatasetError, match="seq_len=64 but data.seq_len=128"):
        check_compatible(m, seq_len=128)
    with pytest.raises(DatasetError, match="vocab_size=400 but 500"):
        check_compatible(m, vocab_size=500)
    with pytest.raises(DatasetError, match="tokenized with another tokenizer"):
        check_compatible(m, tokenizer_sha256="0" * 64)
    with pytest.raises(DatasetError, match="manifest.json is missing"):
        load_manifest(tmp_path)
    (copy_of / "manifest.json").write_text('{"schema_version": 1, "seq_len": ')
    with pytest.raises(DatasetError, match="is corrupt"):
        load_manifest(copy_of)
    with pytest.raises(DatasetError, match="is corrupt"):
        ShardReader(copy_of)
    with pytest.raises(DatasetError, match="no split 'test'"):
        ShardReader(dataset, "test")


def test_validate_accepts_the_dataset_and_prints_the_report(dataset, capsys):
    report = validate_dataset(dataset)
    assert report.ok, report.errors
    m = load_manifest(dataset)
    assert report.stats["sequences"] == m.counts["sequences"] == m.rows("train") + m.rows("val")
    assert report.stats["vocab_used"] == m.counts["vocab_used"] > 100
    assert report.stats["round_trip"].startswith("ok on")
    assert validate_main(dataset) == 0
    out = capsys.readouterr().out
    for word in ("sequences", "tokens", "vocab used", "doc length", "packing", "train", "val", "OK"):
        assert word in out


def test_truncated_or_corrupted_shards_fail_with_the_file_named(copy_of, capsys):
    m = load_manifest(copy_of)
    truncated = copy_of / m.shards["train"][1].file
    truncated.write_bytes(truncated.read_bytes()[:-100])
    flipped = copy_of / m.shards["train"][0].file
    data = bytearray(flipped.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside a data page
    flipped.write_bytes(bytes(data))
    report = validate_dataset(copy_of)
    assert not report.ok
    text = " ".join(report.errors)
    assert f"{truncated.name}: sha256 does not match" in text and f"{flipped.name}: sha256 does not match" in text
    assert validate_main(copy_of) == 1 and "INVALID" in capsys.readouterr().out
    with pytest.raises(DatasetError, match=truncated.name):  # the training reader refuses it too
        ShardReader(copy_of, "train", batch_size=1).read_rows(np.array([m.shards["train"][0].rows]))


def test_page_checksums_catch_corruption_even_with_a_matching_manifest(copy_of):
    """Bytes flipped inside a page, and the manifest 'fixed' to the new sha256: the reader still refuses."""
    from pipeline.data.tokenizer import file_sha256

    m = load_manifest(copy_of)
    shard = copy_of / m.shards["train"][0].file
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x55
    shard.write_bytes(bytes(data))
    manifest = json.loads((copy_of / "manifest.json").read_text())
    manifest["shards"]["train"][0]["sha256"] = file_sha256(shard)
    (copy_of / "manifest.json").write_text(json.dumps(manifest))
    report = validate_dataset(copy_of)
    assert not report.ok and shard.name in report.errors[0]
    reader = ShardReader(copy_of, "train", batch_size=1)
    with pytest.raises(DatasetError, match=shard.name):
        reader.read_rows(np.arange(m.shards["train"][0].rows))


def test_tokenizer_hash_mismatch_is_reported(copy_of, tmp_path):
    other = train_tokenizer(sample_docs(30, 1000), 400, tmp_path / "other.model")
    shutil.copyfile(other, copy_of / load_manifest(copy_of).tokenizer_file)
    report = validate_dataset(copy_of)
    assert not report.ok
    assert any("tokenizer.model sha256" in e and "another tokenizer" in e for e in report.errors)


def test_tampered_counts_and_rows_are_reported(copy_of):
    manifest = json.loads((copy_of / "manifest.json").read_text())
    manifest["counts"]["vocab_used"] += 1
    manifest["shards"]["val"][0]["rows"] += 1
    (copy_of / "manifest.json").write_text(json.dumps(manifest))
    errors = validate_dataset(copy_of).errors
    assert any("rows but the manifest says" in e for e in errors)
    del manifest["counts"]["vocab_used"]
    manifest["shards"]["val"][0]["rows"] -= 1
    manifest["counts"]["eos_in_shards"] += 1
    (copy_of / "manifest.json").write_text(json.dumps(manifest))
    assert validate_dataset(copy_of).errors == [
        f"manifest counts.eos_in_shards={manifest['counts']['eos_in_shards']} but the shards hold "
        f"{manifest['counts']['eos_in_shards'] - 1}"]
