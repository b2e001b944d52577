"""Which validation rows of a packed dataset hold a document that also occurs in training, exactly or nearly: the
check `validate` runs on any dataset, made before deduplication existed or by another tool. Ray-free.

    report = contamination(dataset_dir, manifest, tokenizer)   # Contamination: val rows affected, by kind
    print(report.line())

The shards hold token windows of one stream (seq_id = the window's place in it) split into train and val by row;
reading both splits' shards in seq_id order (each split's shards are in that order already: a merge of two sorted
streams, one row group at a time) gives back every document whole, between two EOS, with the rows of each split it
lies in. A validation row is contaminated when a document in it has a copy elsewhere in the stream (another document,
not itself) lying at least partly in training rows:
  - exact: the copy's text is the same up to spacing;
  - near: the word n-grams' Jaccard similarity reaches the threshold (MinHash/LSH candidates checked against their
    signatures, as prepare's deduplication does: pipeline/data/dedup_signatures.py).
A document longer than a row lies in several rows, and the split is by row: its other rows may be in training. That
is no copy (those rows hold other tokens of it) and is counted apart, as rows continuing a training document.
The threshold and n-gram size are the dataset's own when it was prepared with data.dedup=near, else FineWeb's
(0.75, 5). Two passes over the shards: the first indexes the documents with validation rows (the small split), the
second streams the documents with training rows against that index, so memory follows the validation split.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.dedup_signatures import DedupParams, Signer, estimate_jaccard
from pipeline.data.shards import Manifest
from pipeline.data.tokenizer import Tokenizer
from pipeline.storage import join, read_bytes

BATCH = 256  # documents signed at once


@dataclass
class Contamination:
    val_rows: int = 0
    rows: dict[str, set] = field(default_factory=lambda: {"exact": set(), "near": set(), "continued": set()})
    val_documents: int = 0
    documents: dict[str, int] = field(default_factory=lambda: {"exact": 0, "near": 0, "continued": 0})
    params: DedupParams = field(default_factory=DedupParams)

    @property
    def affected_rows(self) -> set:
        return self.rows["exact"] | self.rows["near"]

    def to_dict(self) -> dict:
        return {"val_rows": self.val_rows, "affected_val_rows": len(self.affected_rows),
                "rows": {k: len(v) for k, v in self.rows.items()}, "val_documents": self.val_documents,
                "documents": dict(self.documents), "threshold": self.params.threshold, "ngram": self.params.ngram}

    def line(self) -> str:
        n = len(self.affected_rows)
        share = n / self.val_rows if self.val_rows else 0.0
        d = self.documents
        return (f"{n:,} of {self.val_rows:,} val rows ({share:.1%}) hold a document with a copy in training: "
                f"{d['exact']:,} documents with an exact copy, {d['near']:,} with a near copy (Jaccard >= "
                f"{self.params.threshold:g} of word {self.params.ngram}-grams), of {self.val_documents:,} with val rows "
                f"(and {len(self.rows['continued']):,} val rows continue a document that has other rows in training: "
                "the split is by row)")


def _rows(dataset_dir: str, m: Manifest, split: str) -> Iterator[tuple[int, np.ndarray]]:
    """(seq_id, tokens (T+1,)) of a split in seq_id order, a row group at a time."""
    for shard in m.shards.get(split, []):
        pf = pq.ParquetFile(pa.BufferReader(read_bytes(join(dataset_dir, shard.file))))
        for g in range(pf.num_row_groups):
            t = pf.read_row_group(g, columns=["tokens", "seq_id"])
            tokens = t.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, m.window)
            for sid, row in zip(t.column("seq_id").to_numpy(), tokens):
                yield int(sid), row


def _documents(dataset_dir: str, m: Manifest) -> Iterator[tuple[np.ndarray, set[int], set[int]]]:
    """Every document of the stream: (its token ids without EOS, the val seq_ids it lies in, the train ones)."""
    streams = {s: _rows(dataset_dir, m, s) for s in ("train", "val")}
    heads = {s: next(it, None) for s, it in streams.items()}
    pieces: list[np.ndarray] = []
    val_ids: set[int] = set()
    train_ids: set[int] = set()
    while any(h is not None for h in heads.values()):
        split = min((s for s in heads if heads[s] is not None), key=lambda s: heads[s][0])
        sid, row = heads[split]
        heads[split] = next(streams[split], None)
        start = 0
        for end in np.flatnonzero(row == m.eos_id):
            pieces.append(row[start:end])
            (val_ids if split == "val" else train_ids).add(sid)
            yield np.concatenate(pieces), val_ids, train_ids
            pieces, val_ids, train_ids, start = [], set(), set(), end + 1
        if start < len(row):
            pieces.append(row[start:])
            (val_ids if split == "val" else train_ids).add(sid)


class _Batch:
    """Documents waiting to be decoded and signed together."""

    def __init__(self, tok: Tokenizer, signer: Signer):
        self.tok, self.signer = tok, signer
        self.ids: list[np.ndarray] = []
        self.tags: list = []

    def add(self, ids: np.ndarray, tag) -> list:
        self.ids.append(ids)
        self.tags.append(tag)
        return self.flush() if len(self.ids) >= BATCH else []

    def flush(self) -> list:
        if not self.ids:
            return []
        texts = [self.tok.decode(x.tolist()) for x in self.ids]
        sig = self.signer.sign(texts)
        out = [(tag, sig.exact[i], sig.bands[i], sig.sketch[i], bool(sig.has_words[i]))
               for i, tag in enumerate(self.tags)]
        self.ids, self.tags = [], []
        return out


def contamination(dataset_dir: str, m: Manifest, tok: Tokenizer) -> Contamination:
    """The module docstring's check of one dataset (a Manifest and its Tokenizer, already opened)."""
    d = m.dedup or {}
    params = DedupParams(d["threshold"], d["ngram"]) if d.get("mode") == "near" else DedupParams()
    signer = Signer(params)
    report = Contamination(val_rows=m.rows("val"), params=params)
    # pass 1: the documents with validation rows (by their place in the stream), their exact hashes and band keys
    exact: dict[tuple[int, int], list[int]] = {}
    bands: dict[int, list[int]] = {}
    place: list[int] = []
    sketches: list[np.ndarray] = []
    val_rows: list[set[int]] = []
    hit: list[str] = []
    batch = _Batch(tok, signer)

    def index(signed: list) -> None:
        for (doc, rows), ex, bk, sk, words in signed:
            i = len(val_rows)
            place.append(doc)
            val_rows.append(rows)
            sketches.append(sk)
            hit.append("")
            exact.setdefault((int(ex[0]), int(ex[1])), []).append(i)
            if words:
                for key in bk.tolist():
                    bands.setdefault(key, []).append(i)

    for doc, (ids, v, t) in enumerate(_documents(dataset_dir, m)):
        if not v:
            continue
        report.val_documents += 1
        if t:
            report.documents["continued"] += 1
            report.rows["continued"] |= v
        index(batch.add(ids, (doc, set(v))))
    index(batch.flush())
    if not val_rows:
        return report

    # pass 2: every document with training rows against that index (not against itself)
    def check(signed: list) -> None:
        for doc, ex, bk, sk, words in signed:
            for i in exact.get((int(ex[0]), int(ex[1])), []):
                if place[i] != doc:
                    hit[i] = "exact"
            if not words:
                continue
            for i in {i for key in bk.tolist() for i in bands.get(key, []) if not hit[i] and place[i] != doc}:
                if estimate_jaccard(sketches[i], sk) >= params.threshold:
                    hit[i] = "near"

    for doc, (ids, v, t) in enumerate(_documents(dataset_dir, m)):
        if t:
            check(batch.add(ids, doc))
    check(batch.flush())
    for i, kind in enumerate(hit):
        if kind:
            report.documents[kind] += 1
            report.rows[kind] |= val_rows[i]
    return report
