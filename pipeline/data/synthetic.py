"""Synthetic packed rows for tests and for benchmarks on hosts with no corpus.

Each global sequence id maps to the same tokens and document boundaries every time (a generator
seeded by (seed, seq_id)), and batches follow the same cursor rules as the shard reader: from
global sequence `start`, micro-batches of batch_size x world_size sequences, rank r taking the r-th
slice. So a synthetic run resumes exactly, like a real one.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

EOS_ID = 3  # the shard tokenizer's fixed EOS id (pipeline/data/tokenizer.py)


def synthetic_row(seq_id: int, seq_len: int, vocab_size: int, seed: int = 0,
                  mean_doc_len: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (seq_len+1,) int64, doc_ids (seq_len+1,) int32) for one packed row.

    Documents have geometric lengths with mean `mean_doc_len` (default seq_len // 4) and end in EOS.
    """
    rng = np.random.default_rng([seed, seq_id])
    tokens = rng.integers(4, vocab_size, size=seq_len + 1, dtype=np.int64)
    mean = mean_doc_len or max(2, seq_len // 4)
    doc_ids = np.zeros(seq_len + 1, dtype=np.int32)
    pos, doc = 0, 0
    while True:
        pos += int(rng.geometric(1.0 / mean))
        if pos >= seq_len + 1:
            break
        tokens[pos - 1] = EOS_ID  # a document ends with EOS; the next starts at pos
        doc += 1
        doc_ids[pos:] = doc
    return tokens, doc_ids


def synthetic_batches(*, n_sequences: int, seq_len: int, vocab_size: int, batch_size: int, seed: int = 0,
                      epoch: int = 0, start: int = 0, rank: int = 0, world_size: int = 1
                      ) -> Iterator[dict[str, torch.Tensor]]:
    """Batch dicts (tokens (B, T+1) int64, doc_ids (B, T+1) int32, seq_id (B,) int64) over a seeded
    permutation of `n_sequences` ids for `epoch`; the last incomplete global micro-batch is dropped."""
    order = np.random.default_rng([seed, epoch]).permutation(n_sequences)
    global_b = batch_size * world_size
    for lo in range(start, n_sequences - global_b + 1, global_b):
        ids = order[lo + rank * batch_size: lo + (rank + 1) * batch_size]
        rows = [synthetic_row(int(i), seq_len, vocab_size, seed) for i in ids]
        yield {"tokens": torch.from_numpy(np.stack([r[0] for r in rows])),
               "doc_ids": torch.from_numpy(np.stack([r[1] for r in rows])),
               "seq_id": torch.from_numpy(ids.astype(np.int64))}


def write_synthetic_dataset(dataset_dir, *, n_train: int, n_val: int, seq_len: int, vocab_size: int,
                            seed: int = 0, rows_per_shard: int = 256):
    """A real dataset directory (Parquet shards + manifest, same schema as `prepare`) of synthetic rows,
    written with pyarrow alone: benchmarks on hosts without Ray or a corpus read it with ShardReader,
    so their data path is the real one. Returns the Manifest."""
    from pathlib import Path

    from pipeline.data.shards import (SCHEMA_VERSION, Manifest, shard_schema, windows_table, write_manifest,
                                 write_shard)

    out = Path(dataset_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = shard_schema(seq_len, vocab_size)
    shards: dict = {}
    seq_id = 0
    for split, n in (("train", n_train), ("val", n_val)):
        shards[split] = []
        for k, lo in enumerate(range(0, n, rows_per_shard)):
            ids = np.arange(seq_id + lo, seq_id + min(n, lo + rows_per_shard))
            windows = np.stack([synthetic_row(int(i), seq_len, vocab_size, seed)[0] for i in ids])
            table = windows_table(windows, ids, EOS_ID, vocab_size)
            shards[split].append(write_shard(out / f"{split}-{k:05d}.parquet", [table], schema))
        seq_id += n
    tokens = (n_train + n_val) * (seq_len + 1)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, seq_len=seq_len, vocab_size=vocab_size, pad_id=0, unk_id=1, bos_id=2,
        eos_id=EOS_ID, token_type="uint16" if vocab_size <= 65535 else "int32", tokenizer_file="",
        tokenizer_sha256="synthetic", settings_hash=f"synthetic-{seed}-{seq_len}-{vocab_size}-{n_train}-{n_val}",
        source={"kind": "synthetic", "seed": seed}, settings={"seq_len": seq_len, "vocab_size": vocab_size},
        counts={"documents": 0, "tokens_total": tokens, "tokens_kept": tokens}, packing_efficiency=1.0,
        remainder_policy="synthetic rows: nothing dropped", doc_length={}, shards=shards)
    write_manifest(out, manifest)
    return manifest
