"""Packed token shards: the manifest, the Parquet schema and writer, and the two readers for training.

A dataset directory (a local path or a URI: s3://bucket/datasets/<hash>) holds `manifest.json` and the
files it names: `train-00000.parquet`, `val-00000.parquet`, ... (one row per packed sequence) and the
`tokenizer.model` they were built with, inside the build directory that wrote them (`build-<id>/`, see
pipeline/data/pack.py). The manifest is written last, in one piece: no manifest, no dataset; readers open
only the files it names. Row schema (any Arrow tool reads it: pyarrow, pandas, `datasets.load_dataset("parquet")`):

    tokens      fixed_size_list<uint16>[seq_len + 1]   (int32 when vocab_size > 65,535)
    doc_starts  list<int32>   offsets i > 0 where a document begins inside the row; tokens[i-1] is EOS there
    seq_id      int64         global sequence id, dense over train + val: the row's window index in the stream

Readers (same batches, same order, for the same arguments):

    reader = ShardReader(dataset_dir, "train", batch_size=8, seed=0, epoch=0, start=0, rank=0, world_size=1)
    for batch in reader: ...   # {"tokens": int64 (B, T+1), "doc_ids": int32 (B, T+1), "seq_id": int64 (B,)}
    for batch in eval_reader(dataset_dir, batch_size=8): ...   # every val row once; + "pad": bool (B,)
    ray_batches(dataset_dir, "train", 8, 0, 0, 0, 0, 1).iter_torch_batches(batch_size=8)   # Ray Data

Order: a permutation of the split's rows drawn by numpy from (seed, epoch). From position `start`, the stream
is cut into global micro-batches of batch_size * world_size consecutive sequences; rank r takes the r-th
slice of batch_size. For training the last incomplete global micro-batch of an epoch is dropped, so every rank
yields the same number of batches. Evaluation (`eval_reader`, drop_last=False) keeps it: every row of the split
is read once across the ranks, and a rank whose slice of that last batch is short (or empty) fills it up to
batch_size with copies of a real row flagged in `pad` (bool (B,)), which the loss does not count; so every rank
runs the same number of forwards of the same shape (no recompile, no collective left waiting under FSDP).
`reader.position` is the global cursor after what was yielded: pass it as `start` to resume exactly there. This module imports only pyarrow and numpy at load time (torch when iterating, Ray
only inside `ray_batches`), so the Ray-free engine can use it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import storage_faults as faults
from pipeline.storage import (StorageError, absolute, basename, explain, explained, join, open_input, open_output,
                              read_bytes, write_bytes)

if TYPE_CHECKING:
    import ray.data

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.model"
SPLITS = ("train", "val")
_ROW_GROUP_BYTES = 1 << 20  # ~1 MiB of tokens per row group: a random row costs at most that to decode


class DatasetError(ValueError):
    """A dataset directory is missing, corrupt or incompatible; the message names the file and the fix."""


# ----------------------------------------------------------------------------------------------
# Manifest

@dataclass
class ShardInfo:
    file: str  # name inside the dataset directory
    rows: int
    sha256: str


@dataclass
class Manifest:
    schema_version: int
    seq_len: int  # tokens per training row; shard rows hold seq_len + 1
    vocab_size: int
    pad_id: int
    unk_id: int
    bos_id: int
    eos_id: int
    token_type: str  # uint16 | int32
    tokenizer_file: str
    tokenizer_sha256: str
    settings_hash: str  # cache key: source + tokenizer + settings
    source: dict[str, Any]
    settings: dict[str, Any]
    counts: dict[str, int]  # documents, dropped_empty, replaced_invalid_utf8, tokens_total, tokens_kept, ...
    packing_efficiency: float  # tokens_kept / tokens_total (no padding; only the final partial window is lost)
    remainder_policy: str
    doc_length: dict[str, Any]  # token lengths of documents: count, mean, min, max, approximate quantiles
    shards: dict[str, list[ShardInfo]]  # split -> shards in order
    created: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # data.on_bad_record=skip: file -> {"count": unreadable records skipped, "first": the first one's reason}
    bad_records: dict[str, dict[str, Any]] = field(default_factory=dict)
    # data.dedup: settings, documents read, removed as exact and near copies, clusters, documents shared with the
    # other sources of its mixture (pipeline/data/dedup.py DedupResult.record); {} when made without deduplication
    dedup: dict[str, Any] = field(default_factory=dict)

    @property
    def window(self) -> int:
        return self.seq_len + 1

    def rows(self, split: str) -> int:
        return sum(s.rows for s in self.shards.get(split, []))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise KeyError(", ".join(missing))
        kw = {k: v for k, v in d.items() if k in names}
        kw["shards"] = {split: [ShardInfo(**s) for s in lst] for split, lst in d["shards"].items()}
        return cls(**kw)


def load_manifest(dataset_dir: Path | str) -> Manifest:
    """The dataset's manifest (a local directory or a URI); DatasetError when it is missing (no manifest, no
    dataset) or unreadable, StorageError when the storage cannot be reached."""
    location = join(str(dataset_dir), MANIFEST_FILE)
    try:
        text = read_bytes(location)
    except (FileNotFoundError, NotADirectoryError):
        raise DatasetError(f"{str(dataset_dir)!r} is not a prepared dataset: {MANIFEST_FILE} is missing (a build "
                           "that did not finish leaves none); run `python pipeline/run.py prepare` to build it") from None
    try:
        m = Manifest.from_dict(json.loads(text))
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{location!r} is corrupt ({type(exc).__name__}: {exc}); delete the dataset "
                           "directory and run prepare again") from None
    if m.schema_version != SCHEMA_VERSION:
        raise DatasetError(f"{location!r} has schema_version {m.schema_version}; this code reads "
                           f"{SCHEMA_VERSION}: prepare the dataset again")
    return m


def write_manifest(dataset_dir: Path | str, manifest: Manifest) -> str:
    """Write manifest.json in one piece (a temp file renamed locally, one PUT on object storage), so readers see
    all of it or none of it. Returns its location."""
    location = join(str(dataset_dir), MANIFEST_FILE)
    write_bytes(location, (json.dumps(manifest.to_dict(), indent=2, sort_keys=True) + "\n").encode())
    return location


def tokenizer_location(dataset_dir: Path | str, manifest: Manifest | None = None) -> str:
    """Where the dataset's tokenizer is (the file its manifest names); DatasetError when it names none. `manifest`:
    the dataset's, when the caller has read it already."""
    m = manifest if manifest is not None else load_manifest(dataset_dir)
    if not m.tokenizer_file:
        raise DatasetError(f"dataset {str(dataset_dir)!r} has no tokenizer (a synthetic dataset); use a prepared one")
    return join(str(dataset_dir), m.tokenizer_file)


