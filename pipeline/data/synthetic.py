"""Synthetic packed rows for tests and for benchmarks on hosts with no corpus.

Each global sequence id maps to the same tokens and document boundaries every time (a generator
seeded by (seed, seq_id)), and batches follow the same cursor rules as the shard reader: from
global sequence `start`, micro-batches of batch_size x world_size sequences, rank r taking the r-th
slice. So a synthetic run resumes exactly, like a real one.

Document lengths (what document masking and the executed-FLOP count depend on) follow a distribution
named by a spec string (`parse_doc_lengths`, the benchmarks' --doc-len):

    web                       log-normal, median 400 tokens, sigma 1.05 (mean ~694): web text (the default
                              for benchmarks; see WEB_DOC_LENGTHS for why)
    8192                      geometric with this mean (a plain number; seq_len // 4 is what rows had before)
    lognormal:MEDIAN:SIGMA    log-normal with this median (tokens) and spread (sigma of the log)
    manifest:PATH             log-normal fitted to the doc_length statistics `prepare` wrote into PATH
                              (a manifest.json or the dataset directory holding it)

Rows are windows of an endless stream of documents, as packing cuts them: the first document of a row is the
tail of one that began before it (drawn from the length-biased distribution, as a window falls on long
documents more often), and a document longer than the row spans it with no boundary.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

EOS_ID = 3  # the shard tokenizer's fixed EOS id (pipeline/data/tokenizer.py)
Z90 = 1.2815515655446004  # the standard normal's 90th percentile


class DocLengthsError(ValueError):
    """A document-length spec that cannot be parsed or fitted; the message names the spec and the forms."""


@dataclass(frozen=True)
class DocLengths:
    """A document-length distribution in tokens (EOS included): kind "geometric" (mean) or "lognormal"
    (median, sigma of the log). `label` is the spec it came from, for tables and result files."""
    kind: str
    label: str
    mean: float = 0.0
    median: float = 0.0
    sigma: float = 0.0

    @property
    def mean_tokens(self) -> float:
        return self.mean if self.kind == "geometric" else self.median * math.exp(self.sigma ** 2 / 2)

    def describe(self) -> str:
        if self.kind == "geometric":
            return f"{self.label}: geometric, mean {self.mean:,.0f} tokens"
        return (f"{self.label}: log-normal, median {self.median:,.0f}, sigma {self.sigma:.2f}, "
                f"mean {self.mean_tokens:,.0f} tokens")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n document lengths, int64 >= 1."""
        if self.kind == "geometric":
            return rng.geometric(1.0 / self.mean, size=n).astype(np.int64)
        return np.maximum(1, np.rint(rng.lognormal(math.log(self.median), self.sigma, size=n))).astype(np.int64)

    def first_remainder(self, rng: np.random.Generator) -> int:
        """Tokens left of the document a row starts in (a stationary stream's residual length, >= 1)."""
        if self.kind == "geometric":
            return int(rng.geometric(1.0 / self.mean))  # memoryless: the residual is geometric too
        # the length-biased log-normal is log-normal with mu + sigma^2; the row starts uniformly inside it
        biased = rng.lognormal(math.log(self.median) + self.sigma ** 2, self.sigma)
        return max(1, int(math.ceil(rng.uniform() * biased)))


# Web text: FineWeb averages about 700 GPT-2 tokens per document (ServiceNow/fineweb-sample: 200k documents,
# ~140M tokens; the FineWeb card: ~18.5T tokens in ~25B documents), with a long right tail. A log-normal with
# median 400 and sigma 1.05 has that mean (~694) with p90 ~1,540 and p99 ~4,600 tokens: a few hundred to a few
# thousand tokens per document, so a 32k row holds ~48 documents and within-document pairs are ~6% of the
# row's causal pairs (geometric rows with mean seq_len / 4 keep ~36%).
WEB_DOC_LENGTHS = DocLengths("lognormal", "web", median=400.0, sigma=1.05)


