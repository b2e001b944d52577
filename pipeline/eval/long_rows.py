"""Rows longer than training used, built from the same documents: `eval --seq-len 2x|4x`.

    reader = LongRows(dataset_dir, factor=2, batch_size=8)      # rank, world_size as eval_reader takes them
    for batch in reader: ...     # {"tokens": int64 (B, 2(T+1)), "doc_ids": int32 (B, 2(T+1)), "pad": bool (B,)}
    reader.score_from            # targets before this index are context only: (factor - 1)(T + 1)

A dataset's rows are consecutive windows of one token stream (window w = tokens [w(T+1), (w+1)(T+1)), seq_id w;
pipeline/data/pack.py), and the validation split is a hashed subset of them. A long row for validation window w is
the stream itself from window w - factor + 1 to window w: the factor - 1 windows before it (from whichever split
holds them) and then window w, so every document of window w gets back up to (factor - 1)(T + 1) tokens of its
own beginning, and positions run to factor x T. Only window w's targets are scored (`score_from`): the same
tokens as the 1x evaluation, none that training scored, now with more context. Their mean loss next to the 1x one
says whether the model uses the longer context (lower) or breaks past its trained positions (higher, or an
explosion). Document boundaries come from the EOS tokens, as the shards' doc_starts do. Validation windows with
fewer than factor - 1 windows before them (the stream's start) are left out (`skipped`).

Like eval_reader, every rank runs the same number of batches of the same shape: the last global batch is filled
with copies of a real row flagged in `pad`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq

from pipeline.data.shards import DatasetError, Manifest, ShardReader, load_manifest
from pipeline.storage import join, open_input


def seq_ids_of(dataset_dir: str | Path, split: str, manifest: Manifest | None = None) -> np.ndarray:
    """The seq_id of every row of `split`, in the split's row order (only that column is read); `manifest`: the
    dataset's, when the caller has read it already."""
    manifest = manifest if manifest is not None else load_manifest(dataset_dir)
    parts = [pq.read_table(open_input(join(str(dataset_dir), s.file)), columns=["seq_id"]).column(0).to_numpy()
             for s in manifest.shards.get(split, [])]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def doc_ids_from_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """(B, W) tokens -> (B, W) int32 document ids: a document starts after every EOS (never at 0)."""
    starts = np.zeros(tokens.shape, np.int32)
    starts[:, 1:] = tokens[:, :-1] == eos_id
    return np.cumsum(starts, axis=1, dtype=np.int32)


class LongRows:
    """Batches of validation windows, each with the factor - 1 stream windows before it (module docstring)."""

    def __init__(self, dataset_dir: str | Path, factor: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 manifest: Manifest | None = None):
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.dataset_dir, self.factor, self.batch_size = str(dataset_dir), factor, batch_size
        self.rank, self.world_size = rank, world_size
        self.manifest = manifest if manifest is not None else load_manifest(dataset_dir)  # read once, handed on
        self.window = self.manifest.window
        self.row_len = factor * self.window - 1  # targets per long row
        self.score_from = (factor - 1) * self.window
        self._readers = {split: ShardReader(dataset_dir, split, 1, drop_last=False, manifest=self.manifest)
                         for split in ("train", "val") if self.manifest.rows(split)}
        if "val" not in self._readers:
            raise DatasetError(f"dataset {self.dataset_dir!r} has no validation rows; prepare it with a larger "
                               "data.val_fraction")
        where: dict[int, tuple[str, int]] = {}
        for split in self._readers:
            for row, sid in enumerate(seq_ids_of(dataset_dir, split, self.manifest).tolist()):
                where[sid] = (split, row)
        self._where = where
        val_ids = seq_ids_of(dataset_dir, "val", self.manifest)
        order = np.argsort(val_ids, kind="stable")
        keep = [int(r) for r in order if all(int(val_ids[r]) - j in where for j in range(1, factor))]
        self.rows = np.asarray(keep, np.int64)  # validation rows that have their context, in stream order
        self._seq_ids = val_ids
        self.skipped = len(val_ids) - len(keep)
        if not len(keep):
            raise DatasetError(f"no validation row of {self.dataset_dir!r} has {factor - 1} window(s) before it in "
                               f"the stream; evaluate at a smaller --seq-len factor or prepare more data")

    def __len__(self) -> int:
        return -(-len(self.rows) // (self.batch_size * self.world_size))

    def _long_rows(self, val_rows: np.ndarray) -> np.ndarray:
        """(len(val_rows), factor * (T + 1)) tokens: the stream from factor - 1 windows before each validation row
        up to the end of that row; one read per split for the whole batch."""
        wanted = [self._where[int(self._seq_ids[r]) - j] for r in val_rows for j in range(self.factor - 1, -1, -1)]
        got: dict[tuple[str, int], np.ndarray] = {}
        for split, reader in self._readers.items():
            rows = sorted({row for s, row in wanted if s == split})
            if rows:
                tokens = reader.read_rows(np.asarray(rows, np.int64))["tokens"]
                got.update({(split, row): t for row, t in zip(rows, tokens)})
        return np.stack([got[w] for w in wanted]).reshape(len(val_rows), self.factor * self.window)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        global_batch = self.batch_size * self.world_size
        for start in range(0, len(self.rows), global_batch):
            mine = self.rows[start + self.rank * self.batch_size: start + (self.rank + 1) * self.batch_size]
            pad = np.zeros(self.batch_size, bool)
            pad[len(mine):] = True  # the last global batch: copies of a real row, not counted
            mine = np.concatenate([mine, np.full(self.batch_size - len(mine), self.rows[start])])
            tokens = self._long_rows(mine)
            yield {"tokens": torch.from_numpy(tokens),
                   "doc_ids": torch.from_numpy(doc_ids_from_eos(tokens, self.manifest.eos_id)),
                   "pad": torch.from_numpy(pad)}