class TokenizerMissing(DatasetError):
    """The dataset, or the tokenizer its manifest names, is not there (a checkpoint that names it may be whole)."""


def dataset_tokenizer(dataset_dir: Path | str, checkpoint: Any = None, manifest: Manifest | None = None):
    """The Tokenizer the dataset was built with (the file its manifest names; local or on object storage), checked:
    TokenizerMissing when the dataset or the file is not there, DatasetError naming the file when it is not a
    SentencePiece model, and whether its sha256 is the one the manifest records. `checkpoint`: the checkpoint whose
    meta.json names the dataset, for the lines (every checkpoint of a run reads the same tokenizer, so no other
    checkpoint is offered). `manifest`: the dataset's, when the caller has read it already."""
    from pipeline.data.tokenizer import Tokenizer, TokenizerError
    from pipeline.storage import first_line, sha256

    try:
        path = tokenizer_location(dataset_dir, manifest)
    except (DatasetError, FileNotFoundError) as exc:
        if checkpoint is None:
            raise TokenizerMissing(str(exc)) from None
        raise TokenizerMissing(f"tokenizer for checkpoint {checkpoint} not found ({exc}); the checkpoint names its "
                               "dataset, which must still exist") from None
    try:
        return Tokenizer(path)
    except TokenizerError as exc:
        try:  # only on failure, and only when no manifest was handed in: a second read of it, for the one line
            recorded = (manifest if manifest is not None else load_manifest(dataset_dir)).tokenizer_sha256
            sha = "; its sha256 is not the one the manifest records" if recorded and sha256(path) != recorded else ""
        except (FileNotFoundError, DatasetError):
            sha = ""
        if checkpoint is not None:
            whose = f"the dataset's, which checkpoint {checkpoint} names"
            readers = "; every checkpoint of the run reads it:"
        else:
            whose, readers = f"dataset {str(dataset_dir)!r}'s", ";"
        raise DatasetError(f"tokenizer model {path} ({whose}) is broken: {first_line(exc)}{sha}{readers} restore it "
                           f"from a copy of the dataset or prepare the dataset again; check it with `python "
                           f"pipeline/run.py validate {dataset_dir}`") from None