def doc_lengths_from_manifest(path: str | Path, label: str | None = None) -> DocLengths:
    """A log-normal fitted to a manifest's doc_length statistics: sigma from p90/p50 (both histogram upper
    edges, so their bias mostly cancels), the median then set so that the mean is the recorded (exact) mean."""
    p = Path(path)
    p = p / "manifest.json" if p.is_dir() else p
    try:
        stats = json.loads(p.read_text())["doc_length"]
        mean, p50, p90 = float(stats["mean"]), float(stats["p50_approx"]), float(stats["p90_approx"])
    except FileNotFoundError:
        raise DocLengthsError(f"--doc-len manifest:{path}: no manifest at {p}; pass a dataset directory "
                              "written by `python pipeline/run.py prepare` or its manifest.json") from None
    except (KeyError, TypeError, ValueError):
        raise DocLengthsError(f"--doc-len manifest:{path}: {p} has no doc_length mean/p50_approx/p90_approx "
                              "statistics; re-run prepare with this version, or give lognormal:MEDIAN:SIGMA") from None
    if mean < 1 or p50 < 1:
        raise DocLengthsError(f"--doc-len manifest:{path}: the manifest records no documents (mean {mean})")
    sigma = max(0.05, math.log(max(p90, p50) / p50) / Z90)
    median = mean / math.exp(sigma ** 2 / 2)
    return DocLengths("lognormal", label or f"manifest:{p.parent.name}", median=median, sigma=sigma)


def parse_doc_lengths(spec: str | DocLengths) -> DocLengths:
    """A DocLengths from a spec string (see the module docstring); a DocLengths passes through."""
    if isinstance(spec, DocLengths):
        return spec
    spec = str(spec).strip()
    forms = "web, a mean such as 8192, lognormal:MEDIAN:SIGMA, or manifest:PATH"
    if spec == "web":
        return WEB_DOC_LENGTHS
    if spec.startswith("manifest:"):
        return doc_lengths_from_manifest(spec[len("manifest:"):], label=spec)
    try:
        if spec.startswith("lognormal:"):
            median, sigma = (float(x) for x in spec[len("lognormal:"):].split(":"))
            if not (median >= 1 and 0 < sigma <= 4):
                raise ValueError
            return DocLengths("lognormal", spec, median=median, sigma=sigma)
        mean = float(spec)
        if not mean >= 1:
            raise ValueError
        return DocLengths("geometric", spec, mean=mean)
    except ValueError:
        raise DocLengthsError(f"--doc-len {spec!r} is not a document-length distribution; give {forms} "
                              "(lengths in tokens >= 1, 0 < sigma <= 4)") from None


def _doc_boundaries(rng: np.random.Generator, width: int, doc_lengths: DocLengths) -> np.ndarray:
    """Positions p in [1, width) where a document starts (the token at p - 1 is its predecessor's EOS)."""
    first = doc_lengths.first_remainder(rng)
    if first >= width:
        return np.zeros(0, np.int64)
    n = max(16, int(2 * width / doc_lengths.mean_tokens) + 16)
    ends = [np.array([first])]
    total = first
    while total < width:  # draw in blocks until the row is covered
        block = doc_lengths.sample(rng, n)
        ends.append(total + np.cumsum(block))
        total = int(ends[-1][-1])
    starts = np.concatenate(ends)
    return starts[starts < width]


