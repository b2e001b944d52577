"""Fixtures shared by the pipeline tests.

`tok_path`: ONE SentencePiece model for the session (tests/pipeline/data/helpers.py `make_tokenizer`: 400 pieces
trained on Python's help topics), trained once instead of once per module; the data and eval tests that need a
tokenizer, not one trained on text of their own, read it and never write beside it.

`files_dataset`: ONE prepared `files`-source dataset for the session (on that tokenizer), shared by the data tests
that read a dataset's shards and the train tests that train on one (see the fixture).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tok_path(tmp_path_factory) -> Path:
    from tests.pipeline.data.helpers import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@dataclass
class FilesSetup:
    dataset: Path  # the prepared dataset's directory
    overrides: list[str]  # with --preset test and a run.root of the test's own: the data.* fields that find it again
    corpus: Path  # the one .jsonl file it was prepared from


@pytest.fixture(scope="session")
def files_dataset(ray_session, tok_path, tmp_path_factory) -> FilesSetup:
    """ONE `files`-source dataset for the session, prepared on the session's Ray: 60 help topics (2,500 characters
    each) in one .jsonl file, the session tokenizer (`tok_path`), seq_len 64, 100 rows a shard, 10% validation.
    It sits in a dataset store of its own (data.dataset_store), so that commands with these data settings and any
    run root find it there by its content hash instead of preparing it again.
    tests/pipeline/data/test_shards.py reads its shards (and damages private copies of it);
    tests/pipeline/train/test_resume_extend.py and test_resume_record.py train on it, each under a run root of its
    own. None writes inside it."""
    from pipeline.config import load_config
    from pipeline.data.pack import prepare
    from tests.pipeline.data.helpers import SEQ_LEN, VOCAB, sample_docs, write_jsonl

    base = tmp_path_factory.mktemp("files_dataset")
    corpus = write_jsonl(base / "corpus.jsonl", sample_docs(60, 2500))
    overrides = [f"--data.dataset_store={base / 'datasets'}", "--data.source=files", f"--data.path={corpus}",
                 f"--data.tokenizer={tok_path}", f"--data.vocab_size={VOCAB}", f"--data.seq_len={SEQ_LEN}",
                 "--data.rows_per_shard=100", "--data.val_fraction=0.1", "--data.max_documents=0",
                 "--data.tokenize_actors=2"]
    dataset = prepare(load_config("test", [f"--run.root={base / 'runs'}", *overrides]))
    return FilesSetup(dataset, overrides, corpus)