def check_compatible(manifest: Manifest, vocab_size: int | None = None, seq_len: int | None = None,
                     tokenizer_sha256: str | None = None) -> None:
    """Raise DatasetError naming the first setting that does not match the dataset."""
    if seq_len is not None and seq_len != manifest.seq_len:
        raise DatasetError(f"dataset has seq_len={manifest.seq_len} but data.seq_len={seq_len}; set "
                           f"--data.seq_len={manifest.seq_len} or prepare a dataset for {seq_len}")
    if vocab_size is not None and vocab_size != manifest.vocab_size:
        raise DatasetError(f"dataset has vocab_size={manifest.vocab_size} but {vocab_size} was expected; set "
                           f"--data.vocab_size={manifest.vocab_size} or prepare the dataset again")
    if tokenizer_sha256 is not None and tokenizer_sha256 != manifest.tokenizer_sha256:
        raise DatasetError(f"tokenizer sha256 {tokenizer_sha256[:12]}... does not match the dataset's "
                           f"{manifest.tokenizer_sha256[:12]}...: the shards were tokenized with another "
                           "tokenizer; use the dataset's tokenizer.model or prepare the dataset again")


# ----------------------------------------------------------------------------------------------
# Schema and writing

def token_numpy_type(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.int32)


def shard_schema(seq_len: int, vocab_size: int) -> pa.Schema:
    tok = pa.uint16() if vocab_size <= 65535 else pa.int32()
    return pa.schema([("tokens", pa.list_(tok, seq_len + 1)), ("doc_starts", pa.list_(pa.int32())),
                      ("seq_id", pa.int64())])


def rows_per_row_group(seq_len: int, vocab_size: int) -> int:
    return max(1, _ROW_GROUP_BYTES // ((seq_len + 1) * token_numpy_type(vocab_size).itemsize))


def windows_table(windows: np.ndarray, seq_ids: np.ndarray, eos_id: int, vocab_size: int) -> pa.Table:
    """Rows for packed windows (R, T+1); doc_starts are the positions right after each EOS (never 0)."""
    n, width = windows.shape
    rows, cols = np.nonzero(windows[:, :-1] == eos_id)  # EOS at column c -> a document starts at c + 1
    counts = np.bincount(rows, minlength=n)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    schema = shard_schema(width - 1, vocab_size)
    flat = pa.array(np.ascontiguousarray(windows, token_numpy_type(vocab_size)).reshape(-1))
    tokens = pa.FixedSizeListArray.from_arrays(flat, width)
    starts = pa.ListArray.from_arrays(pa.array(offsets), pa.array((cols + 1).astype(np.int32)))
    return pa.Table.from_arrays([tokens, starts, pa.array(np.asarray(seq_ids, np.int64))], schema=schema)


class _HashingSink(io.RawIOBase):
    """A writable stream that hashes what passes through it into a pyarrow output stream."""

    def __init__(self, out: Any):
        self.out, self.hash = out, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b)
        self.hash.update(view)
        self.out.write(view)
        return view.nbytes


