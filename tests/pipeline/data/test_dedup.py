"""Deduplication in prepare, on the session's Ray: the same kept set on one worker and on several, a prepare's record
of what it removed, a mixture whose two sources share documents (its manifest, summary, mixture.json and MLflow), a
split that would have put copies on both sides, and `validate` finding them in a dataset made without deduplication.

    .venv/bin/python -m pytest -q tests/pipeline/data/test_dedup.py            # the quick ones
    .venv/bin/python -m pytest -q -m system tests/pipeline/data/test_dedup.py  # the Ray ones (~20 s each on 2 cores)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_config
from tests.pipeline.data.helpers import make_tokenizer, sample_docs, write_jsonl


def changed(doc: str, every: int) -> str:
    """doc with every `every`-th word replaced (every=100: ~1 % of its words changed)."""
    words = doc.split()
    return " ".join(f"changed{i}" if i % every == every // 2 else w for i, w in enumerate(words))


def planted(n: int = 40) -> tuple[list[str], dict]:
    """Distinct help topics, then: an exact copy of doc 0 (spacing changed), a copy of doc 1 with ~1 % of its words
    changed (Jaccard ~0.95), a copy of doc 2 with every third word changed (Jaccard ~0): what is removed is known."""
    docs = sample_docs(n, 3000)
    copies = {"exact": "  " + docs[0].replace(" ", "\n", 5) + "\n", "near": changed(docs[1], 100),
              "far": changed(docs[2], 3)}
    return docs + list(copies.values()), {"exact": n, "near": n + 1, "far": n + 2}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("dedup-tok"))


def cfg_for(tmp_path: Path, tok: Path, path: Path | str = "", **data):
    over = {"run.root": str(tmp_path / "runs"), "data.seq_len": 64, "data.vocab_size": 400,
            "data.max_documents": 0, "data.rows_per_shard": 256, "data.tokenizer": str(tok)}
    if path:
        over.update({"data.source": "files", "data.path": str(path)})
    over.update({f"data.{k}": v for k, v in data.items()})
    return load_config("test", over)


def test_a_bad_dedup_setting_is_one_line_from_the_command_line(capsys):
    """The command's exit and line (every bad setting's own line: test_dedup_units.py)."""
    from pipeline.run import main

    assert main(["prepare", "--preset", "test", "--data.dedup_threshold=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.dedup_threshold=0.0 is invalid; it must be in (0, 1]") and "\n" not in err, err
    # a setting that would do nothing is refused as well
    assert main(["prepare", "--data.dedup=exact", "--data.dedup_threshold=0.8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: data.dedup_threshold is not used: data.dedup is not near, so no near copy is looked for; "
                   "drop it"), err


@pytest.mark.system
def test_the_same_kept_set_on_one_worker_and_on_several(ray_session, tmp_path, tok, monkeypatch):
    """One task at a time and one hash partition against as many tasks as Ray Data likes and 7 partitions, on four
    files; the first with the components of its graph solved in one task, the second by large-star/small-star
    rounds; and both against the default for a corpus this small, where the exact copies are found and the removed
    rows sorted in one task too (no shuffle at all)."""
    import numpy as np

    from pipeline.data import dedup_components
    from pipeline.data.dedup import GroupSource, dedup_spec, deduplicate

    docs, where = planted()
    for i in range(4):
        write_jsonl(tmp_path / f"part-{i}.jsonl", docs[i::4])
    d = cfg_for(tmp_path, tok, tmp_path, dedup="near").data

    def removed(workers: int | None) -> tuple[set, dict]:
        r = deduplicate([GroupSource("", d, 0)], dedup_spec(d), workers=workers)
        nodes = [ray_session.get(ref).column("node").to_numpy() for ref in r.removal(0).refs]
        return set(np.concatenate(nodes).tolist()) if nodes else set(), r.record(0)

    one, rec_one = removed(1)
    small, rec_small = removed(None)
    assert small == one and rec_small["removed_exact"] == rec_one["removed_exact"]
    monkeypatch.setattr(dedup_components, "ONE_TASK_EDGES", 0)
    monkeypatch.setattr("pipeline.data.dedup.ONE_TASK_DOCS", 0)
    monkeypatch.setattr("pipeline.data.dedup._partitions", lambda rows, row_bytes: 7)
    many, rec_many = removed(None)
    assert one == many and len(one) == 2
    assert rec_one["removed_exact"] == rec_many["removed_exact"] == 1
    assert rec_one["removed_near"] == rec_many["removed_near"] == 1
    # (file, line) of the removed: the exact copy and the near copy, not their originals nor the far copy
    assert {(n >> 32, n & 0xFFFFFFFF) for n in one} == {(i % 4, i // 4) for i in (where["exact"], where["near"])}


def changed_at(doc: str, every: int, offset: int) -> str:
    """doc with word offset, offset + every, ... replaced (distinct replacements per offset)."""
    return " ".join(f"chg{offset}x{i}" if i % every == offset else w for i, w in enumerate(doc.split()))


@pytest.mark.system
def test_the_record_counts_clusters_as_connected_components(ray_session, tmp_path, tok, monkeypatch):
    """Near clusters of two, of three as a chain (A-B and B-C linked, A and C further apart than the threshold) and
    of four (two chains through one document), and an exact pair: clusters_near counts the components, not the
    removed documents, on the few-tasks path and on the shuffles' path alike."""
    from pipeline.data import dedup_components
    from pipeline.data.dedup import GroupSource, dedup_spec, deduplicate
    from pipeline.data.dedup_signatures import jaccard

    docs = sample_docs(30, 3000)
    a, b = docs[3], changed_at(docs[3], 60, 10)
    c = changed_at(b, 60, 40)
    assert jaccard(a, b, 5) > 0.8 and jaccard(b, c, 5) > 0.8 and jaccard(a, c, 5) < 0.75  # a chain, not a triangle
    hub = docs[5]
    four = [changed_at(hub, 60, 10), changed_at(changed_at(hub, 60, 10), 60, 40), changed_at(hub, 60, 30)]
    corpus = docs + [changed(docs[1], 100), b, c, *four, "  " + docs[7] + "\n"]
    write_jsonl(tmp_path / "corpus.jsonl", corpus)
    d = cfg_for(tmp_path, tok, tmp_path / "corpus.jsonl", dedup="near").data
    records = [deduplicate([GroupSource("", d, 0)], dedup_spec(d)).record(0)]
    monkeypatch.setattr(dedup_components, "ONE_TASK_EDGES", 0)
    monkeypatch.setattr("pipeline.data.dedup.ONE_TASK_DOCS", 0)
    records.append(deduplicate([GroupSource("", d, 0)], dedup_spec(d)).record(0))
    for rec in records:
        assert (rec["removed_near"], rec["clusters_near"]) == (1 + 2 + 3, 3), rec
        assert (rec["removed_exact"], rec["clusters_exact"]) == (1, 1), rec


