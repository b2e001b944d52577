"""Pretokenize and pack a corpus into Parquet shards with Ray Data; cached by a hash of what determines them.

    from pipeline.data.pack import prepare
    dataset_dir = prepare(cfg)          # <data.dataset_store>/<hash> (runs/datasets/<hash>, s3://.../datasets/<hash>)

Stages, overlapped (shards are written while the corpus is still being tokenized):
  1. Ray Data stream: read (pipeline.data.corpus) -> map_batches on a fixed actor pool (_TokenizeBatch: the
     tokenizer is loaded once per actor; each batch of documents is cleaned, batch-encoded and concatenated
     with EOS after every document, and APPENDED TO THE ACTOR'S OWN FILE `_parts/part-<actor>.bin` of the build
     directory; on object storage, which cannot append, each batch is an object of its own,
     `_parts/part-<actor>-<n>.bin`). What leaves the actor is one small row per batch: (file, offset, token
     count, stats). The tokens never travel through Ray's object store or the driver.
  2. The driver iterates those rows in source order (preserve_order): batch i's tokens are the stream's
     [sum of earlier counts, + its count). Window w is tokens [w*(T+1), (w+1)*(T+1)), seq_id = w. The split
     is a hash of (seq_id, data.split_seed): val below data.val_fraction (if no window lands in val, the
     last one does). Shard k of a split holds that split's windows k*R .. (k+1)*R-1 (R = data.rows_per_shard)
     so it is final as soon as the stream reaches the first window of shard k+1: ShardPlanner hands it out
     then, and a Ray task (pipeline/data/shard_plan.py: write_planned_shard, TokenStream.windows) cuts it from the parts (memory-mapped, or ranged reads on object storage) and writes
     it into the build directory (Parquet, zstd, page checksums;
     doc_starts = the positions after each EOS) while tokenization goes on. The last shard of each split
     waits for the end of the stream. The driver keeps only the batches a pending shard still needs: its
     memory does not grow with the corpus.
  3. manifest.json, written last in one piece, naming only this build's files (pipeline/data/builds.py: how
     a killed prepare, a rerun and two prepares of one dataset at once stay safe on object storage). A killed
     run leaves no manifest; the rerun starts a new build and removes the dead one. A build that fails (bad records,
     a store that refuses writes) first lets its shard writers end and stops its tokenize actors, then removes its
     files: nothing is left writing into, or reading from, a directory that is gone.

Ray Data settings (why): `compute=ActorPoolStrategy(size=n)` with n = one actor per core (a fixed pool:
each actor costs ~1 CPU-s to start and the work is CPU-bound from the first to the last batch, so
autoscaling would only add start-ups), or the corpus's block count when that is smaller (corpus.blocks_at_least:
a small corpus has fewer blocks than the machine has cores, and an actor without one only costs its start); `num_cpus=1` per actor (SentencePiece runs single-threaded);
`batch_size=DOCS_PER_BATCH` documents in `batch_format="pyarrow"` (the reader's Arrow blocks go to the
actor without a pandas/numpy conversion); one read task per file with ~1 MB blocks (corpus.py); the
shard writers are plain Ray tasks because which shard is ready is only known in the driver, in order.

Remainder policy: packing is global (concat-then-split over the whole stream), so the only tokens lost are
the final partial window, fewer than seq_len + 1 tokens in the whole dataset; nothing is padded. The result
is a pure function of (source, tokenizer, settings): the number of actors or blocks does not change a byte.

Cache: the key hashes the source description (paths or URIs, sizes, mtimes), the tokenizer (file sha256, or
the training settings), seq_len, val_fraction, rows_per_shard, split_seed and the schema version. A manifest
with the same key is reused without starting Ray. On a local disk concurrent prepares of one directory
serialize on a file lock (the second one then reuses the first one's result); on object storage, which has no
lock, both build and the first manifest written wins (the other prepare then drops its own build). Before any
Ray work, the store is checked (bucket, credentials, endpoint: one line when it cannot be used), and on a
cluster whose workers run on other nodes a bare local store or corpus path is refused (they could not read
it). Test hook: LONGTRAIN_PREPARE_HOLD=start|parts|shards makes the driver wait before it joins Ray (start) or
after that stage while a `.hold-<stage>` marker in its build directory exists, so a test can kill or interrupt it
at a known point, or release it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa

from pipeline.data.builds import Build, remove_stale
from pipeline.data.cleaning import CleanStats, clean_batch
from pipeline.data.corpus import (DataSourceError, blocks_at_least, check_bad_records, describe_source, read_documents,
                                  sample_texts)
from pipeline.data.no_usable_text import check_first_records, nothing_usable
from pipeline.data.shard_plan import (PARTS_DIR, SegmentIndex, ShardPlanner, ShardWriters, SplitRule,  # noqa: F401
                                      plan_shards)
from pipeline.data.shards import (MANIFEST_FILE, SCHEMA_VERSION, TOKENIZER_FILE, DatasetError, Manifest, ShardInfo,
                                  load_manifest, token_numpy_type, write_manifest)
from pipeline.data.tokenizer import Tokenizer, TokenizerError, file_sha256, train_tokenizer
from pipeline.ray_runtime import ensure_ray, find_cause, require_shared
from pipeline.disk_space import DATASET_FIX, disk_full_error, is_disk_full
from pipeline.storage import (StorageError, absolute, check, dataset_store, delete, exists, is_local, is_uri, join,
                              listdir, makedirs, read_bytes, resolve, write_bytes)

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger("longtrain.data")
PACK_VERSION = 1
DOCS_PER_BATCH = 256  # documents per tokenizer call: ~1 MB of text, a fraction of a second of encoding
HIST_BINS = 128  # document-length histogram: 4 bins per octave of token count
REMAINDER_POLICY = "global concat-then-split; the final partial window (< seq_len+1 tokens) is dropped; no padding"


# ----------------------------------------------------------------------------------------------
# Tokenize: encode a batch of documents into one EOS-separated stream (shared with the baseline).

def encode_stream(tok: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(stream, lengths): the documents' ids each followed by EOS, and each document's length without EOS."""
    return token_stream(tok.encode_batch(texts), tok.eos_id, dtype)


