"""Data with no usable text is named: the files, the missing field and the fields the records do have, under the
default `skip` policy too (it used to end, after Ray started, in "no text to train the tokenizer on: the corpus
sample is empty"). What one read of the first file can show fails before any Ray work; the rest after the sample."""
from __future__ import annotations

import json

from pipeline.run import main


def _prepare(tmp_path, *args: str) -> list[str]:
    return ["prepare", "--preset", "test", f"--run.root={tmp_path / 'runs'}", *args]


def test_a_text_column_no_record_has_fails_before_ray_naming_file_field_and_fields(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with open(corpus / "a.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"id": i, "text": f"document {i}"}) + "\n")
    assert main(_prepare(tmp_path, f"--data.path={corpus}", "--data.text_column=body")) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: none of the first 3 records of {corpus / 'a.jsonl'} is usable (checked before any Ray "
                   f"work); the first: {corpus / 'a.jsonl'} line 1: no 'body' field (fields: id, text); set "
                   f"data.text_column")
    assert not (tmp_path / "runs").exists()  # no dataset build was started, so no Ray work either


def test_a_corpus_whose_records_hold_no_text_is_named_after_the_sample(ray_session, tmp_path, capsys):
    """The first record has the field (empty), so nothing is wrong before Ray; the sample then finds no text at
    all, and the line says how many records, why none counted, and the first unreadable one's file and fields."""
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": ""}\n{"text": "   "}\n{"id": 3}\n')
    assert main(_prepare(tmp_path, "--data.source=files", f"--data.path={path}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: no text in data.path='{path}': 3 records read, none with text: 1 unreadable (the "
                       f"first: {path} line 3: no 'text' field (fields: id); set data.text_column); 2 empty or "
                       f"whitespace-only; check "
                       f"data.path and data.text_column='text'")
    assert not any("Traceback" in ln for ln in err)