@pytest.mark.system
def test_a_prepare_with_near_dedup_removes_and_records_the_copies(ray_session, tmp_path, tok, capsys):
    from pipeline.data.stages import prepare_main, validate_main
    from pipeline.data.shards import load_manifest

    docs, _ = planted()
    write_jsonl(tmp_path / "corpus.jsonl", docs)
    out = prepare_main(cfg_for(tmp_path, tok, tmp_path / "corpus.jsonl", dedup="near"))
    m = load_manifest(out)
    d = m.dedup
    assert (d["mode"], d["threshold"], d["ngram"], d["bands"], d["rows"]) == ("near", 0.75, 5, 14, 8)
    assert (d["documents_read"], d["removed_exact"], d["removed_near"], d["kept"]) == (43, 1, 1, 41)
    assert (d["clusters_exact"], d["clusters_near"]) == (1, 1)
    assert m.counts["documents"] == 41  # the tokenizer saw the kept documents only
    printed = capsys.readouterr().out
    assert ("  dedup near: 43 documents read, 1 removed as exact copies, 1 as near copies (Jaccard >= 0.75 of word "
            "5-grams, 14 bands x 8 rows); 1 + 1 clusters") in printed
    assert validate_main(out) == 0
    assert "  contamination  0 of " in capsys.readouterr().out  # no copy left to straddle the split
    # the settings are in the cache key: another threshold is another dataset, none is the old one
    assert prepare_main(cfg_for(tmp_path, tok, tmp_path / "corpus.jsonl", dedup="near", dedup_threshold=0.9)) != out


