"""Fixtures shared by the pipeline tests.

`tok_path`: ONE SentencePiece model for the session (tests/pipeline/data/helpers.py `make_tokenizer`: 400 pieces
trained on Python's help topics), trained once instead of once per module; the data and eval tests that need a
tokenizer, not one trained on text of their own, read it and never write beside it.
"""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tok_path(tmp_path_factory) -> Path:
    from tests.pipeline.data.helpers import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))