def token_stream(ids: list[list[int]], eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """encode_stream of documents already encoded: their ids laid end to end in C, an EOS inserted after each."""
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum()))
    return np.insert(flat, np.cumsum(lengths), np.asarray(eos_id, dtype)), lengths


def length_histogram(lengths: np.ndarray) -> np.ndarray:
    bins = np.floor(4 * np.log2(np.maximum(lengths, 1))).astype(np.int64)
    return np.bincount(np.minimum(bins, HIST_BINS - 1), minlength=HIST_BINS)


@dataclass
class StreamStats:
    """What a piece of the stream carries besides tokens; adds up across pieces."""
    clean: CleanStats = dataclasses.field(default_factory=CleanStats)
    tokens: int = 0  # including the EOS after each document
    len_sum: int = 0
    len_min: int = 1 << 62
    len_max: int = 0
    hist: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(HIST_BINS, np.int64))

    def add_batch(self, clean: CleanStats, stream: np.ndarray, lengths: np.ndarray) -> None:
        self.clean.add(clean)
        self.tokens += len(stream)
        if len(lengths):
            self.len_sum += int(lengths.sum())
            self.len_min = min(self.len_min, int(lengths.min()))
            self.len_max = max(self.len_max, int(lengths.max()))
            self.hist += length_histogram(lengths)

    def merge(self, other: "StreamStats") -> None:
        self.clean.add(other.clean)
        self.tokens += other.tokens
        self.len_sum += other.len_sum
        self.len_min, self.len_max = min(self.len_min, other.len_min), max(self.len_max, other.len_max)
        self.hist += other.hist

    def to_dict(self) -> dict[str, Any]:
        return {"clean": dataclasses.asdict(self.clean), "tokens": self.tokens, "len_sum": self.len_sum,
                "len_min": self.len_min, "len_max": self.len_max, "hist": self.hist.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StreamStats":
        return cls(CleanStats(**d["clean"]), d["tokens"], d["len_sum"], d["len_min"], d["len_max"],
                   np.asarray(d["hist"], np.int64))

    def doc_length(self) -> dict[str, Any]:
        n = self.clean.documents
        out: dict[str, Any] = {"count": n, "mean": self.len_sum / n if n else 0.0,
                               "min": self.len_min if n else 0, "max": self.len_max}
        cum = np.cumsum(self.hist)
        for q in (0.5, 0.9, 0.99):  # upper edge of the histogram bin holding the quantile (within ~19%)
            b = int(np.searchsorted(cum, q * n)) if n else 0
            out[f"p{int(q * 100)}_approx"] = int(min(self.len_max, np.ceil(2 ** ((b + 1) / 4))))
        return out


class _TokenizeBatch:
    """Ray Data actor: clean + encode a batch of documents, append its token stream to this actor's part file
    (on object storage: write it as an object of its own), return one row (file, offset, tokens, stats)
    locating it."""

    def __init__(self, tokenizer_path: str, dtype: str, source: str, parts_dir: str):
        import uuid

        # Nothing of the build is touched here, only at the first batch: Ray Data may construct an actor of the
        # pool after the build has ended (its stream is over, the parts directory removed, or the build abandoned;
        # a pool's pending actor is released, not killed, and still runs its constructor when its CPU frees up,
        # e.g. while another source is prepared side by side). Such an actor gets no batch and must not fail.
        self.tokenizer_path = tokenizer_path
        self.tok: Tokenizer | None = None  # loaded once per actor, at its first batch
        self.dtype = np.dtype(dtype)
        self.source = source  # what non-text values are counted against (files carry their own path)
        self.parts_dir = parts_dir
        self.name = f"part-{uuid.uuid4().hex}"  # a restarted actor starts new files: offsets stay valid
        self.out = None  # this actor's part file on a local disk, opened at its first batch
        self.offset = 0  # in tokens, in this actor's local file
        self.batches = 0

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.tok is None:  # a batch means the build is running: its tokenizer and parts directory exist
            self.tok = Tokenizer(self.tokenizer_path)
            if is_local(self.parts_dir):
                self.out = open(join(self.parts_dir, self.name + ".bin"), "wb")
        texts, clean = clean_batch(batch, self.source)
        stream, lengths = encode_stream(self.tok, texts, self.dtype)
        if self.out is not None:
            file, offset = self.name + ".bin", self.offset
            self.out.write(stream.tobytes())
            self.out.flush()  # in the page cache before the driver hears of it: shard writers may map it at once
            self.offset += len(stream)
        else:  # object storage cannot append: one object per batch, complete before the driver hears of it
            file, offset = f"{self.name}-{self.batches:06d}.bin", 0
            write_bytes(join(self.parts_dir, file), stream.tobytes())
        self.batches += 1
        stats = StreamStats()
        stats.add_batch(clean, stream, lengths)
        return pa.table({"file": [file], "offset": [offset], "tokens": [len(stream)],
                         "stats": [json.dumps(stats.to_dict())]})


# ----------------------------------------------------------------------------------------------
# Cache key and the build.

def dataset_settings(cfg: "Config", dedup_group: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything that determines the shards' bytes (and nothing that does not, like the actor count).
    `dedup_group`: for a source deduplicated with others (a mixture's), what its kept documents also depend on
    (the other sources and its priority among them: pipeline/data/mixture_prepare.py)."""
    import sentencepiece

    from pipeline.data.dedup import dedup_spec

    d = cfg.data
    if d.tokenizer:
        if not exists(d.tokenizer):
            raise TokenizerError(f"data.tokenizer={d.tokenizer!r} does not exist; give a SentencePiece .model file "
                                 "or leave it empty to train one")
        tok: dict[str, Any] = {"file_sha256": file_sha256(d.tokenizer)}
    else:
        tok = {"train": {"vocab_size": d.vocab_size, "sample_bytes": d.tokenizer_sample_bytes,
                         "recipe": "bpe+byte_fallback+identity", "sentencepiece": sentencepiece.__version__}}
    out = {"schema_version": SCHEMA_VERSION, "pack_version": PACK_VERSION, "source": describe_source(d),
           "tokenizer": tok, "seq_len": d.seq_len, "val_fraction": d.val_fraction,
           "rows_per_shard": d.rows_per_shard, "split_seed": d.split_seed}
    spec = dedup_spec(d)
    if spec is not None:  # data.dedup=none keeps the key (and so every dataset) of before deduplication
        out["dedup"] = {**spec.to_dict(), **({"group": dedup_group} if dedup_group else {})}
    return out


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def reusable(out: str, key: str) -> Manifest | None:
    """The manifest when `out` already holds this exact dataset (and every file it names), else None."""
    try:
        m = load_manifest(out)
    except DatasetError:
        return None
    if m.settings_hash != key:
        return None
    _, base = resolve(out)
    present = {f.path[len(base) + 1:] for f in listdir(out, recursive=True)}
    files = [s.file for lst in m.shards.values() for s in lst] + [m.tokenizer_file]
    return m if all(f in present for f in files) else None


@contextlib.contextmanager
def _one_builder(out: str) -> Iterator[None]:
    """On a local disk, concurrent prepares of one directory take turns (the second then reuses the first's
    dataset). Object storage has no lock: there every prepare builds apart (pipeline/data/builds.py)."""
    if not is_local(out):
        yield
        return
    makedirs(out)
    with open(join(out, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def default_actor_count() -> int:
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if nodes <= 1:  # this machine: one actor per core it may use, whatever logical CPU count Ray was started with
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(cpus - 1, cores))
    return max(1, cpus - nodes)


def _user_error(exc: BaseException) -> BaseException | None:
    """The DataSourceError/TokenizerError/DatasetError/StorageError inside a Ray exception chain, if any."""
    from ray.exceptions import RayError

    return find_cause(exc, lambda e: isinstance(e, (DataSourceError, TokenizerError, DatasetError, StorageError))
                      and not isinstance(e, RayError))


def _check_manifest_bad_records(m: Manifest, cfg: "Config") -> None:
    """A reused dataset meets this config's bad-record policy, as a fresh build would have to."""
    clean = CleanStats(**{k: m.counts.get(k, 0) for k in ("documents", "dropped_empty", "bad_records")})
    clean.bad_files = {f: [b["count"], b["first"]] for f, b in m.bad_records.items()}
    check_bad_records(clean, cfg.data.on_bad_record, cfg.data.max_bad_fraction)


def _hold(build: Build, stage: str) -> None:
    """Test hook: with LONGTRAIN_PREPARE_HOLD=<stage>, write <build>/.hold-<stage> (this pid) after that stage and
    wait while it exists, so a test can SIGKILL the prepare there or let it go on by deleting the marker."""
    if os.environ.get("LONGTRAIN_PREPARE_HOLD") == stage:
        marker = join(build.dir, f".hold-{stage}")
        write_bytes(marker, str(os.getpid()).encode())
        while exists(marker):
            time.sleep(0.5)


def dataset_location(cfg: "Config", key: str) -> str:
    """data.dataset_dir, else <data.dataset_store>/<first 16 hex digits of the key>."""
    return absolute(cfg.data.dataset_dir) if cfg.data.dataset_dir else join(dataset_store(cfg), key[:16])


def prepare(cfg: "Config", ray_address: str | None = None, *, dedup_group: dict[str, Any] | None = None,
            dedup: "Any" = None) -> Path | str:
    """Build (or reuse) the packed dataset for cfg.data; returns the dataset directory: a Path on this machine,
    else its URI. `dedup_group`, `dedup`: a mixture's source deduplicated with the others (its group's cache-key part,
    and a callable giving its (Removal, record) once the group has run: pipeline/data/mixture_prepare.py)."""
    return prepare_dataset(cfg, ray_address, dedup_group=dedup_group, dedup=dedup)[0]


def prepare_dataset(cfg: "Config", ray_address: str | None = None, *, dedup_group: dict[str, Any] | None = None,
                    dedup: "Any" = None) -> tuple[Path | str, Manifest]:
    """prepare, returning the dataset directory and its manifest (the one read to reuse it, or the one just
    written), for the caller to hand on."""
    t0 = time.time()
    settings = dataset_settings(cfg, dedup_group)
    key = settings_hash(settings)
    out = dataset_location(cfg, key)
    if (m := reusable(out, key)) is not None:
        _check_manifest_bad_records(m, cfg)  # built with a laxer policy than this one?
        log.info("reusing dataset %s (settings hash %s)", out, key[:16])
        return _returned(out), m
    check_first_records(cfg.data)  # empty files, a text column no record has: in seconds, before any Ray work
    check(out, what="the dataset store", write=True)  # bucket, credentials, endpoint: before any Ray work
    with _one_builder(out):
        if (m := reusable(out, key)) is not None:
            _check_manifest_bad_records(m, cfg)
            log.info("reusing dataset %s, built meanwhile by another process", out)
            return _returned(out), m
        try:
            if load_manifest(out).settings_hash != key:  # this directory held other settings: retire them first
                delete(join(out, MANIFEST_FILE))
        except DatasetError:
            pass
        remove_stale(out)  # dead builds of earlier attempts (a killed prepare) and the retired dataset
        build, published = Build(out, key), False
        try:
            manifest = _build(cfg, settings, key, out, build, ray_address, dedup)
            manifest.extra["build_seconds"] = round(time.time() - t0, 2)
            if (m := reusable(out, key)) is not None:  # another prepare of this dataset got there first: use its
                build.abandon()
                _check_manifest_bad_records(m, cfg)
                return _returned(out), m
            build.verify(manifest)
            write_manifest(out, manifest)  # last: from here on the directory is a dataset
            published = True
            build.finish()
        except BaseException as exc:
            if published:  # the manifest names this build: keep it, whatever failed after
                build.stop()
            else:
                build.abandon()
            if is_disk_full(exc):  # any write of the build (parts, shards, tokenizer, manifest): one line, and a
                raise disk_full_error(out, "the dataset", DATASET_FIX, exc=exc) from None  # rerun starts clean
            err = _user_error(exc)
            if err is not None and err is not exc:  # first line: Ray appends its retry advice to the message
                raise type(err)(str(err).splitlines()[0]) from None
            raise
        remove_stale(out)
    log.info("dataset ready: %s", out)
    return _returned(out), manifest


def _returned(out: str) -> Path | str:
    return out if is_uri(out) else Path(out)


def _build(cfg: "Config", settings: dict, key: str, out: str, build: Build, ray_address: str | None,
           dedup: "Any" = None) -> Manifest:
    import ray.data

    from pipeline.data.dedup import GroupSource, deduplicate, dedup_spec

    d = cfg.data
    _hold(build, "start")  # before this process connects to (or starts) Ray
    ensure_ray(ray_address or cfg.ray.address or None, cfg)
    # Ray Data's tasks and actors may run on every node: each must be able to open the corpus and the store.
    require_shared(cfg, {"the dataset store": out, "data.path": d.path if d.source == "files" else ""})
    ds = read_documents(d)
    dedup_record: dict[str, Any] = {}
    spec = dedup_spec(d)
    if spec is not None:  # before the tokenizer's sample and the split: no duplicate trains it or straddles the split
        if dedup is None:  # a group of one (a mixture's group was run by its caller)
            result = deduplicate([GroupSource("", d, 0)], spec)
            dedup = lambda: (result.removal(0), result.record(0))  # noqa: E731
        removal, dedup_record = dedup()
        ds = removal.drop_from(ds)
    tok_path = join(build.dir, TOKENIZER_FILE)
    if d.tokenizer:
        write_bytes(tok_path, read_bytes(d.tokenizer))
    else:
        log.info("training a %d-piece tokenizer on up to %d bytes of the corpus", d.vocab_size,
                 d.tokenizer_sample_bytes)
        sample = sample_texts(ds, d.tokenizer_sample_bytes, d.on_bad_record)
        try:
            train_tokenizer(sample, d.vocab_size, tok_path)
        except TokenizerError:
            if sample.stats.documents == 0:  # nothing to train on: say which files and fields, not "empty sample"
                raise DataSourceError(nothing_usable(d, sample.stats)) from None
            raise
    tok = Tokenizer(tok_path)
    dtype = token_numpy_type(tok.vocab_size)

    # Tokenize on an actor pool (each actor appends to its own part file); in the driver, follow the stream
    # in source order and write every shard that became final while the rest is still being tokenized.
    parts_dir = join(build.dir, PARTS_DIR)
    makedirs(parts_dir)
    # One actor per core, or as many as the corpus has blocks when that is fewer: an actor without a block would
    # only cost its start (and Ray Data warns that the pool is larger than its input).
    n_actors = min(d.tokenize_actors or default_actor_count(), blocks_at_least(d) or 1 << 30)
    source = d.hf_name if d.source == "hf" else d.source
    batches = ds.map_batches(_TokenizeBatch, fn_constructor_args=(tok_path, dtype.name, source, parts_dir),
                             batch_size=DOCS_PER_BATCH, batch_format="pyarrow", num_cpus=1,
                             compute=ray.data.ActorPoolStrategy(size=n_actors))
    width = d.seq_len + 1
    planner = ShardPlanner(d.val_fraction, d.split_seed, d.rows_per_shard)
    segments = SegmentIndex()
    writers = ShardWriters(max(2, n_actors // 2), out_dir=build.dir, seq_len=d.seq_len, vocab_size=tok.vocab_size,
                           eos_id=tok.eos_id)
    open_rule = dataclasses.asdict(planner.rule)

    def hand_out(specs: list[dict], rule: dict) -> None:
        for spec in specs:
            segs, base = segments.covering(spec["first"] * width, spec["stop"] * width)
            writers.submit(spec, segs, base, rule)
        segments.drop_before(planner.lowest_pending() * width)

    stats = StreamStats()
    t0 = time.perf_counter()
    stream = iter(batches.iter_batches(batch_size=None, batch_format="pyarrow"))
    try:
        for batch in stream:
            for file, offset, n, st in zip(*(batch.column(c).to_pylist() for c in ("file", "offset", "tokens",
                                                                                    "stats"))):
                segments.append(file, offset, n)
                stats.merge(StreamStats.from_dict(json.loads(st)))
            if d.on_bad_record == "error":
                check_bad_records(stats.clean, d.on_bad_record, d.max_bad_fraction)  # at once, not hours later
            hand_out(planner.advance(segments.total // width), open_rule)
        timings = {"tokenize_s": round(time.perf_counter() - t0, 2)}
        if log.isEnabledFor(logging.DEBUG):  # Ray Data's per-operator times (bench/dedup_speed.py records them)
            log.debug("Ray Data, the tokenizing pass:\n%s", batches.stats())
        check_bad_records(stats.clean, d.on_bad_record, d.max_bad_fraction)
        if stats.clean.documents == 0:
            raise DataSourceError(nothing_usable(d, stats.clean))
        _hold(build, "parts")
        n_windows = stats.tokens // width
        if n_windows == 0:
            raise DataSourceError(f"the corpus gives {stats.tokens} tokens, less than one row of seq_len+1={width}; "
                                  "lower data.seq_len or add text")
        rule = SplitRule(n_windows, d.val_fraction, d.split_seed,
                         force_last_val=d.val_fraction > 0 and planner.counts["val"] == 0 and n_windows >= 2)
        hand_out(planner.finish(n_windows, rule.force_last_val), dataclasses.asdict(rule))
        counts = dict(planner.counts)
        written = writers.results()
    except BaseException as exc:
        # Before the caller removes the build: the shard writers have ended (none still maps a part file) and the
        # tokenize actors are shut down (Ray Data's executor stops when its iterator is closed, not at some later
        # garbage collection), so nothing prints an error about a file the failed build no longer has.
        writers.drain(wait_s=15 if isinstance(exc, KeyboardInterrupt) else 120)  # Ctrl+C: out soon
        getattr(stream, "close", lambda: None)()
        raise
    timings["shards_after_tokenize_s"] = round(time.perf_counter() - t0 - timings["tokenize_s"], 2)
    _hold(build, "shards")
    delete(parts_dir)

    used = np.zeros(tok.vocab_size, bool)
    for w in written:
        used |= np.unpackbits(np.frombuffer(w["used"], np.uint8))[:tok.vocab_size].astype(bool)
    shards = {split: [ShardInfo(f"{build.name}/{w['file']}", w["rows"], w["sha256"])
                      for w in sorted(written, key=lambda w: w["index"]) if w["split"] == split]
              for split in ("train", "val")}
    kept = n_windows * width
    clean = dataclasses.asdict(stats.clean)
    bad_files = clean.pop("bad_files")
    counts_out = {**clean, "tokens_total": stats.tokens, "tokens_kept": kept,
                  "tokens_dropped_remainder": stats.tokens - kept, "sequences": n_windows,
                  "eos_in_shards": sum(w["eos"] for w in written), "vocab_used": int(used.sum())}
    return Manifest(
        schema_version=SCHEMA_VERSION, seq_len=d.seq_len, vocab_size=tok.vocab_size, pad_id=tok.pad_id,
        unk_id=tok.unk_id, bos_id=tok.bos_id, eos_id=tok.eos_id, token_type=dtype.name,
        tokenizer_file=f"{build.name}/{TOKENIZER_FILE}", tokenizer_sha256=tok.sha256, settings_hash=key,
        source=settings["source"],
        settings=settings, counts=counts_out, packing_efficiency=kept / stats.tokens, remainder_policy=REMAINDER_POLICY,
        doc_length=stats.doc_length(), shards=shards, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        bad_records={f: {"count": n, "first": reason} for f, (n, reason) in bad_files.items()}, dedup=dedup_record,
        extra={"tokenize_actors": n_actors, "parts": segments.count, "split_rule": dataclasses.asdict(rule),
               "rows": counts, **timings})