def write_shard(path: Path | str, tables: Iterable[pa.Table], schema: pa.Schema) -> ShardInfo:
    """Write row groups to `path` (zstd, page checksums; a local path or a URI) and return its rows and sha256,
    hashed while it is written (no second read of an object). Never overwritten in place: the builder writes
    each build under a name of its own (pipeline/data/pack.py), so a half-written shard is simply unreferenced."""
    rows = 0
    with explained(str(path)):  # a failed upload (at a part or at close) is a StorageError naming the shard
        with open_output(str(path)) as out:
            sink = _HashingSink(out)
            with pq.ParquetWriter(sink, schema, compression="zstd", use_dictionary=False,
                                  write_statistics=["seq_id"], write_page_checksum=True) as writer:
                for t in tables:
                    writer.write_table(t, row_group_size=max(1, t.num_rows))
                    rows += t.num_rows
    return ShardInfo(file=basename(str(path)), rows=rows, sha256=sink.hash.hexdigest())


# ----------------------------------------------------------------------------------------------
# Reading

def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The split's rows in the order they are consumed in `epoch`: a numpy permutation seeded by (seed, epoch)."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_rows)


def doc_ids_from_starts(lengths: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """doc_ids (R, width) int32 from per-row doc_starts (lengths (R,), flat values): 0-based, non-decreasing."""
    n = len(lengths)
    ids = np.zeros((n, width), np.int32)
    ids[np.repeat(np.arange(n), lengths), starts] = 1
    np.cumsum(ids, axis=1, out=ids)
    return ids


class _RowGroup:
    __slots__ = ("tokens", "lengths", "starts", "start_offsets", "seq_id", "nbytes")

    def __init__(self, table: pa.Table, width: int):
        self.tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, width)  # (n, T+1)
        ds = table.column("doc_starts").combine_chunks()
        self.lengths = pc.list_value_length(ds).fill_null(0).to_numpy().astype(np.int64)
        self.starts = pc.list_flatten(ds).to_numpy().astype(np.int64)
        self.start_offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.seq_id = table.column("seq_id").to_numpy()
        self.nbytes = self.tokens.nbytes + self.starts.nbytes + self.seq_id.nbytes


READ_THREADS = 8  # row groups of different shards fetched at once: on object storage each one is a ranged GET


@functools.lru_cache(maxsize=1)
def _read_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="shard-read")


