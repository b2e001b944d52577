"""Corpus sources (built-in, .txt/.jsonl/.json/.parquet files, Hugging Face via `datasets`) and cleaning.

Every bad input gets a clear error naming the file (and line), or a counted skip.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.data.builtin_corpus import builtin_document, builtin_items
from pipeline.data.cleaning import CleanStats, clean_batch, clean_texts
from pipeline.data.corpus import (DataSourceError, check_bad_records, describe_source, read_document_file,
                                  read_documents, resolve_files)
from tests.pipeline.data.helpers import sample_docs, write_jsonl


def cfg_for(**data):
    return load_config("test", {f"data.{k}": v for k, v in {"max_documents": 0, **data}.items()}).data


def texts_of(ds) -> list:
    """Documents of a source dataset as the pipeline sees them after cleaning, in order."""
    out = []
    for batch in ds.iter_batches(batch_size=64, batch_format="pyarrow"):
        out += clean_texts(batch["text"])[0]
    return out


# ------------------------------------------------------------------ cleaning (no Ray)

def test_clean_counts_every_fix_and_drop():
    values = [b"ok \xff\xfe bytes", "nul\x00in\x00side", "", "   \n\t ", None, "lone \ud800 surrogate",
              b"real \xef\xbf\xbd stays", "fine"]
    texts, st = clean_texts(values)
    assert texts == ["ok \ufffd\ufffd bytes", "nulinside", "lone \ufffd surrogate", "real \ufffd stays", "fine"]
    assert st.documents == 5 and st.dropped_empty == 3  # "", whitespace-only, null
    assert st.replaced_invalid_utf8 == 3  # two invalid bytes + one surrogate; the genuine U+FFFD is not counted
    assert st.nul_removed == 2
    assert all(t.encode("utf-8") for t in texts)


def test_clean_handles_arrow_strings_with_invalid_utf8():
    # Arrow does not validate string buffers it is handed; the cleaner must not trust them.
    bad = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(b"\x00\x00\x00\x00\x03\x00\x00\x00"),
                                                 pa.py_buffer(b"a\xffb")])
    texts, st = clean_texts(bad)
    assert texts == ["a\ufffdb"] and st.replaced_invalid_utf8 == 1


def test_clean_counts_non_text_values_as_bad_records():
    texts, st = clean_texts([12, "x", None], source="myset")
    assert texts == ["x"] and st.bad_records == 1 and st.dropped_empty == 1 and st.records == 3
    assert st.bad_files["myset"][0] == 1 and "is a int, not text" in st.bad_files["myset"][1]


def test_bad_record_policy():
    st = CleanStats(documents=997)
    st.count_bad("a.jsonl", "a.jsonl line 2: not valid JSON")
    st.count_bad("a.jsonl", "a.jsonl line 9: not valid JSON")
    st.count_bad("b.jsonl", "b.jsonl line 1: field 'text' is int, not a string")
    assert st.bad_files == {"a.jsonl": [2, "a.jsonl line 2: not valid JSON"],
                            "b.jsonl": [1, "b.jsonl line 1: field 'text' is int, not a string"]}
    check_bad_records(st, "skip", 0.003)  # 3 of 1000: not more than 0.3%
    with pytest.raises(DataSourceError, match=r"3 of 1,000 records \(0.300%\) are unreadable, more than "
                                              r"data.max_bad_fraction=0.002; the first: a.jsonl line 2"):
        check_bad_records(st, "skip", 0.002)
    with pytest.raises(DataSourceError, match=r"^a.jsonl line 2: not valid JSON \(data.on_bad_record=error"):
        check_bad_records(st, "error", 1.0)
    check_bad_records(CleanStats(documents=5), "error", 0.0)  # nothing bad: nothing to decide
    merged = CleanStats()
    merged.add(st)
    merged.add(st)
    assert merged.bad_records == 6 and merged.bad_files["a.jsonl"][0] == 4


def test_json_file_that_does_not_parse_is_one_bad_record(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('[{"text": "a"}, {"text": ')
    with open(p, "rb") as f:
        table = pa.concat_tables(read_document_file(f, str(p), "json", "text"))
    assert table.num_rows == 1 and "broken.json: not valid JSON" in table["bad_reason"][0].as_py()


# ------------------------------------------------------------------ files: resolution and parsing (no Ray)

def test_resolve_files_dir_glob_file_and_errors(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.txt", "a.jsonl", "sub/c.parquet", "skip.csv", ".hidden.txt"):
        (tmp_path / name).write_text("x")
    names = [Path(p).relative_to(tmp_path).as_posix() for p in resolve_files(str(tmp_path))]
    assert names == ["a.jsonl", "b.txt", "sub/c.parquet"]  # sorted, recursive, unsupported/hidden skipped
    assert [Path(p).name for p in resolve_files(str(tmp_path / "*.txt"))] == ["b.txt"]  # glob skips dot files too
    with pytest.raises(DataSourceError, match="does not exist"):
        resolve_files(str(tmp_path / "nope"))
    with pytest.raises(DataSourceError, match=re.escape(f"data.path={str(tmp_path / '*.md')!r} matches no .txt, "
                                                        ".jsonl, .json or .parquet files, nor .txt, .jsonl or .json "
                                                        "files compressed as .gz, .bz2, .zst or .zstd")):
        resolve_files(str(tmp_path / "*.md"))
    with pytest.raises(DataSourceError, match="unsupported type"):
        resolve_files(str(tmp_path / "skip.csv"))
    os.symlink(tmp_path / "gone.txt", tmp_path / "broken.txt")  # unreadable: a dangling link
    with pytest.raises(DataSourceError, match="cannot read .*broken.txt"):
        resolve_files(str(tmp_path))


def test_jsonl_parsing_replaces_invalid_utf8_and_names_bad_lines(tmp_path):
    good = tmp_path / "g.jsonl"
    good.write_bytes(b'{"text": "caf\xe9 au lait"}\n\n{"text": null}\n{"text": "two \\ud800"}\n')
    with open(good, "rb") as f:
        table = pa.concat_tables(read_document_file(f, str(good), "jsonl", "text"))
    assert table["text"].to_pylist() == ["caf\ufffd au lait", None, "two \ufffd"]
    assert table["replaced"].to_pylist() == [1, 0, 1]
    cases = {b'{"text": "a"}\n{"body": "b"}\n': r"line 2: no 'text' field \(fields: body\)",
             b'{"text": 5}\n': "line 1: field 'text' is int, not a string",
             b'{"text": "a"}\n{broken\n': "line 2: not valid JSON",
             b'["a list"]\n': "line 1: expected a JSON object"}
    for i, (data, message) in enumerate(cases.items()):
        # A bad record is a row naming the file and line (never an exception inside a Ray task): the driver
        # decides by data.on_bad_record.
        p = tmp_path / f"bad{i}.jsonl"
        p.write_bytes(data)
        with open(p, "rb") as f:
            table = pa.concat_tables(read_document_file(f, str(p), "jsonl", "text"))
        reasons = [r for r in table["bad_reason"].to_pylist() if r is not None]
        assert len(reasons) == 1 and re.search(message, reasons[0]) and reasons[0].startswith(str(p))
        assert table["bad_file"].to_pylist() == [str(p) if r else None for r in table["bad_reason"].to_pylist()]
        texts, stats = clean_batch(table)
        assert stats.bad_records == 1 and stats.bad_files == {str(p): [1, reasons[0]]}
        assert len(texts) == table.num_rows - 1 and stats.dropped_empty == 0  # a bad record is not "empty"


def test_describe_source_changes_with_the_files(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", ["one"])
    before = describe_source(cfg_for(source="files", path=str(tmp_path)))
    write_jsonl(p, ["one", "two"])
    after = describe_source(cfg_for(source="files", path=str(tmp_path)))
    assert before["listing_sha256"] != after["listing_sha256"]


# ------------------------------------------------------------------ Ray Data sources

def test_builtin_corpus_is_python_text_without_download(ray_session):
    items = builtin_items()
    assert len(items) > 500 and items[0]["kind"] == "topic"
    module = next(i for i in items if i["key"].endswith("/json/__init__.py"))
    doc = builtin_document(module)
    assert doc.startswith("Module json\n\nJSON (JavaScript Object Notation)") and "def json.dumps(obj" in doc
    ds = read_documents(cfg_for(source="builtin", max_documents=90))
    docs = texts_of(ds)
    assert len(docs) == 90 and docs[0] == builtin_document(items[0])
    assert sum(map(len, docs)) > 300_000  # topics are long: a real corpus, not a stub


def test_files_of_every_type_in_order(ray_session, tmp_path):
    docs = sample_docs(12, 400)
    (tmp_path / "a.txt").write_bytes(docs[0].encode() + b"\n\xff invalid byte")  # a .txt file is one document
    write_jsonl(tmp_path / "b.jsonl", docs[1:4], column="body")
    (tmp_path / "c.json").write_text(json.dumps([{"body": d} for d in docs[4:6]]))
    pq.write_table(pa.table({"body": docs[6:9], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    pq.write_table(pa.table({"body": pa.array([d.encode() for d in docs[9:12]], pa.binary())}),
                   tmp_path / "e.parquet")
    got = texts_of(read_documents(cfg_for(source="files", path=str(tmp_path), text_column="body")))
    assert got == [docs[0] + "\n\ufffd invalid byte"] + docs[1:12]
    only_json = texts_of(read_documents(cfg_for(source="files", path=str(tmp_path / "*.js*"), text_column="body",
                                                max_documents=4)))
    assert only_json == docs[1:5]


def test_parquet_column_errors_name_file_and_column(ray_session, tmp_path):
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "body.parquet")
    with pytest.raises(DataSourceError, match=r"body.parquet' has no column 'text' \(columns: body\)"):
        read_documents(cfg_for(source="files", path=str(tmp_path / "body.parquet")))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DataSourceError, match=r"column 'text' of .*ints.parquet' is int64, not text"):
        read_documents(cfg_for(source="files", path=str(tmp_path / "ints.parquet")))
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataSourceError, match="corrupt.parquet' is not a readable Parquet file"):
        read_documents(cfg_for(source="files", path=str(tmp_path / "corrupt.parquet")))


@pytest.mark.system
def test_hugging_face_loaders_on_local_files(ray_session, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    docs = sample_docs(10, 300)
    write_jsonl(tmp_path / "train-0.jsonl", docs[:6], column="story")
    write_jsonl(tmp_path / "train-1.jsonl", docs[6:], column="story")  # two files: two shards when streaming
    pq.write_table(pa.table({"text": docs}), tmp_path / "train.parquet")
    for streaming in (False, True):
        d = cfg_for(source="hf", hf_name="json", path=str(tmp_path / "train-*.jsonl"), text_column="story",
                    hf_streaming=streaming)
        assert texts_of(read_documents(d)) == docs, f"streaming={streaming}"
    d = cfg_for(source="hf", hf_name="parquet", path=str(tmp_path / "train.parquet"), max_documents=4)
    assert texts_of(read_documents(d)) == docs[:4]
    with pytest.raises(DataSourceError, match="has no column 'text' .*story"):
        read_documents(cfg_for(source="hf", hf_name="json", path=str(tmp_path / "train-0.jsonl")))
    with pytest.raises(DataSourceError, match="cannot load Hugging Face dataset 'no-such-org/no-such-data'"):
        read_documents(cfg_for(source="hf", hf_name="no-such-org/no-such-data"))


def test_blocks_at_least_bounds_what_the_readers_yield(tmp_path):
    """The lower bound on read blocks that sizes the tokenizer actor pool (pipeline/data/pack.py)."""
    from pipeline.data.corpus import blocks_at_least

    write_jsonl(tmp_path / "small.jsonl", sample_docs(10, 300))
    write_jsonl(tmp_path / "big.jsonl", ["x" * 100_000] * 25)  # 2.5 MB: two blocks of >= 1 MB, then the rest
    (tmp_path / "one.txt").write_text("a document")
    pq.write_table(pa.table({"text": ["t"] * 3000}), tmp_path / "rows.parquet")  # batches of 1,024 rows
    for name, n in (("small.jsonl", 1), ("big.jsonl", 2), ("one.txt", 1), ("rows.parquet", 3), ("*", 7)):
        assert blocks_at_least(cfg_for(source="files", path=str(tmp_path / name))) == n, name
    small = cfg_for(source="files", path=str(tmp_path / "small.jsonl"), max_documents=3)
    assert blocks_at_least(small) == 1  # a one-block corpus stays one block, however many documents it keeps
    assert blocks_at_least(cfg_for(source="files", path=str(tmp_path / "big.jsonl"), max_documents=3)) == 1
    assert blocks_at_least(cfg_for(source="files", path=str(tmp_path / "big.jsonl"), max_documents=15)) == 2  # ~10 a block
    assert blocks_at_least(cfg_for(source="hf", hf_name="some/data")) is None
    items = len(builtin_items())
    assert blocks_at_least(cfg_for(source="builtin")) == 32
    per_block = -(-items // 32)
    assert blocks_at_least(cfg_for(source="builtin", max_documents=100)) == -(-100 // per_block)


# ------------------------------------------------------------------ compressed files

def _compressed_corpus(root: Path, docs: list[str]) -> Path:
    """corpus/: part-0.jsonl (30 documents), part-1.jsonl.gz (40), part-2.txt.zst, part-3.json.bz2, part-4.jsonl.zstd
    (one each), and two files not read (notes.md, old.jsonl.xz)."""
    import bz2
    import gzip

    corpus = root / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "part-0.jsonl", docs[:30])
    (corpus / "part-1.jsonl.gz").write_bytes(gzip.compress(write_jsonl(root / "tmp.jsonl", docs[30:70]).read_bytes()))
    zstd = pa.Codec("zstd")
    (corpus / "part-2.txt.zst").write_bytes(zstd.compress(docs[70].encode(), asbytes=True))
    (corpus / "part-3.json.bz2").write_bytes(bz2.compress(json.dumps([{"text": docs[71]}]).encode()))
    (corpus / "part-4.jsonl.zstd").write_bytes(zstd.compress(json.dumps({"text": docs[72]}).encode(), asbytes=True))
    (corpus / "notes.md").write_text("not a corpus file")
    (corpus / "old.jsonl.xz").write_bytes(b"\xfd7zXZ")
    return corpus


def test_compressed_files_are_listed_checked_and_in_the_cache_key(tmp_path):
    """Ray-free: the listing reads them (and names the files it does not read), the cache key changes when one
    changes, and the check before any Ray work reads through the compression."""
    import gzip

    from pipeline.data.corpus import file_kind, skipped_files
    from pipeline.data.no_usable_text import check_first_records

    corpus = _compressed_corpus(tmp_path, sample_docs(73, 300))
    assert [Path(p).name for p in resolve_files(str(corpus))] == [
        "part-0.jsonl", "part-1.jsonl.gz", "part-2.txt.zst", "part-3.json.bz2", "part-4.jsonl.zstd"]
    assert [Path(p).name for p in skipped_files(str(corpus))] == ["notes.md", "old.jsonl.xz"]
    assert file_kind("a.parquet.gz") is None and file_kind("a.gz") is None and file_kind("A.JSONL.GZ") == "jsonl"
    before = describe_source(cfg_for(source="files", path=str(corpus)))
    (corpus / "part-1.jsonl.gz").write_bytes(gzip.compress(b'{"text": "another document"}\n'))
    assert describe_source(cfg_for(source="files", path=str(corpus)))["listing_sha256"] != before["listing_sha256"]
    with pytest.raises(DataSourceError, match=r"unsupported type; data.source=files reads .txt, .jsonl, .json and "
                                              r".parquet; .txt, .jsonl and .json also compressed as .gz, .bz2 or .zst"):
        resolve_files(str(corpus / "old.jsonl.xz"))
    gz_only = tmp_path / "gz"
    gz_only.mkdir()
    (gz_only / "a.jsonl.gz").write_bytes(gzip.compress(b'{"body": "x"}\n{"body": "y"}\n'))
    with pytest.raises(DataSourceError, match=r"none of the first 2 records of .*a.jsonl.gz is usable .*no 'text' "
                                              r"field \(fields: body\)"):
        check_first_records(cfg_for(source="files", path=str(gz_only)))


def test_prepare_reads_compressed_files_and_names_those_it_skips(ray_session, tmp_path, capsys):
    """`prepare` of a folder of part-0.jsonl (30 documents) and part-1.jsonl.gz (40), with .zst, .bz2 and .zstd
    files beside them: every document of every file, in path order, and the summary names the two files not read."""
    from pipeline.data.shards import load_manifest
    from pipeline.run import main

    docs = sample_docs(73, 300)
    corpus = _compressed_corpus(tmp_path, docs)
    assert texts_of(read_documents(cfg_for(source="files", path=str(corpus)))) == docs
    rc = main(["prepare", "--preset", "test", f"--run.root={tmp_path / 'runs'}", "--data.source=files",
               f"--data.path={corpus}", "--data.max_documents=0", "--data.tokenize_actors=2"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    dataset = next(line.split()[1] for line in out.splitlines() if line.startswith("dataset "))
    assert load_manifest(dataset).counts["documents"] == 73
    assert (f"  skipped 2 file(s) of data.path={str(corpus)!r} of a type it does not read: notes.md, old.jsonl.xz "
            "(it reads .txt, .jsonl, .json and .parquet; .txt, .jsonl and .json also compressed as .gz, .bz2 or "
            ".zst)") in out


def test_compressed_objects_in_a_bucket_are_listed_read_and_checked(s3_bucket, tmp_path):
    """The same in object storage (Ray-free): a prefix's .jsonl.gz is read through its compression, its other files
    are named."""
    import gzip

    from pipeline import storage
    from pipeline.data.corpus import open_stream, skipped_files
    from pipeline.data.no_usable_text import check_first_records

    prefix = f"{s3_bucket}/gzcorpus"
    packed = gzip.compress(b'{"body": "x"}\n{"body": "y"}\n')
    storage.write_bytes(f"{prefix}/a.jsonl.gz", packed)
    assert storage.read_bytes(f"{prefix}/a.jsonl.gz") == packed  # bytes stored and read as given, not (un)gzipped
    storage.write_bytes(tmp_path / "a.jsonl.gz", packed)
    assert (tmp_path / "a.jsonl.gz").read_bytes() == storage.read_bytes(tmp_path / "a.jsonl.gz") == packed
    storage.write_bytes(f"{prefix}/b.txt", b"plain")
    storage.write_bytes(f"{prefix}/README", b"not read")
    assert resolve_files(prefix) == [f"{prefix}/a.jsonl.gz", f"{prefix}/b.txt"]
    assert skipped_files(prefix) == [f"{prefix}/README"]
    with open_stream(f"{prefix}/a.jsonl.gz") as f:
        assert f.read() == b'{"body": "x"}\n{"body": "y"}\n'
    check_first_records(cfg_for(source="files", path=prefix, text_column="body"))
    with pytest.raises(DataSourceError, match=r"none of the first 2 records of .*a.jsonl.gz is usable"):
        check_first_records(cfg_for(source="files", path=prefix))
