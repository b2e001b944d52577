"""Unreadable records (issue 17): one line on the console, no Ray traceback or retry advice; skip + count
per file (manifest, validate report) under data.max_bad_fraction; error fails on the first one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.data.corpus import DataSourceError
from pipeline.data.pack import prepare
from pipeline.data.shards import load_manifest
from pipeline.data.validate_dataset import validate_dataset
from tests.pipeline.data.helpers import data_cfg, sample_docs, write_jsonl

REPO = Path(__file__).resolve().parents[3]
RAY_NOISE = ("Traceback", "Failed to read stream", "Failed to apply UDF", "DataContext", "retried_io_errors",
             "retried_map_errors", "max_errored_blocks", "RayTaskError")


def hostile_jsonl(path: Path, good: list[str]) -> Path:
    """Line 2 is not JSON; then a null text (an empty document, not a bad record), a numeric text, good lines."""
    lines = [json.dumps({"text": good[0]}), "{this is not json", json.dumps({"text": None}), json.dumps({"text": 7})]
    lines += [json.dumps({"text": t}) for t in good[1:]]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_prepare(ray_session, tmp_path: Path, tok_path: Path, corpus: Path, *extra: str):
    cmd = [sys.executable, "pipeline/run.py", "prepare", "--preset", "test", f"--run.root={tmp_path / 'runs'}",
           "--data.source=files", f"--data.path={corpus}", f"--data.tokenizer={tok_path}", "--data.vocab_size=400",
           "--data.max_documents=0", f"--ray.address={ray_session.get_runtime_context().gcs_address}", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def assert_one_clean_line(proc, pattern: str) -> None:
    console = proc.stdout + proc.stderr
    assert proc.returncode == 2, console[-3000:]
    for noise in RAY_NOISE:
        assert noise not in console, f"{noise!r} on the console:\n{console[-3000:]}"
    errors = [ln for ln in console.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and __import__("re").search(pattern, errors[0]), console[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == errors[0]  # the last thing the user sees


@pytest.mark.system
def test_failing_prepare_prints_one_line_without_ray_tracebacks(ray_session, tok_path, tmp_path):
    corpus = hostile_jsonl(tmp_path / "a.jsonl", sample_docs(6, 400))
    strict = run_prepare(ray_session, tmp_path, tok_path, corpus, "--data.on_bad_record=error")
    assert_one_clean_line(strict, r"^error: \S*a\.jsonl line 2: not valid JSON \(.*\); .jsonl holds one object "
                                  r"per line \(data.on_bad_record=error")
    # The default policy (skip, max_bad_fraction 0.001): 2 bad of 9 records is far above the threshold.
    default = run_prepare(ray_session, tmp_path, tok_path, corpus)
    assert_one_clean_line(default, r"^error: 2 of 9 records \(22\.222%\) are unreadable, more than "
                                   r"data.max_bad_fraction=0.001; the first: \S*a\.jsonl line 2: not valid JSON")
    assert not list((tmp_path / "runs").glob("datasets/*/manifest.json"))


def test_skipped_records_are_counted_per_file_in_manifest_and_report(ray_session, tok_path, tmp_path):
    docs = sample_docs(30, 1500)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    hostile_jsonl(corpus / "a.jsonl", docs[:12])
    write_jsonl(corpus / "b.jsonl", docs[12:])
    with open(corpus / "b.jsonl", "a") as f:
        f.write('{"body": "no text field"}\n')
    (corpus / "c.json").write_text('[{"text": "truncated')  # a .json file that does not parse: one record
    cfg = data_cfg(tmp_path, tok_path, data__source="files", data__path=str(corpus), data__max_bad_fraction=0.2)
    out = prepare(cfg)
    m = load_manifest(out)
    a, b, c = (str(corpus / n) for n in ("a.jsonl", "b.jsonl", "c.json"))
    assert m.counts["bad_records"] == 4 and m.counts["dropped_empty"] == 1 and m.counts["documents"] == 30
    assert {f: v["count"] for f, v in m.bad_records.items()} == {a: 2, b: 1, c: 1}
    assert m.bad_records[a]["first"].startswith(f"{a} line 2: not valid JSON")
    assert m.bad_records[b]["first"] == f"{b} line 19: no 'text' field (fields: body); set data.text_column"
    report = validate_dataset(out)
    assert report.ok, report.errors
    text = report.format()
    assert "4 unreadable records skipped" in text and f"{a}: 2 (first: {a} line 2: not valid JSON" in text
    # Reusing that dataset under a stricter policy fails as a fresh build would, with the same one line.
    with pytest.raises(DataSourceError, match=r"a\.jsonl line 2: not valid JSON .*data.on_bad_record=error"):
        prepare(cfg.replace({"data.on_bad_record": "error"}))
    with pytest.raises(DataSourceError, match=r"4 of 35 records .* more than data.max_bad_fraction=0.1"):
        prepare(cfg.replace({"data.max_bad_fraction": 0.1}))