class ShardReader:
    """Ray-free batches from one split of a dataset (see the module docstring for the order contract).

    `dataset_dir` is a local directory or a URI (s3://bucket/datasets/<hash>; pipeline/storage.py). Reads
    lazily: a shard's Parquet footer when the shard is first touched, then ~1 MiB row groups on demand, the
    ones a batch needs from different shards fetched concurrently (READ_THREADS; one ranged GET each on object
    storage), kept in a small LRU cache (cache_bytes). Memory does not grow with the dataset and nothing is
    downloaded whole: a reader fetches only the row groups holding its own rows.
    """

    def __init__(self, dataset_dir: Path | str, split: str = "train", batch_size: int = 8, seed: int = 0,
                 epoch: int = 0, start: int = 0, rank: int = 0, world_size: int = 1, *,
                 cache_bytes: int = 128 << 20, drop_last: bool = True, retry_s: float | None = None,
                 manifest: Manifest | None = None):
        # manifest: the dataset's, when the caller has read it already (one read per command, not one per reader)
        self.dataset_dir = absolute(dataset_dir)
        # Storage failures that pass (outage, stall, 5xx) are ridden out this long, in the reader's own threads too;
        # None: the window of the thread that makes the reader (pipeline/storage_faults.py).
        self.retry_s = faults.retry_window() if retry_s is None else retry_s
        if manifest is not None:
            self.manifest = manifest
        else:
            with faults.retry_window_of(self.retry_s):
                self.manifest = load_manifest(self.dataset_dir)
        if (self.manifest.source or {}).get("kind") == "mixture":
            raise DatasetError(f"{str(dataset_dir)!r} is a mixture of datasets (no shards of its own); read it with "
                               "pipeline/data/mixture.py's MixtureReader, or one of its sources' datasets")
        if split not in self.manifest.shards:
            raise DatasetError(f"dataset {str(dataset_dir)!r} has no split {split!r}; splits: "
                               f"{', '.join(self.manifest.shards)}")
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.split, self.batch_size, self.seed, self.epoch = split, batch_size, seed, epoch
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.width = self.manifest.window
        self._shards = self.manifest.shards[split]
        self._file_start = np.concatenate([[0], np.cumsum([s.rows for s in self._shards])]).astype(np.int64)
        self.num_rows = int(self._file_start[-1])
        self.global_batch = batch_size * world_size
        self.sequences_per_epoch = self.num_rows // self.global_batch * self.global_batch
        if self.num_rows == 0 or (drop_last and self.num_rows < self.global_batch):
            raise DatasetError(f"split {split!r} of {str(dataset_dir)!r} has {self.num_rows} sequences, fewer than "
                               f"one global batch ({batch_size} x {world_size} ranks); lower train.batch_size or "
                               "prepare more data (or a larger data.val_fraction for val)")
        if not 0 <= start <= self.num_rows:
            raise ValueError(f"start={start} is outside the split's {self.num_rows} sequences")
        self.position = int(start)
        self._order = epoch_order(self.num_rows, seed, epoch)
        self._files: dict[int, tuple[pq.ParquetFile, np.ndarray]] = {}
        self._cache: OrderedDict[tuple[int, int], _RowGroup] = OrderedDict()
        self._cache_bytes, self._cached = cache_bytes, 0
        self._start = int(start)

    def __len__(self) -> int:
        """Batches remaining from the current position."""
        if self.drop_last:
            return (self.num_rows - self.position) // self.global_batch
        return -(-(self.num_rows - self.position) // self.global_batch)

    def rows_of_batch(self, j: int, start: int | None = None) -> np.ndarray:
        """This rank's split rows for the j-th batch counted from `start` (default: the constructor's)."""
        p = (self._start if start is None else start) + j * self.global_batch + self.rank * self.batch_size
        return self._order[p:p + self.batch_size]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        while self.position + (self.global_batch if self.drop_last else 1) <= self.num_rows:
            first = self.position + self.rank * self.batch_size
            rows = self._order[first:min(first + self.batch_size, self.num_rows)]
            pad = np.zeros(self.batch_size, bool)
            if len(rows) < self.batch_size:  # only without drop_last: the split's last, short global batch
                pad[len(rows):] = True  # filled with its first row, which every rank can read
                rows = np.concatenate([rows, np.full(self.batch_size - len(rows), self._order[self.position])])
            batch = self.read_rows(rows)
            self.position = min(self.position + self.global_batch, self.num_rows)
            out = {"tokens": torch.from_numpy(batch["tokens"]), "doc_ids": torch.from_numpy(batch["doc_ids"]),
                   "seq_id": torch.from_numpy(batch["seq_id"])}
            if not self.drop_last:
                out["pad"] = torch.from_numpy(pad)
            yield out

    def read_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Numpy batch for split rows (in the given order): tokens int64 (B, T+1), doc_ids int32, seq_id int64."""
        rows = np.asarray(rows, np.int64)
        file_idx = np.searchsorted(self._file_start, rows, side="right") - 1
        local = rows - self._file_start[file_idx]
        located = self._locate(file_idx.tolist(), local.tolist())
        tokens = np.empty((len(rows), self.width), np.int64)
        seq_id = np.empty(len(rows), np.int64)
        lengths = np.empty(len(rows), np.int64)
        starts: list[np.ndarray] = []
        for i, (group, k) in enumerate(located):
            tokens[i] = group.tokens[k]
            seq_id[i] = group.seq_id[k]
            s = group.starts[group.start_offsets[k]:group.start_offsets[k + 1]]
            lengths[i] = len(s)
            starts.append(s)
        flat = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        return {"tokens": tokens, "doc_ids": doc_ids_from_starts(lengths, flat, self.width), "seq_id": seq_id}

    def _locate(self, files: list[int], local_rows: list[int]) -> list[tuple[_RowGroup, int]]:
        """(row group, row inside it) for each (shard, row), fetching what the cache lacks: each shard's groups
        in one thread (a ParquetFile is not shared between threads), different shards at once."""
        self._run_per_file({f: [f] for f in set(files) if f not in self._files}, lambda f, _: self._open(f))
        where = []
        for f, r in zip(files, local_rows):
            group_start = self._files[f][1]
            g = int(np.searchsorted(group_start, r, side="right") - 1)
            where.append(((f, g), r - int(group_start[g])))
        fetched: dict[tuple[int, int], _RowGroup] = {}
        missing: dict[int, list[int]] = {}
        for key, _ in where:
            if key in self._cache:
                fetched[key] = self._cache[key]
                self._cache.move_to_end(key)
            elif key[1] not in missing.setdefault(key[0], []):
                missing[key[0]].append(key[1])
        missing = {f: gs for f, gs in missing.items() if gs}
        for (f, g), group in self._run_per_file(missing, self._read_group):
            fetched[(f, g)] = group
            self._cache[(f, g)] = group
            self._cached += group.nbytes
        while self._cached > self._cache_bytes and len(self._cache) > 1:  # this batch's groups are held above
            self._cached -= self._cache.popitem(last=False)[1].nbytes
        return [(fetched[key], k) for key, k in where]

    @staticmethod
    def _run_per_file(work: dict[int, list[int]], fn) -> list:
        """[((f, item), fn(f, item)) ...] for every item of every file; files in parallel when more than one."""
        def run(f: int) -> list:
            return [((f, item), fn(f, item)) for item in work[f]]

        if len(work) <= 1:
            return [r for f in work for r in run(f)]
        return [r for part in _read_pool().map(run, list(work)) for r in part]

    def _storage(self, location: str, fn, corrupt):
        """fn() with this reader's retry window: a storage failure that passes is retried, one that does not (or
        outlasts the window) is a StorageError naming the endpoint; any other error is the data's: corrupt(exc)."""
        with faults.retry_window_of(self.retry_s):
            try:
                return faults.call(fn)
            except StorageError:
                raise
            except (OSError, pa.ArrowException) as exc:
                if faults.kind(exc):
                    raise explain(exc, location) from None
                raise corrupt(exc) from None

    def _open(self, f: int) -> None:
        path = join(self.dataset_dir, self._shards[f].file)
        pf = self._storage(path, lambda: pq.ParquetFile(open_input(path), pre_buffer=True,
                                                        page_checksum_verification=True),
                           lambda exc: DatasetError(f"shard {path!r} cannot be opened ({str(exc).splitlines()[0]}); "
                                                    "run `python pipeline/run.py validate` and prepare the dataset "
                                                    "again"))
        md = pf.metadata
        if md.num_rows != self._shards[f].rows:
            raise DatasetError(f"shard {path!r} has {md.num_rows} rows, the manifest says "
                               f"{self._shards[f].rows}; the dataset is corrupt: prepare it again")
        self._files[f] = (pf, np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)]))

    def _read_group(self, f: int, g: int) -> _RowGroup:
        def read() -> pa.Table:
            if f not in self._files:  # dropped by a failed try: a fresh file, nothing half-fetched cached
                self._open(f)
            try:
                return self._files[f][0].read_row_group(g)
            except (OSError, pa.ArrowException):
                self._files.pop(f, None)
                raise

        table = self._storage(join(self.dataset_dir, self._shards[f].file), read,
                              lambda exc: DatasetError(f"shard {self._shards[f].file!r} row group {g} is unreadable "
                                                       f"({str(exc).splitlines()[0]}); the dataset is corrupt: "
                                                       "prepare it again"))
        try:
            group = _RowGroup(table, self.width)
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(f"shard {self._shards[f].file!r} row group {g} is unreadable "
                               f"({str(exc).splitlines()[0]}); the dataset is corrupt: prepare it again") from None
        if group.tokens.size and int(group.tokens.max()) >= self.manifest.vocab_size:
            raise DatasetError(f"shard {self._shards[f].file!r} holds token ids >= vocab_size "
                               f"{self.manifest.vocab_size}; the dataset is corrupt: prepare it again")
        return group


