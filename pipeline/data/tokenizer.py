"""SentencePiece tokenizer: train a byte-fallback BPE model on a text sample, or load an existing .model.

    from pipeline.data.tokenizer import Tokenizer, train_tokenizer
    path = train_tokenizer(texts, vocab_size=2000, out_path=Path("tok.model"))
    tok = Tokenizer(path)
    ids = tok.encode_batch(["def f(x):\n    return x"])   # list[list[int]]
    tok.decode(ids[0])

Fixed special ids for models trained here: pad=0, unk=1, bos=2, eos=3 (256 byte pieces follow, so no
text is ever unknown). Normalization is the identity and whitespace is kept as is, so
`decode(encode(text)) == text` for any valid Unicode text: code indentation and blank lines survive.
The sha256 of the .model file identifies the tokenizer everywhere downstream (manifest, cache key).
Ray-free: importable on hosts with only sentencepiece.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    import numpy as np

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# SentencePiece skips training sentences longer than max_sentence_length bytes; we cut paragraphs to this.
_MAX_SENTENCE_BYTES = 16384


class TokenizerError(ValueError):
    """A tokenizer cannot be trained or loaded; the message names the cause and the fix."""


def file_sha256(path: Path | str) -> str:
    """sha256 of a file, local or on object storage."""
    from pipeline.storage import sha256

    return sha256(path)


class Tokenizer:
    """A loaded SentencePiece model. Picklable (it re-loads from the model bytes), so Ray can ship it."""

    def __init__(self, path: Path | str):
        import sentencepiece as spm

        from pipeline.storage import read_bytes

        self.path = str(path)  # a local path or a URI (the dataset's tokenizer on object storage)
        try:
            self._proto = read_bytes(self.path)
        except (FileNotFoundError, IsADirectoryError):
            raise TokenizerError(f"tokenizer model {self.path!r} does not exist; "
                                 "set data.tokenizer to a SentencePiece .model file or leave it empty to train one"
                                 ) from None
        self.sha256 = hashlib.sha256(self._proto).hexdigest()
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(self._proto)
        except Exception as exc:  # sentencepiece raises RuntimeError/OSError with a C++ message
            raise TokenizerError(f"{self.path!r} is not a SentencePiece model ({exc})".splitlines()[0]) from None
        self.vocab_size: int = self._sp.get_piece_size()
        self.pad_id: int = self._sp.pad_id()
        self.unk_id: int = self._sp.unk_id()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        if self.eos_id < 0:
            raise TokenizerError(f"tokenizer {self.path!r} has no EOS piece; packing needs one between documents")

    def __getstate__(self) -> dict:
        return {"path": self.path, "proto": self._proto}

    def __setstate__(self, state: dict) -> None:
        import sentencepiece as spm

        self.path, self._proto = state["path"], state["proto"]
        self.sha256 = hashlib.sha256(self._proto).hexdigest()
        self._sp = spm.SentencePieceProcessor()
        self._sp.LoadFromSerializedProto(self._proto)
        self.vocab_size, self.pad_id, self.unk_id = self._sp.get_piece_size(), self._sp.pad_id(), self._sp.unk_id()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """One call into SentencePiece for the whole list; single-threaded because each Ray actor owns one core."""
        return self._sp.encode(texts, out_type=int, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def utf8_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """(bytes (V,) int64, lead_space (V,) bool): the UTF-8 bytes each id decodes to (a byte piece 1, control and
        unknown ids 0, '▁' one space), and whether the piece starts with the '▁' SentencePiece drops at the start of
        a text (its dummy prefix). What bits per byte divides by (pipeline/eval/sources.py)."""
        import numpy as np

        sp, n = self._sp, self.vocab_size
        size = np.zeros(n, np.int64)
        lead = np.zeros(n, bool)
        for i in range(n):
            if sp.is_control(i) or sp.is_unknown(i):
                continue
            if sp.is_byte(i):
                size[i] = 1
                continue
            piece = sp.id_to_piece(i)
            size[i] = len(piece.replace("\u2581", " ").encode("utf-8"))
            lead[i] = piece.startswith("\u2581")
        return size, lead

    def special_ids(self) -> dict[str, int]:
        return {"pad_id": self.pad_id, "unk_id": self.unk_id, "bos_id": self.bos_id, "eos_id": self.eos_id}


def _training_sentences(texts: Iterable[str]) -> Iterator[str]:
    """Paragraphs of the sample, each under SentencePiece's sentence limit (longer ones would be skipped)."""
    for text in texts:
        for para in text.split("\n\n"):
            if not para.strip():
                continue
            data = para.encode("utf-8", "replace")
            for i in range(0, len(data), _MAX_SENTENCE_BYTES):
                yield data[i:i + _MAX_SENTENCE_BYTES].decode("utf-8", "ignore")


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_path: Path | str, *,
                    num_threads: int | None = None) -> Path | str:
    """Train byte-fallback BPE on `texts` and write the model to out_path (a path or a URI; atomically).
    Returns out_path.

    Raises TokenizerError naming the largest vocab the sample supports when vocab_size is too big for it.
    """
    import sentencepiece as spm

    out_path = out_path if isinstance(out_path, str) and "://" in out_path else Path(out_path)
    if vocab_size < 260:  # 4 specials + 256 byte pieces
        raise TokenizerError(f"vocab_size={vocab_size} is too small; byte fallback needs at least 260 pieces")
    model = io.BytesIO()
    n_sentences = 0

    def counted(it: Iterator[str]) -> Iterator[str]:
        nonlocal n_sentences
        for s in it:
            n_sentences += 1
            yield s

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=counted(_training_sentences(texts)), model_writer=model, vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
            allow_whitespace_only_pieces=True, character_coverage=0.9995, max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=num_threads or os.cpu_count() or 1, minloglevel=2,
        )
    except RuntimeError as exc:
        msg = str(exc)
        limit = re.search(r"Please set it to a value <= (\d+)", msg)
        if limit:
            raise TokenizerError(
                f"the tokenizer sample is too small for data.vocab_size={vocab_size}: the largest vocab it supports "
                f"is {limit.group(1)}; set --data.vocab_size={limit.group(1)} (or lower), or give more text "
                f"(data.tokenizer_sample_bytes / a larger corpus)") from None
        if n_sentences == 0:
            raise TokenizerError("no text to train the tokenizer on: the corpus sample is empty") from None
        raise TokenizerError(f"SentencePiece training failed: {msg.splitlines()[-1] if msg else exc}") from None
    from pipeline.storage import write_bytes

    write_bytes(out_path, model.getvalue())  # whole or not at all, on a local disk or object storage
    return out_path