@pytest.mark.system
def test_a_split_that_would_have_straddled_a_cluster_and_validate_finds_it(ray_session, tmp_path, tok, capsys):
    """Copies of a document land in both splits without deduplication (rows are split by a hash of their place:
    with 30 % of the rows in val, a copy a few hundred rows long has rows on both sides); `validate` reports the
    val rows holding them on that dataset, and none once prepare removed the copies before the split."""
    from pipeline.data.stages import prepare_main, validate_main

    docs, _ = planted()
    write_jsonl(tmp_path / "corpus.jsonl", docs)
    kept = prepare_main(cfg_for(tmp_path, tok, tmp_path / "corpus.jsonl", dedup="none", val_fraction=0.3))
    capsys.readouterr()
    assert validate_main(kept) == 0  # contamination is reported, not a failure: the dataset is whole
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  contamination"))
    # docs 0 and 1 and their exact and near copies: four documents with a copy in training
    assert "hold a document with a copy in training: 2 documents with an exact copy, 2 with a near copy" in line, line
    assert not line.startswith("  contamination  0 of")
    clean = prepare_main(cfg_for(tmp_path, tok, tmp_path / "corpus.jsonl", dedup="exact", val_fraction=0.3))
    capsys.readouterr()
    validate_main(clean)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  contamination"))
    assert "0 documents with an exact copy, 2 with a near copy" in line, line  # exact removes the exact copy only


@pytest.mark.system
def test_a_mixture_whose_sources_share_documents_trains_each_once(ray_session, tmp_path, tok, mlflow_server, capsys):
    """`web` holds topics 0-29, `edu` topics 20-39 and a near copy of topic 5: 10 exact and 1 near document shared.
    data.dedup_keep=first: the listed-first web keeps them; weight: the heavier edu does."""
    from mlflow.tracking import MlflowClient

    from pipeline.data.mixture import mixture_of
    from pipeline.data.shards import load_manifest
    from pipeline.data.stages import prepared
    from pipeline.tracking.tracker import Tracker
    from pipeline.train.session.mixture_run import record_data

    docs = sample_docs(40, 3000)
    write_jsonl(tmp_path / "web.jsonl", docs[:30])
    write_jsonl(tmp_path / "edu.jsonl", docs[20:] + [changed(docs[5], 100)])
    mixture = [{"name": "web", "weight": 0.4, "source": "files", "path": str(tmp_path / "web.jsonl")},
               {"name": "edu", "weight": 0.6, "source": "files", "path": str(tmp_path / "edu.jsonl")}]
    cfg = cfg_for(tmp_path, tok, dedup="near", mixture=json.dumps(mixture),
                  **{"dataset_store": str(tmp_path / "store")})
    out, m = prepared(cfg)
    printed = capsys.readouterr().out
    sources = {s["name"]: load_manifest(s["dataset_dir"]).dedup for s in m.source["sources"]}
    assert sources["web"]["removed_exact"] + sources["web"]["removed_near"] == 0
    assert (sources["edu"]["removed_exact"], sources["edu"]["removed_near"]) == (10, 1)
    assert sources["edu"]["removed_as_copies_of_other_sources"] == 11 and sources["edu"]["kept"] == 10
    assert m.dedup["shared"] == [{"sources": ["edu", "web"], "documents": 11}]
    assert "documents shared by two sources: edu/web 11" in printed, printed

    # the run's record: mixture.json and MLflow (params per source and per pair)
    uri, _ = mlflow_server
    run_cfg = cfg.replace({"tracking.tracking_uri": uri, "tracking.experiment": "dedup",
                           "tracking.system_metrics": False})
    with Tracker(run_cfg, run_name="dedup-mixture") as tracker:
        record_data(run_cfg, out, m, tracker, steps=2, run_dir=tmp_path)
        run_id = tracker.run_id
    params = MlflowClient(uri).get_run(run_id).data.params
    assert params["dedup/shared/edu/web"] == "11"
    assert (params["dedup/edu/removed_exact"], params["dedup/edu/removed_near"], params["dedup/web/kept"]) == \
        ("10", "1", "30")
    record = json.loads((tmp_path / "mixture.json").read_text())["phases"][0]["dedup"]
    assert record["shared"] == [{"sources": ["edu", "web"], "documents": 11}]
    assert mixture_of(out, cfg, m).sources[1].manifest.dedup["kept"] == 10

    # the heavier source keeps them instead: both sources are other datasets now
    _, m2 = prepared(cfg.replace({"data.dedup_keep": "weight"}))
    again = {s["name"]: load_manifest(s["dataset_dir"]).dedup for s in m2.source["sources"]}
    assert (again["web"]["removed_exact"], again["web"]["removed_near"], again["edu"]["kept"]) == (10, 1, 21)
