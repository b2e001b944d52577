"""Small deterministic corpora, a tokenizer and configs for the data-stage tests (no Ray here)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.config import load_config
from pipeline.data.cleaning import clean_texts
from pipeline.data.tokenizer import Tokenizer, train_tokenizer

VOCAB = 400
SEQ_LEN = 64


def sample_docs(n: int = 40, max_chars: int = 3000) -> list[str]:
    """Real English/code text from Python's help topics, cut short: ~100 KB for n=40."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [topics[k][:max_chars] for k in sorted(topics)[:n]]


def long_doc(min_chars: int = 20000) -> str:
    """One document far longer than 50 windows of SEQ_LEN+1 tokens at VOCAB pieces (~2.5 chars/token)."""
    import pydoc_data.topics

    text, topics = "", pydoc_data.topics.topics
    for k in sorted(topics, reverse=True):
        text += topics[k] + "\n"
        if len(text) >= min_chars:
            return text
    raise AssertionError("not enough text")


def make_tokenizer(out_dir: Path, vocab: int = VOCAB) -> Path:
    return train_tokenizer(sample_docs(80, 6000), vocab, Path(out_dir) / "test_tok.model", num_threads=1)


def write_jsonl(path: Path, docs: list, column: str = "text") -> Path:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({column: d, "id": len(d or "")}) + "\n")
    return path


def data_cfg(tmp_path: Path, tokenizer: Path | None, **overrides):
    """The test preset pointed at tmp_path, with a pre-trained tokenizer unless tokenizer is None."""
    base = {"run.root": str(tmp_path / "runs"), "data.seq_len": SEQ_LEN, "data.vocab_size": VOCAB,
            "data.rows_per_shard": 128, "data.val_fraction": 0.05, "data.max_documents": 0,
            "data.tokenize_actors": 2, "data.tokenizer": str(tokenizer) if tokenizer else ""}
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config("test", base)


def expected_stream(tok: Tokenizer, docs: list) -> np.ndarray:
    """What packing must reproduce: each cleaned document's ids followed by EOS, in order."""
    texts, _ = clean_texts(docs)
    out: list[int] = []
    for ids in tok.encode_batch(texts):
        out += ids + [tok.eos_id]
    return np.array(out, np.int64)


def read_rows(dataset_dir: Path) -> dict[str, np.ndarray | list]:
    """Every row of every shard, ordered by seq_id: tokens (N, T+1), doc_starts, split of each row."""
    from pipeline.data.shards import load_manifest

    m = load_manifest(dataset_dir)
    toks, starts, seq, split = [], [], [], []
    for name, shards in m.shards.items():
        for s in shards:
            t = pq.read_table(Path(dataset_dir) / s.file)
            toks.append(np.array(t.column("tokens").combine_chunks().flatten()).reshape(-1, m.window))
            starts += t.column("doc_starts").to_pylist()
            seq.append(t.column("seq_id").to_numpy())
            split += [name] * t.num_rows
    seq_ids = np.concatenate(seq)
    order = np.argsort(seq_ids, kind="stable")
    return {"tokens": np.concatenate(toks)[order].astype(np.int64), "doc_starts": [starts[i] for i in order],
            "seq_id": seq_ids[order], "split": [split[i] for i in order], "manifest": m}