def eval_reader(dataset_dir: Path | str, batch_size: int, rank: int = 0, world_size: int = 1, *,
                cache_bytes: int = 128 << 20, manifest: Manifest | None = None) -> ShardReader:
    """Batches over the whole validation split in a fixed order, every row once across the ranks (module docstring:
    a short last batch is padded, its `pad` rows not counted). Rank r of world_size reads its share. `manifest`: the
    dataset's, when the caller has read it already."""
    return ShardReader(dataset_dir, "val", batch_size, 0, 0, 0, rank, world_size, drop_last=False,
                       cache_bytes=cache_bytes, manifest=manifest)


EVAL_CACHE_BYTES = 256 << 20  # decoded validation rows an EvalSplit keeps between evaluations, per worker


class EvalSplit:
    """The validation batches of every evaluation of a run (`val_batches()` gives one evaluation's, as
    eval_reader): one reader for the whole run, rewound each time, so the manifest is read once, each shard's
    Parquet footer once, and each row group once as long as the row groups the evaluations read fit in
    `cache_bytes` of decoded rows (EVAL_CACHE_BYTES, 256 MiB; beyond that the least recently used are fetched
    again). Every evaluation reads the same rows in the same order (the split's fixed order from position 0), so
    with train.eval_batches x train.batch_size rows per worker well under the bound, the validation split is read
    from storage once per run instead of once per evaluation."""

    def __init__(self, dataset_dir: Path | str, batch_size: int, rank: int = 0, world_size: int = 1, *,
                 cache_bytes: int = EVAL_CACHE_BYTES, manifest: Manifest | None = None):
        self.args = (dataset_dir, batch_size, rank, world_size)
        self.cache_bytes, self.manifest = cache_bytes, manifest
        self.reader: ShardReader | None = None

    def __call__(self) -> ShardReader:
        if self.reader is None:
            self.reader = eval_reader(*self.args, cache_bytes=self.cache_bytes, manifest=self.manifest)
        self.reader.position = self.reader._start  # from the split's first batch again
        return self.reader