def synthetic_row(seq_id: int, seq_len: int, vocab_size: int, seed: int = 0,
                  mean_doc_len: int = 0, doc_lengths: str | DocLengths | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (seq_len+1,) int64, doc_ids (seq_len+1,) int32) for one packed row.

    Without doc_lengths, documents have geometric lengths with mean `mean_doc_len` (default seq_len // 4) and
    end in EOS (the rows every test was written against). With doc_lengths (a DocLengths or a spec string),
    boundaries follow that distribution as a window of a document stream.
    """
    rng = np.random.default_rng([seed, seq_id])
    tokens = rng.integers(4, vocab_size, size=seq_len + 1, dtype=np.int64)
    doc_ids = np.zeros(seq_len + 1, dtype=np.int32)
    if doc_lengths is not None:
        starts = _doc_boundaries(rng, seq_len + 1, parse_doc_lengths(doc_lengths))
        tokens[starts - 1] = EOS_ID
        doc_ids[starts] = 1
        np.cumsum(doc_ids, out=doc_ids)
        return tokens, doc_ids
    mean = mean_doc_len or max(2, seq_len // 4)
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
                      epoch: int = 0, start: int = 0, rank: int = 0, world_size: int = 1,
                      doc_lengths: str | DocLengths | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Batch dicts (tokens (B, T+1) int64, doc_ids (B, T+1) int32, seq_id (B,) int64) over a seeded
    permutation of `n_sequences` ids for `epoch`; the last incomplete global micro-batch is dropped.
    doc_lengths: see synthetic_row."""
    doc_lengths = None if doc_lengths is None else parse_doc_lengths(doc_lengths)
    order = np.random.default_rng([seed, epoch]).permutation(n_sequences)
    global_b = batch_size * world_size
    for lo in range(start, n_sequences - global_b + 1, global_b):
        ids = order[lo + rank * batch_size: lo + (rank + 1) * batch_size]
        rows = [synthetic_row(int(i), seq_len, vocab_size, seed, doc_lengths=doc_lengths) for i in ids]
        yield {"tokens": torch.from_numpy(np.stack([r[0] for r in rows])),
               "doc_ids": torch.from_numpy(np.stack([r[1] for r in rows])),
               "seq_id": torch.from_numpy(ids.astype(np.int64))}


def write_synthetic_dataset(dataset_dir, *, n_train: int, n_val: int, seq_len: int, vocab_size: int,
                            seed: int = 0, rows_per_shard: int = 256, doc_lengths: str | DocLengths | None = None):
    """A real dataset directory (Parquet shards + manifest, same schema as `prepare`) of synthetic rows,
    written with pyarrow alone: benchmarks on hosts without Ray or a corpus read it with ShardReader,
    so their data path is the real one. doc_lengths: see synthetic_row. Returns the Manifest."""
    from pipeline.data.shards import (SCHEMA_VERSION, Manifest, rows_per_row_group, shard_schema, windows_table,
                                      write_manifest, write_shard)

    doc_lengths = None if doc_lengths is None else parse_doc_lengths(doc_lengths)

    out = Path(dataset_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = shard_schema(seq_len, vocab_size)
    shards: dict = {}
    seq_id = 0
    for split, n in (("train", n_train), ("val", n_val)):
        shards[split] = []
        for k, lo in enumerate(range(0, n, rows_per_shard)):
            ids = np.arange(seq_id + lo, seq_id + min(n, lo + rows_per_shard))
            windows = np.stack([synthetic_row(int(i), seq_len, vocab_size, seed, doc_lengths=doc_lengths)[0]
                                for i in ids])
            group = rows_per_row_group(seq_len, vocab_size)  # row groups as prepare writes them (~1 MiB)
            tables = [windows_table(windows[g:g + group], ids[g:g + group], EOS_ID, vocab_size)
                      for g in range(0, len(ids), group)]
            shards[split].append(write_shard(out / f"{split}-{k:05d}.parquet", tables, schema))
        seq_id += n
    tokens = (n_train + n_val) * (seq_len + 1)
    source = {"kind": "synthetic", "seed": seed}
    settings_hash = f"synthetic-{seed}-{seq_len}-{vocab_size}-{n_train}-{n_val}"
    if doc_lengths is not None:
        source["doc_lengths"] = doc_lengths.describe()
        settings_hash += f"-{doc_lengths.describe()}"
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, seq_len=seq_len, vocab_size=vocab_size, pad_id=0, unk_id=1, bos_id=2,
        eos_id=EOS_ID, token_type="uint16" if vocab_size <= 65535 else "int32", tokenizer_file="",
        tokenizer_sha256="synthetic", settings_hash=settings_hash, source=source,
        settings={"seq_len": seq_len, "vocab_size": vocab_size},
        counts={"documents": 0, "tokens_total": tokens, "tokens_kept": tokens}, packing_efficiency=1.0,
        remainder_policy="synthetic rows: nothing dropped", doc_length={}, shards=shards)
    write_manifest(out, manifest)
    return manifest


def counting_row(seq_id: int, seq_len: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """(seq_len+1,) int64: a learnable row, tokens counting up by a stride of 1 to 3 from a seeded start (wrapping
    within [4, vocab_size)), one document. A small model learns it in tens of steps, so a row that breaks the
    pattern stands out in the loss."""
    rng = np.random.default_rng([seed, seq_id, 1])
    start, stride = int(rng.integers(0, vocab_size - 4)), int(rng.integers(1, 4))
    return 4 + (start + stride * np.arange(seq_len + 1, dtype=np.int64)) % (vocab_size - 4)


def write_spiky_dataset(dataset_dir, *, n_train: int, n_val: int, seq_len: int, vocab_size: int, order_seed: int,
                        bad: list[tuple[int, int]] = (), rows_per_shard: int = 256):
    """A dataset of learnable rows (counting_row) in which the rows at the positions [start, end) of each window in
    `bad` of epoch 0's training order (pipeline/data/shards.py epoch_order with `order_seed`, the run's train.seed)
    are one token repeated: windows of data that send the loss and the gradient norm up when a trained model meets
    them, as a loss spike's test needs. The validation split is all learnable rows. Returns (Manifest, the seq_ids of
    the bad rows)."""
    from pipeline.data.shards import (SCHEMA_VERSION, Manifest, epoch_order, rows_per_row_group, shard_schema,
                                      windows_table, write_manifest, write_shard)

    out = Path(dataset_dir)
    out.mkdir(parents=True, exist_ok=True)
    order = epoch_order(n_train, order_seed, 0)
    bad_ids = {int(i) for start, end in bad for i in order[start:end]}
    schema = shard_schema(seq_len, vocab_size)
    shards: dict = {}
    for split, first, n in (("train", 0, n_train), ("val", n_train, n_val)):
        shards[split] = []
        for k, lo in enumerate(range(0, n, rows_per_shard)):
            ids = np.arange(first + lo, first + min(n, lo + rows_per_shard))
            windows = np.stack([np.full(seq_len + 1, 5, np.int64) if int(i) in bad_ids
                                else counting_row(int(i), seq_len, vocab_size) for i in ids])
            group = rows_per_row_group(seq_len, vocab_size)
            tables = [windows_table(windows[g:g + group], ids[g:g + group], EOS_ID, vocab_size)
                      for g in range(0, len(ids), group)]
            shards[split].append(write_shard(out / f"{split}-{k:05d}.parquet", tables, schema))
    tokens = (n_train + n_val) * (seq_len + 1)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, seq_len=seq_len, vocab_size=vocab_size, pad_id=0, unk_id=1, bos_id=2,
        eos_id=EOS_ID, token_type="uint16" if vocab_size <= 65535 else "int32", tokenizer_file="",
        tokenizer_sha256="synthetic", settings_hash=f"spiky-{seq_len}-{vocab_size}-{n_train}-{n_val}-{list(bad)}",
        source={"kind": "synthetic", "pattern": "counting", "bad_positions": [list(w) for w in bad]},
        settings={"seq_len": seq_len, "vocab_size": vocab_size},
        counts={"documents": 0, "tokens_total": tokens, "tokens_kept": tokens}, packing_efficiency=1.0,
        remainder_policy="synthetic rows: nothing dropped", doc_length={}, shards=shards)
    write_manifest(out, manifest)
    return manifest, sorted(bad_ids)
