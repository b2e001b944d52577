"""The prepare command's header names the vocabulary the dataset will have: the given tokenizer's own size when
`data.tokenizer` is set (data.vocab_size is then unused), else the size of the tokenizer it will train. No Ray: the
prepare itself is replaced by a stand-in that stops right after the header."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_config
from tests.pipeline.data.helpers import make_tokenizer, sample_docs, write_jsonl


class _Stop(Exception):
    pass


def _header(cfg, monkeypatch, capsys) -> str:
    from pipeline.data import pack
    from pipeline.data.stages import prepare_main

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(pack, "prepare_dataset", stop)
    with pytest.raises(_Stop):
        prepare_main(cfg)
    return next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("==> prepare"))


def test_the_header_prints_the_given_tokenizers_vocabulary(tmp_path: Path, monkeypatch, capsys):
    tok = make_tokenizer(tmp_path)  # 400 pieces
    write_jsonl(tmp_path / "c.jsonl", sample_docs(4))
    cfg = load_config("test", {"data.source": "files", "data.path": str(tmp_path / "c.jsonl"),
                               "data.tokenizer": str(tok), "data.vocab_size": 2000, "run.root": str(tmp_path)})
    assert _header(cfg, monkeypatch, capsys).endswith(", vocab 400 (data.tokenizer)")


def test_without_a_tokenizer_the_header_prints_the_vocabulary_it_trains(tmp_path: Path, monkeypatch, capsys):
    cfg = load_config("test", {"data.vocab_size": 777, "run.root": str(tmp_path)})
    assert _header(cfg, monkeypatch, capsys).endswith(", vocab 777")


def test_a_tokenizer_that_cannot_be_read_leaves_the_error_to_the_prepare(tmp_path: Path, monkeypatch, capsys):
    cfg = load_config("test", {"data.tokenizer": str(tmp_path / "missing.model"), "run.root": str(tmp_path)})
    assert _header(cfg, monkeypatch, capsys).endswith(", vocab of data.tokenizer")