def check_trainable(manifest: Manifest, dataset_dir: Path | str, batch_size: int, world_size: int = 1) -> None:
    """Refuse, in one line, a dataset that cannot train: an empty validation split (nothing to evaluate, nothing
    to rank checkpoints or sweep trials by) or a training split smaller than one global micro-batch."""
    if (manifest.source or {}).get("kind") == "mixture":  # every source is evaluated; the mixed stream has no end
        for src in manifest.source["sources"]:
            if load_manifest(src["dataset_dir"]).rows("val") == 0:
                raise DatasetError(f"mixture source {src['name']!r} has no validation rows ({src['dataset_dir']}): "
                                   "every source is evaluated; prepare it with a larger data.val_fraction, a shorter "
                                   "data.seq_len or more text")
        return
    val, train = manifest.rows("val"), manifest.rows("train")
    if val == 0:
        raise DatasetError(f"no validation rows ({train:,} training rows, data.val_fraction="
                           f"{manifest.settings.get('val_fraction', '?')}) in dataset {str(dataset_dir)!r}: training "
                           "needs some to evaluate; prepare it with a larger data.val_fraction, a shorter data.seq_len "
                           "or more text")
    if train < batch_size * world_size:
        raise DatasetError(f"{train:,} training rows, fewer than one global micro-batch (train.batch_size="
                           f"{batch_size} x {world_size} worker(s)), in dataset {str(dataset_dir)!r}; lower "
                           "train.batch_size or prepare more data")


