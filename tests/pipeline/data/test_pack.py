"""Pretokenize + pack with Ray Data: packing invariants, counted skips, determinism, caching, kill-midway."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.data.corpus import DataSourceError
from pipeline.data.pack import prepare
from pipeline.data.shard_plan import (PARTS_DIR, SegmentIndex, ShardPlanner, SplitRule, TokenStream,
                                         plan_shards)
from pipeline.data.validate_dataset import validate_dataset
from pipeline.data.shards import MANIFEST_FILE, DatasetError, load_manifest
from pipeline.data.tokenizer import Tokenizer
from tests.pipeline.data.helpers import (SEQ_LEN, data_cfg, expected_stream, long_doc, read_rows,
                                         sample_docs, write_jsonl)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def messy_corpus(tmp_path_factory):
    """Three files with every kind of bad input; returns (dir, documents in source order as raw values)."""
    root = tmp_path_factory.mktemp("messy")
    docs = sample_docs(40, 2500)
    raw: list = []
    a = docs[:15] + ["", "   \n\t  ", None, "with\x00two\x00NULs", long_doc()] + docs[15:20]
    write_jsonl(root / "a.jsonl", a)
    raw += a
    (root / "b.txt").write_bytes(b"bytes that are not UTF-8: \xff\xfe and \xc3( end\n" + docs[20].encode())
    raw.append(b"bytes that are not UTF-8: \xff\xfe and \xc3( end\n" + docs[20].encode())
    write_jsonl(root / "c.jsonl", docs[21:])
    raw += docs[21:]
    return root, raw


@pytest.fixture(scope="module")
def messy_dataset(ray_session, tok_path, messy_corpus, tmp_path_factory):
    root, raw = messy_corpus
    cfg = data_cfg(tmp_path_factory.mktemp("run"), tok_path, data__source="files", data__path=str(root))
    return prepare(cfg), raw, cfg


def test_windows_reproduce_the_token_stream_in_order(messy_dataset, tok_path):
    out, raw, cfg = messy_dataset
    rows = read_rows(out)
    tok = Tokenizer(tok_path)
    stream = expected_stream(tok, raw)
    n = len(rows["seq_id"])
    assert np.array_equal(rows["seq_id"], np.arange(n))  # unique and dense over train + val
    width = SEQ_LEN + 1
    assert n == len(stream) // width  # only the final partial window is dropped
    assert np.array_equal(rows["tokens"].reshape(-1), stream[:n * width])
    m = rows["manifest"]
    assert m.counts["tokens_total"] == len(stream) and m.counts["tokens_kept"] == n * width
    assert m.counts["tokens_dropped_remainder"] == len(stream) - n * width < width
    assert m.packing_efficiency == pytest.approx(n * width / len(stream))


def test_order_holds_across_many_batches_parts_and_actors(ray_session, tok_path, tmp_path, monkeypatch):
    """Small batches (planned in the driver, so patchable here) and small shards: two actors finish batches out
    of order and shards are written while tokenization goes on, yet the rows are the corpus stream in order."""
    import pipeline.data.pack as pack

    monkeypatch.setattr(pack, "DOCS_PER_BATCH", 7)
    docs = sample_docs(80, 600)
    for k in range(6):
        write_jsonl(tmp_path / f"part{k}.jsonl", docs[k * 13:(k + 1) * 13] + docs[:k])
    raw = [d for k in range(6) for d in docs[k * 13:(k + 1) * 13] + docs[:k]]
    out = prepare(data_cfg(tmp_path, tok_path, data__source="files", data__path=str(tmp_path),
                           data__rows_per_shard=8))
    m = load_manifest(out)
    assert m.extra["parts"] >= 5 and len(m.shards["train"]) >= 5  # batches, and shards handed out midway
    stream = expected_stream(Tokenizer(tok_path), raw)
    rows = read_rows(out)
    assert np.array_equal(rows["tokens"].reshape(-1), stream[:rows["tokens"].size])


def test_every_boundary_sits_at_an_eos(messy_dataset):
    out, _, _ = messy_dataset
    rows = read_rows(out)
    eos = rows["manifest"].eos_id
    for tokens, starts in zip(rows["tokens"], rows["doc_starts"]):
        assert all(0 < s <= SEQ_LEN and tokens[s - 1] == eos for s in starts)
        assert list(starts) == [int(i) + 1 for i in np.flatnonzero(tokens[:-1] == eos)]  # and every EOS starts one


def test_bad_inputs_are_counted_not_silently_dropped(messy_dataset):
    out, raw, _ = messy_dataset
    c = load_manifest(out).counts
    assert c["dropped_empty"] == 3  # "", whitespace-only, JSON null
    assert c["nul_removed"] == 2
    assert c["replaced_invalid_utf8"] == 3  # \xff, \xfe, and the truncated \xc3
    assert c["documents"] == len(raw) - 3
    # the long document spans more than 50 windows and survives whole, in order (checked by the stream test)
    assert c["tokens_total"] > 51 * (SEQ_LEN + 1) and load_manifest(out).doc_length["max"] > 50 * (SEQ_LEN + 1)


def test_split_is_deterministic_and_shards_are_sized(messy_dataset):
    out, _, cfg = messy_dataset
    m = load_manifest(out)
    rows = read_rows(out)
    rule = SplitRule(**m.extra["split_rule"])
    is_val = rule.is_val(rows["seq_id"])
    assert [s == "val" for s in rows["split"]] == is_val.tolist()
    assert 0 < m.rows("val") < 0.15 * len(is_val)  # val_fraction 0.05 of a few hundred rows
    for split, shards in m.shards.items():
        assert all(s.rows == cfg.data.rows_per_shard for s in shards[:-1]) and 0 < shards[-1].rows
        build = shards[0].file.split("/")[0]  # every file of the dataset in one build directory
        assert build.startswith("build-") and m.tokenizer_file == f"{build}/tokenizer.model"
        assert [s.file for s in shards] == [f"{build}/{split}-{k:05d}.parquet" for k in range(len(shards))]
    assert validate_dataset(out).ok


def test_plan_shards_tiny_cases():
    specs, counts = plan_shards(SplitRule(10, 0.0, 0), rows_per_shard=4)
    assert counts == {"train": 10, "val": 0}
    assert [(s["first"], s["stop"], s["rows"]) for s in specs] == [(0, 4, 4), (4, 8, 4), (8, 10, 2)]
    rule = SplitRule(1000, 0.1, 3)
    specs, counts = plan_shards(rule, rows_per_shard=32, chunk=100)  # chunking does not change the plan
    assert (specs, counts) == plan_shards(rule, rows_per_shard=32)
    assert counts["val"] == int(rule.is_val(np.arange(1000)).sum()) and 60 < counts["val"] < 140


@pytest.mark.parametrize("val_fraction", [0.0, 0.002, 0.02, 0.3])
@pytest.mark.parametrize("rows_per_shard", [1, 3, 16])
def test_shards_handed_out_as_the_stream_grows_hold_what_the_whole_plan_holds(val_fraction, rows_per_shard):
    """ShardPlanner (shards final mid-stream, in any increments) == the plan of the complete stream, row for
    row, including the case where no window hashes to val and the last one is moved there."""
    rng = np.random.default_rng(int(val_fraction * 1000) + rows_per_shard)

    def rows_of(specs, rule):
        out = {}
        for sp in specs:
            ids = np.arange(sp["first"], sp["stop"])
            v = rule.is_val(ids)
            out[sp["file"]] = (ids[v] if sp["split"] == "val" else ids[~v])[:sp["rows"]].tolist()
        return out

    for n in (1, 2, 3, 50, 701):
        forced = val_fraction > 0 and plan_shards(SplitRule(n, val_fraction, 5), rows_per_shard)[1]["val"] == 0 \
            and n >= 2
        rule = SplitRule(n, val_fraction, 5, forced)
        whole, counts = plan_shards(rule, rows_per_shard)
        planner, got, known = ShardPlanner(val_fraction, 5, rows_per_shard), [], 0
        while known < n:
            known = min(n, known + int(rng.integers(0, 40)))
            got += planner.advance(known)
            assert all(sp["stop"] <= known for sp in got)  # only what the stream already holds
        got += planner.finish(n, forced)
        assert rows_of(got, rule) == rows_of(whole, rule) and planner.counts == counts
        assert sorted(sum(rows_of(got, rule).values(), [])) == list(range(n))  # every window once


def test_segments_from_interleaved_part_files_read_as_one_stream(tmp_path):
    """Two actors append their batches to their own files; the driver's index, in source order, reads back
    the one stream over any range, and forgets batches no pending shard needs (flat driver memory)."""
    rng = np.random.default_rng(0)
    parts = tmp_path / PARTS_DIR
    parts.mkdir()
    batches = [rng.integers(0, 500, int(rng.integers(0, 40)), dtype=np.uint16) for _ in range(12)]
    index, offsets = SegmentIndex(), {"a.bin": 0, "b.bin": 0}
    for i, b in enumerate(batches):
        file = "a.bin" if i % 3 else "b.bin"
        with open(parts / file, "ab") as f:
            f.write(b.tobytes())
        index.append(file, offsets[file], len(b))
        offsets[file] += len(b)
    stream = np.concatenate(batches)
    for start, stop in [(0, len(stream)), (5, 6), (17, 140), (len(stream) - 3, len(stream))]:
        segs, base = index.covering(start, stop)
        assert np.array_equal(TokenStream(parts, segs, base, np.uint16).read(start, stop), stream[start:stop])
    index.drop_before(100)
    assert index.items[0][0] <= 100 < index.items[0][0] + index.items[0][3] and index.count == 12
    segs, base = index.covering(100, len(stream))
    assert np.array_equal(TokenStream(parts, segs, base, np.uint16).read(100, len(stream)), stream[100:])


def test_a_shard_writer_whose_build_was_removed_ends_quietly_and_a_missing_part_is_still_an_error(tmp_path):
    """A failed or interrupted prepare removes its build while a shard writer may still run: the writer then ends
    without an error (Ray would print an unfetched one after the command's last line). The same writer with its
    parts directory present but a part file missing fails, and a removed build seen by a build that goes on is one
    clear line."""
    from pipeline.data.shard_plan import ABANDONED, _written, write_planned_shard

    seq_len, vocab = 8, 500
    parts = tmp_path / "build" / PARTS_DIR
    parts.mkdir(parents=True)
    tokens = np.arange(4 * (seq_len + 1), dtype=np.uint16) % vocab
    (parts / "a.bin").write_bytes(tokens.tobytes())
    spec = {"split": "train", "index": 0, "first": 0, "stop": 4, "rows": 4, "file": "train-00000.parquet"}
    rule = {"n_windows": 4, "val_fraction": 0.0, "seed": 1, "force_last_val": False}
    kw = dict(out_dir=str(tmp_path / "build"), base=0, rule=rule, seq_len=seq_len, vocab_size=vocab, eos_id=2)
    done = write_planned_shard(spec, segments=[("a.bin", 0, len(tokens))], **kw)
    assert done["rows"] == 4 and (tmp_path / "build" / "train-00000.parquet").exists()

    with pytest.raises(FileNotFoundError):  # parts present, a file of them missing: a real error, not hidden
        write_planned_shard(spec, segments=[("gone.bin", 0, len(tokens))], **kw)
    for f in parts.iterdir():
        f.unlink()
    parts.rmdir()
    gone = write_planned_shard(spec, segments=[("a.bin", 0, len(tokens))], **kw)
    assert gone == {"split": "train", "index": 0, ABANDONED: True}
    with pytest.raises(DatasetError, match=r"^the train shard 0's parts were removed while it was being written"):
        _written([done, gone])


def test_same_settings_same_bytes_whatever_the_parallelism(ray_session, tok_path, messy_corpus, messy_dataset,
                                                           tmp_path):
    root, _ = messy_corpus
    out, _, _ = messy_dataset
    cfg = data_cfg(tmp_path, tok_path, data__source="files", data__path=str(root), data__tokenize_actors=1,
                   data__dataset_dir=str(tmp_path / "one_actor"))
    again = prepare(cfg)
    a, b = load_manifest(out), load_manifest(again)
    assert (a.extra["tokenize_actors"], b.extra["tokenize_actors"]) == (2, 1)  # three files: blocks for both
    assert a.settings_hash == b.settings_hash  # the actor count is not part of the key...
    same = {split: [(s.file.split("/", 1)[1], s.rows, s.sha256) for s in lst] for split, lst in a.shards.items()}
    assert same == {split: [(s.file.split("/", 1)[1], s.rows, s.sha256) for s in lst]  # ...because it cannot
                    for split, lst in b.shards.items()}  # change a byte (each build has a directory of its own)


@pytest.mark.system
def test_cache_reuses_and_changed_settings_rebuild(ray_session, tok_path, tmp_path, monkeypatch):
    import pipeline.data.pack as pack

    corpus = write_jsonl(tmp_path / "c.jsonl", sample_docs(20, 1500))
    cfg = data_cfg(tmp_path, tok_path, data__source="files", data__path=str(corpus))
    out = prepare(cfg)
    stamp = (out / MANIFEST_FILE).stat().st_mtime_ns
    builds = []
    with monkeypatch.context() as m:  # the same settings again: reused, with no build (no Ray work) at all
        m.setattr(pack, "_build", lambda *a, **k: builds.append(a) or pytest.fail("the same settings were rebuilt"))
        assert prepare(cfg) == out
    assert builds == [] and (out / MANIFEST_FILE).stat().st_mtime_ns == stamp  # reused
    other = prepare(cfg.replace({"data.seq_len": 32}))
    assert other != out and load_manifest(other).seq_len == 32
    # an explicit dataset_dir is rebuilt in place when the settings change
    fixed = cfg.replace({"data.dataset_dir": str(tmp_path / "fixed")})
    first = load_manifest(prepare(fixed)).settings_hash
    second = load_manifest(prepare(fixed.replace({"data.split_seed": 7}))).settings_hash
    assert first != second and validate_dataset(tmp_path / "fixed").ok
    # touching the corpus changes the key
    write_jsonl(corpus, sample_docs(21, 1500))
    assert prepare(cfg) != out


def test_builtin_corpus_trains_its_tokenizer(test_runs_root):
    """The session's `test`-preset dataset (tests/conftest.py) is the built-in corpus with no tokenizer given:
    prepare trained one on it. Preparing the same settings again finds it in the cache."""
    cfg = load_config("test", [f"--run.root={test_runs_root}"])
    assert cfg.data.source == "builtin" and cfg.data.tokenizer == ""
    out = prepare(cfg)
    m = load_manifest(out)
    tok = Tokenizer(out / m.tokenizer_file)
    assert m.vocab_size == tok.vocab_size == cfg.data.vocab_size and m.tokenizer_sha256 == tok.sha256
    assert (m.pad_id, m.unk_id, m.bos_id, m.eos_id) == (0, 1, 2, 3)
    assert m.counts["documents"] == cfg.data.max_documents and m.source["kind"] == "builtin"
    report = validate_dataset(out)
    assert report.ok, report.errors
    assert report.stats["round_trip"].startswith("ok on")


@pytest.mark.system
def test_user_errors_inside_ray_come_out_clear(ray_session, tok_path, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    cfg = data_cfg(tmp_path, tok_path, data__source="files", data__path=str(tmp_path / "bad.jsonl"))
    with pytest.raises(DataSourceError, match=r"bad.jsonl line 2: no 'text' field \(fields: body\)") as info:
        prepare(cfg)
    assert "Traceback" not in str(info.value) and "ray" not in type(info.value).__module__
    write_jsonl(tmp_path / "short.jsonl", ["just a few words"])
    with pytest.raises(DataSourceError, match=r"less than one row of seq_len\+1=65; lower data.seq_len"):
        prepare(data_cfg(tmp_path, tok_path, data__source="files", data__path=str(tmp_path / "short.jsonl")))
    write_jsonl(tmp_path / "empty.jsonl", ["", "  ", None])
    with pytest.raises(DataSourceError, match=r"no text in data.path='\S*empty.jsonl': 3 records read, none with "
                                              r"text: 3 empty or whitespace-only; check data.path and data.text_column"):
        prepare(data_cfg(tmp_path, tok_path, data__source="files", data__path=str(tmp_path / "empty.jsonl")))
    manifests = list(Path(cfg.run.root).glob("datasets/*/manifest.json"))
    assert manifests == []  # failed builds leave no dataset


@pytest.mark.parametrize("stage", ["parts", "shards"])
@pytest.mark.system
def test_sigkill_midway_leaves_no_manifest_and_the_rerun_validates(ray_session, tok_path, messy_corpus, tmp_path,
                                                                   stage):
    root, _ = messy_corpus
    out = tmp_path / "ds"
    args = [sys.executable, "-m", "pipeline.data.stages", "prepare", "test", f"--run.root={tmp_path}",
            "--data.source=files", f"--data.path={root}", f"--data.tokenizer={tok_path}", "--data.seq_len=64",
            "--data.vocab_size=400", "--data.max_documents=0", "--data.rows_per_shard=128",
            "--data.tokenize_actors=2", f"--data.dataset_dir={out}",
            f"--ray.address={ray_session.get_runtime_context().gcs_address}"]
    env = {**os.environ, "LONGTRAIN_PREPARE_HOLD": stage, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.time() + 180
        while not list(out.glob(f"build-*/.hold-{stage}")):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "prepare never reached the hold point"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stderr.close()
    assert not (out / MANIFEST_FILE).exists()
    killed = [p.name for p in out.glob("build-*") if p.is_dir()]
    assert len(killed) == 1 and (out / killed[0] / "_parts").is_dir()  # really killed mid-build: its files are there
    if stage == "shards":
        assert list(out.glob("build-*/train-*.parquet"))
    with pytest.raises(DatasetError, match="manifest.json is missing"):
        load_manifest(out)
    report = validate_dataset(out)
    assert not report.ok and "manifest.json is missing" in report.errors[0]
    cfg = data_cfg(tmp_path, tok_path, data__source="files", data__path=str(root), data__dataset_dir=str(out))
    assert prepare(cfg) == out
    assert validate_dataset(out).ok and not list(out.glob("build-*/.hold-*"))
    # the rerun built anew and removed the killed build (its process is gone), parts and all
    builds = {p.name for p in out.glob("build-*") if p.is_dir()}
    assert builds == {load_manifest(out).tokenizer_file.split("/")[0]} and killed[0] not in builds
    assert not list(out.glob("build-*/_parts"))


def test_a_small_corpus_starts_no_idle_tokenizer_actors(ray_session, tok_path, tmp_path, recwarn):
    """One small .jsonl file is one block: one actor tokenizes it (not one per core, the others idle), and Ray
    Data has no reason to warn that the pool is larger than its input."""
    write_jsonl(tmp_path / "small.jsonl", sample_docs(30, 400))
    out = prepare(data_cfg(tmp_path, tok_path, data__source="files", data__path=str(tmp_path / "small.jsonl"),
                           data__tokenize_actors=0))
    assert load_manifest(out).extra["tokenize_actors"] == 1
    assert not [w for w in recwarn if "minimum number of concurrent actors" in str(w.message)]


def test_a_tokenize_actor_constructed_after_its_build_ended_touches_nothing(tok_path, tmp_path):
    """Ray Data may construct an actor of a build's tokenize pool after that build has removed its parts, or its
    whole directory (a pool's pending actor is released, not killed): the constructor must not open the build's
    files (it raised FileNotFoundError on `_parts/part-*.bin`, a worker traceback under a prepare that worked). An
    actor that gets a batch, which only a running build gives, loads the tokenizer and writes its part file then."""
    import pyarrow as pa

    from pipeline.data.pack import _TokenizeBatch

    gone = tmp_path / "build-gone"
    _TokenizeBatch(str(gone / "tokenizer.model"), "uint16", "the corpus", str(gone / PARTS_DIR))
    assert not gone.exists()

    parts = tmp_path / "build-live" / PARTS_DIR
    parts.mkdir(parents=True)
    actor = _TokenizeBatch(str(tok_path), "uint16", "the corpus", str(parts))
    assert not list(parts.iterdir())
    docs = ["one short document", "and another one"]
    row = actor(pa.table({"text": docs})).to_pylist()[0]
    stream = expected_stream(Tokenizer(tok_path), docs)
    assert row["offset"] == 0 and row["tokens"] == len(stream)
    assert np.array_equal(np.fromfile(parts / row["file"], np.uint16), stream)
