"""SentencePiece training and loading: fixed special ids, lossless round trip, sha256 identity, clear errors."""
from __future__ import annotations

import hashlib
import pickle
import re

import pytest

from pipeline.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, TokenizerError, train_tokenizer
from tests.pipeline.data.helpers import sample_docs


def test_trained_model_has_fixed_special_ids_and_exact_vocab(tok_path):
    tok = Tokenizer(tok_path)
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tok.vocab_size == 400
    assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.id_to_piece(4) == "<0x00>"  # byte fallback pieces follow the specials
    assert tok.sha256 == hashlib.sha256(tok_path.read_bytes()).hexdigest()


@pytest.mark.parametrize("text", [
    "def f(x):\n    return  x\t+ 1\n\n\n",          # indentation, double spaces, tabs, blank lines survive
    "  leading and trailing spaces  ",
    "ünïcödé, 中文, emoji 😀 and a \u200b zero-width space",  # unseen characters go through byte fallback
])
def test_round_trip_is_lossless(tok_path, text):
    tok = Tokenizer(tok_path)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids) and UNK_ID not in ids


def test_encode_batch_matches_encode_and_pickles(tok_path):
    tok = Tokenizer(tok_path)
    texts = sample_docs(5, 500)
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.sha256 == tok.sha256 and clone.encode_batch(texts) == tok.encode_batch(texts)


def test_training_is_deterministic(tmp_path):
    a = train_tokenizer(sample_docs(30, 2000), 350, tmp_path / "a.model", num_threads=2)
    b = train_tokenizer(sample_docs(30, 2000), 350, tmp_path / "b.model", num_threads=2)
    assert a.read_bytes() == b.read_bytes()


def test_too_small_corpus_names_the_largest_vocab(tmp_path):
    with pytest.raises(TokenizerError, match=r"largest vocab it supports is \d+") as info:
        train_tokenizer(["a tiny corpus with few distinct words"] * 3, 5000, tmp_path / "t.model")
    largest = int(re.search(r"supports is (\d+)", str(info.value)).group(1))
    assert 260 <= largest < 5000
    assert "--data.vocab_size" in str(info.value)
    # and that vocab does train
    assert Tokenizer(train_tokenizer(["a tiny corpus with few distinct words"] * 3, largest,
                                     tmp_path / "t.model")).vocab_size == largest


def test_empty_sample_and_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no text"):
        train_tokenizer(["", "   \n\n  "], 300, tmp_path / "e.model")
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer(tmp_path / "missing.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a sentencepiece model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        Tokenizer(junk)