BATCHES_PER_TASK = 8  # batches one Ray Data read task yields (ray_batches)
MAX_BLOCKS = 1024  # at most this many read tasks per epoch: planning cost stays bounded on huge splits
READ_TASKS = 2  # read tasks in flight per stream: one reading ahead while the other's output is consumed


@functools.lru_cache(maxsize=8)
def _worker_reader(args: tuple, retry_s: float = 0.0, manifest: str | None = None) -> ShardReader:
    """One reader per argument set per Ray worker process, so open files and the row-group cache are reused.
    `manifest`: the dataset's as JSON text (hashable, for the cache), handed in with the task, so that no read task
    reads manifest.json again."""
    return ShardReader(*args, retry_s=retry_s, manifest=Manifest.from_dict(json.loads(manifest)) if manifest else None)


def _read_batches(batch: dict[str, np.ndarray], reader_args: tuple, retry_s: float = 0.0,
                  manifest: str | None = None) -> dict[str, np.ndarray]:
    reader = _worker_reader(reader_args, retry_s, manifest)
    rows = np.concatenate([reader.rows_of_batch(int(j)) for j in batch["id"]])
    return reader.read_rows(rows)


def ray_batches(dataset_dir: Path | str, split: str = "train", batch_size: int = 8, seed: int = 0, epoch: int = 0,
                start: int = 0, rank: int = 0, world_size: int = 1, *, retry_s: float = 0.0,
                manifest: Manifest | None = None) -> "ray.data.Dataset":
    """A Ray Data pipeline yielding exactly ShardReader's rows, in the same order, for the same arguments.

    Iterate with `.iter_torch_batches(batch_size=batch_size)` to get the same Batch dicts. `retry_s`: how long the
    read tasks ride out storage failures that pass (a setting handed to them, run.storage_retry_s in training).
    `manifest`: the dataset's, when the caller has read it already; the read tasks are handed it too.
    """
    import ray.data

    reader = ShardReader(dataset_dir, split, batch_size, seed, epoch, start, rank, world_size,
                         manifest=manifest)  # validates args
    n_batches = len(reader)
    args = (absolute(dataset_dir), split, batch_size, seed, epoch, start, rank, world_size)
    # A Ray task reads BATCHES_PER_TASK batches, at most READ_TASKS at a time: reading a batch takes
    # milliseconds, and every task or worker process more is CPU taken from the training step. The range and
    # the read are one fused operator (one task per block: the same task-pool size on both, and batch_size=None,
    # the whole block of batch ids per call); unfused, the range's tasks ran unbounded on worker processes of
    # their own (5 per training run instead of 2, each ~2 CPU-s to start on 2 cores).
    blocks = max(1, min(-(-n_batches // BATCHES_PER_TASK), MAX_BLOCKS))
    ds = ray.data.range(n_batches, override_num_blocks=blocks, concurrency=READ_TASKS)
    ds.context.execution_options.preserve_order = True  # batch j must come j-th, as in ShardReader
    return ds.map_batches(_read_batches, fn_kwargs={"reader_args": args, "retry_s": retry_s,
                                                    "manifest": json.dumps(reader.manifest.to_dict())},
                          batch_size=None,
                          batch_format="numpy",
                          compute=ray.data.TaskPoolStrategy(size=READ_TASKS))

