"""Pretokenize and pack a corpus into Parquet shards with Ray Data; cached by a hash of what determines them.

    from pipeline.data.pack import prepare
    dataset_dir = prepare(cfg)          # <run.root>/datasets/<hash>, or cfg.data.dataset_dir

Stages
  1. Ray Data stream: read (pipeline.data.corpus) -> map_batches on an actor pool (_TokenizeBatch: the tokenizer is
     loaded once per actor; each batch of documents is cleaned, batch-encoded, and concatenated with EOS after
     every document) -> a Datasink that appends each write task's token stream to `_parts/part-<task>.bin`.
     Order is the source order (preserve_order; write tasks are numbered in input order), so the parts
     concatenated are THE token stream of the corpus.
  2. Plan (driver, O(#shards) memory): window w is tokens [w*(T+1), (w+1)*(T+1)) of the stream, seq_id = w.
     The split is a hash of (seq_id, data.split_seed): val when below data.val_fraction (if no window lands in
     val, the last one does). Each shard is a range of window ids, data.rows_per_shard rows per split.
  3. Ray Data over shard specs: every shard is cut from the memory-mapped parts and written in parallel
     (Parquet, zstd, page checksums; doc_starts = the positions after each EOS). The parts are then deleted.
  4. manifest.json, written last and atomically. A killed run leaves no manifest; the rerun starts over.

Remainder policy: packing is global (concat-then-split over the whole stream), so the only tokens lost are
the final partial window, fewer than seq_len + 1 tokens in the whole dataset; nothing is padded. The result
is a pure function of (source, tokenizer, settings): the number of actors or blocks does not change a byte.

Cache: the key hashes the source description (paths, sizes, mtimes), the tokenizer (file sha256, or the
training settings), seq_len, val_fraction, rows_per_shard, split_seed and the schema version. A manifest
with the same key is reused without starting Ray; concurrent prepares of one directory serialize on a
file lock (the second one then reuses the first one's result). Test hook: LONGTRAIN_PREPARE_HOLD=parts|shards makes the
driver wait (forever) after that stage, so a test can SIGKILL it at a known point.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import pyarrow as pa

from pipeline.data.corpus import (CleanStats, DataSourceError, check_bad_records, clean_batch, describe_source,
                                  read_documents, sample_texts)
from pipeline.data.shards import (MANIFEST_FILE, SCHEMA_VERSION, TOKENIZER_FILE, DatasetError, Manifest, ShardInfo,
                             load_manifest, rows_per_row_group, shard_schema, token_numpy_type, windows_table,
                             write_manifest, write_shard)
from pipeline.ray_runtime import ensure_ray, find_cause
from pipeline.data.tokenizer import Tokenizer, TokenizerError, file_sha256, train_tokenizer

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger("longtrain.data")
PACK_VERSION = 1
PARTS_DIR = "_parts"
DOCS_PER_BATCH = 256  # documents per tokenizer call: ~1 MB of text, a fraction of a second of encoding
BATCHES_PER_PART = 8  # tokenizer batches per write task / part file: fewer, larger tasks
HIST_BINS = 128  # document-length histogram: 4 bins per octave of token count
REMAINDER_POLICY = "global concat-then-split; the final partial window (< seq_len+1 tokens) is dropped; no padding"


# ----------------------------------------------------------------------------------------------
# Tokenize: encode a batch of documents into one EOS-separated stream (shared with the baseline).

def encode_stream(tok: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(stream, lengths): the documents' ids each followed by EOS, and each document's length without EOS."""
    ids = tok.encode_batch(texts)
    flat: list[int] = []
    for x in ids:
        flat += x
        flat.append(tok.eos_id)
    return np.array(flat, dtype), np.fromiter(map(len, ids), np.int64, len(ids))


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
    """Ray Data actor: clean + encode a batch of documents; one output row holding the batch's token stream."""

    def __init__(self, tokenizer_path: str, dtype: str, source: str):
        self.tok = Tokenizer(tokenizer_path)  # once per actor
        self.dtype = np.dtype(dtype)
        self.source = source  # what non-text values are counted against (files carry their own path)

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts, clean = clean_batch(batch, self.source)
        stream, lengths = encode_stream(self.tok, texts, self.dtype)
        stats = StreamStats()
        stats.add_batch(clean, stream, lengths)
        return pa.table({"stream": pa.array([stream.tobytes()], pa.large_binary()),
                         "stats": pa.array([json.dumps(stats.to_dict())])})


def _part_sink(parts_dir: Path):
    from ray.data import Datasink
    from ray.data.block import BlockAccessor

    class PartDatasink(Datasink):
        """Each write task appends its rows' streams, in order, to part-<task index>.bin."""

        def __init__(self) -> None:
            self.parts: list[dict[str, Any]] = []

        @property
        def min_rows_per_write(self) -> int:
            return BATCHES_PER_PART

        def write(self, blocks, ctx) -> dict[str, Any]:
            path = parts_dir / f"part-{ctx.task_idx:06d}.bin"
            stats = StreamStats()
            with open(path, "wb") as f:
                for block in blocks:
                    table = BlockAccessor.for_block(block).to_arrow()
                    for stream, st in zip(table.column("stream").to_pylist(), table.column("stats").to_pylist()):
                        f.write(stream)
                        stats.merge(StreamStats.from_dict(json.loads(st)))
            return {"task": ctx.task_idx, "file": path.name, "stats": stats.to_dict()}

        def on_write_complete(self, write_result) -> None:
            self.parts = sorted(write_result.write_returns, key=lambda r: r["task"])

    return PartDatasink()


# ----------------------------------------------------------------------------------------------
# Plan: windows, split, shards.

@dataclass(frozen=True)
class SplitRule:
    """Window id -> split, from a hash of (id, seed): reproducible anywhere without a global table."""
    n_windows: int
    val_fraction: float
    seed: int
    force_last_val: bool = False

    def is_val(self, ids: np.ndarray) -> np.ndarray:
        x = np.asarray(ids, np.uint64) + np.uint64((self.seed * 0x9E3779B97F4A7C15 + 1) % (1 << 64))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finalizer
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
        val = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < self.val_fraction
        if self.force_last_val:
            val |= np.asarray(ids) == self.n_windows - 1
        return val


def plan_shards(rule: SplitRule, rows_per_shard: int, chunk: int = 1 << 20) -> tuple[list[dict], dict[str, int]]:
    """Shard specs {split, index, file, first, stop, rows}: shard k of a split holds that split's windows
    k*R .. (k+1)*R-1, all with ids in [first, stop). Scans ids in chunks, so memory stays O(#shards)."""
    counts = {"train": 0, "val": 0}
    firsts: dict[str, list[int]] = {"train": [], "val": []}
    for c0 in range(0, rule.n_windows, chunk):
        ids = np.arange(c0, min(rule.n_windows, c0 + chunk))
        val = rule.is_val(ids)
        for split, sel in (("train", ids[~val]), ("val", ids[val])):
            firsts[split] += sel[(-counts[split]) % rows_per_shard::rows_per_shard].tolist()
            counts[split] += len(sel)
    specs = []
    for split in ("train", "val"):
        starts = firsts[split]
        for k, first in enumerate(starts):
            stop = starts[k + 1] if k + 1 < len(starts) else rule.n_windows
            specs.append({"split": split, "index": k, "file": f"{split}-{k:05d}.parquet", "first": first,
                          "stop": stop, "rows": min(rows_per_shard, counts[split] - k * rows_per_shard)})
    return specs, counts


class TokenStream:
    """The corpus token stream as memory-mapped parts; reads any range without loading the rest."""

    def __init__(self, parts_dir: Path, parts: list[tuple[str, int]], dtype: np.dtype):
        self.parts_dir, self.dtype = Path(parts_dir), np.dtype(dtype)
        self.files = [f for f, n in parts if n > 0]
        self.offsets = np.concatenate([[0], np.cumsum([n for _, n in parts if n > 0])]).astype(np.int64)
        self._maps: dict[int, np.ndarray] = {}

    def read(self, start: int, stop: int) -> np.ndarray:
        out = []
        i = int(np.searchsorted(self.offsets, start, side="right") - 1)
        while start < stop:
            take = min(stop, int(self.offsets[i + 1])) - start
            if i not in self._maps:
                self._maps[i] = np.memmap(self.parts_dir / self.files[i], dtype=self.dtype, mode="r")
            local = start - int(self.offsets[i])
            out.append(self._maps[i][local:local + take])
            start += take
            i += 1
        return np.concatenate(out) if len(out) != 1 else np.array(out[0])

    def windows(self, ids: np.ndarray, width: int) -> np.ndarray:
        """(len(ids), width) windows; each run of consecutive ids is one contiguous read."""
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        runs = [self.read(int(r[0]) * width, (int(r[-1]) + 1) * width).reshape(-1, width)
                for r in np.split(ids, breaks) if len(r)]
        return np.concatenate(runs) if len(runs) != 1 else runs[0]


def write_planned_shard(spec: dict, *, out_dir: str, parts: list, rule: dict, seq_len: int, vocab_size: int,
                        eos_id: int) -> dict:
    """Ray Data map function: cut one planned shard's windows out of the parts and write it."""
    dtype = token_numpy_type(vocab_size)
    stream = TokenStream(Path(out_dir) / PARTS_DIR, [tuple(p) for p in parts], dtype)
    split_rule = SplitRule(**rule)
    ids = np.arange(spec["first"], spec["stop"], dtype=np.int64)
    val = split_rule.is_val(ids)
    ids = ids[val] if spec["split"] == "val" else ids[~val]
    ids = ids[:spec["rows"]]
    group = rows_per_row_group(seq_len, vocab_size)
    used = np.zeros(vocab_size, bool)
    eos = 0

    def tables() -> Iterable[pa.Table]:
        nonlocal eos
        for i in range(0, len(ids), group):
            chunk = ids[i:i + group]
            windows = stream.windows(chunk, seq_len + 1)  # (rows, T+1)
            used[np.bincount(windows.reshape(-1), minlength=vocab_size) > 0] = True
            eos += int(np.count_nonzero(windows == eos_id))
            yield windows_table(windows, chunk, eos_id, vocab_size)

    info = write_shard(Path(out_dir) / spec["file"], tables(), shard_schema(seq_len, vocab_size))
    return {"split": spec["split"], "index": spec["index"], "file": info.file, "rows": info.rows,
            "sha256": info.sha256, "eos": eos, "used": np.packbits(used).tobytes()}


def _write_shard_batch(batch: dict[str, Any], **kw: Any) -> dict[str, list]:
    """Ray Data map_batches function: a block of shard specs, written one after the other (few, larger tasks)."""
    keys = list(batch)
    out = [write_planned_shard({k: batch[k][i] for k in keys}, **kw) for i in range(len(batch[keys[0]]))]
    return {k: [o[k] for o in out] for k in out[0]}


# ----------------------------------------------------------------------------------------------
# Cache key and the build.

def dataset_settings(cfg: "Config") -> dict[str, Any]:
    """Everything that determines the shards' bytes (and nothing that does not, like the actor count)."""
    import sentencepiece

    d = cfg.data
    if d.tokenizer:
        if not Path(d.tokenizer).is_file():
            raise TokenizerError(f"data.tokenizer={d.tokenizer!r} does not exist; give a SentencePiece .model file "
                                 "or leave it empty to train one")
        tok: dict[str, Any] = {"file_sha256": file_sha256(d.tokenizer)}
    else:
        tok = {"train": {"vocab_size": d.vocab_size, "sample_bytes": d.tokenizer_sample_bytes,
                         "recipe": "bpe+byte_fallback+identity", "sentencepiece": sentencepiece.__version__}}
    return {"schema_version": SCHEMA_VERSION, "pack_version": PACK_VERSION, "source": describe_source(d),
            "tokenizer": tok, "seq_len": d.seq_len, "val_fraction": d.val_fraction,
            "rows_per_shard": d.rows_per_shard, "split_seed": d.split_seed}


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def reusable(out: Path, key: str) -> Manifest | None:
    """The manifest when `out` already holds this exact dataset (and its files), else None."""
    try:
        m = load_manifest(out)
    except DatasetError:
        return None
    files = [s.file for lst in m.shards.values() for s in lst] + [m.tokenizer_file]
    if m.settings_hash != key or not all((out / f).is_file() for f in files):
        return None
    return m


def clear_dataset_dir(out: Path) -> None:
    """Remove a previous build's files (manifest first, so a half-cleared directory is never a dataset)."""
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    for pattern in ("train-*.parquet", "val-*.parquet", ".*.tmp-*", ".hold-*", TOKENIZER_FILE):
        for p in out.glob(pattern):
            p.unlink(missing_ok=True)
    shutil.rmtree(out / PARTS_DIR, ignore_errors=True)


def default_actor_count() -> int:
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if nodes <= 1:  # this machine: one actor per core, whatever logical CPU count Ray was started with
        return max(1, min(cpus - 1, os.cpu_count() or 1))
    return max(1, cpus - nodes)


def _user_error(exc: BaseException) -> BaseException | None:
    """The DataSourceError/TokenizerError/DatasetError inside a Ray exception chain, if any."""
    from ray.exceptions import RayError

    return find_cause(exc, lambda e: isinstance(e, (DataSourceError, TokenizerError, DatasetError))
                      and not isinstance(e, RayError))


def _check_manifest_bad_records(m: Manifest, cfg: "Config") -> None:
    """A reused dataset meets this config's bad-record policy, as a fresh build would have to."""
    clean = CleanStats(**{k: m.counts.get(k, 0) for k in ("documents", "dropped_empty", "bad_records")})
    clean.bad_files = {f: [b["count"], b["first"]] for f, b in m.bad_records.items()}
    check_bad_records(clean, cfg.data.on_bad_record, cfg.data.max_bad_fraction)


def _hold(out: Path, stage: str) -> None:
    if os.environ.get("LONGTRAIN_PREPARE_HOLD") == stage:
        (out / f".hold-{stage}").write_text(str(os.getpid()))
        while True:
            time.sleep(1)


def prepare(cfg: "Config", ray_address: str | None = None) -> Path:
    """Build (or reuse) the packed dataset for cfg.data; returns the dataset directory."""
    t0 = time.time()
    settings = dataset_settings(cfg)
    key = settings_hash(settings)
    out = Path(cfg.data.dataset_dir) if cfg.data.dataset_dir else Path(cfg.run.root) / "datasets" / key[:16]
    if (m := reusable(out, key)) is not None:
        _check_manifest_bad_records(m, cfg)  # built with a laxer policy than this one?
        log.info("reusing dataset %s (settings hash %s)", out, key[:16])
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent prepare of the same directory waits, then reuses
        if (m := reusable(out, key)) is not None:
            _check_manifest_bad_records(m, cfg)
            log.info("reusing dataset %s, built meanwhile by another process", out)
            return out
        clear_dataset_dir(out)
        try:
            manifest = _build(cfg, settings, key, out, ray_address)
        except Exception as exc:
            err = _user_error(exc)
            if err is not None and err is not exc:  # first line: Ray appends its retry advice to the message
                raise type(err)(str(err).splitlines()[0]) from None
            raise
        manifest.extra["build_seconds"] = round(time.time() - t0, 2)
        write_manifest(out, manifest)  # last: from here on the directory is a dataset
    log.info("dataset ready: %s", out)
    return out


def _build(cfg: "Config", settings: dict, key: str, out: Path, ray_address: str | None) -> Manifest:
    import ray.data

    d = cfg.data
    ensure_ray(ray_address or cfg.ray.address or None, cfg)
    ds = read_documents(d)
    tok_path = out / TOKENIZER_FILE
    if d.tokenizer:
        shutil.copyfile(d.tokenizer, tok_path)
    else:
        log.info("training a %d-piece tokenizer on up to %d bytes of the corpus", d.vocab_size,
                 d.tokenizer_sample_bytes)
        train_tokenizer(sample_texts(ds, d.tokenizer_sample_bytes, d.on_bad_record), d.vocab_size, tok_path)
    tok = Tokenizer(tok_path)
    dtype = token_numpy_type(tok.vocab_size)

    # Stage 1: tokenize on an actor pool, stream to parts in source order.
    parts_dir = out / PARTS_DIR
    parts_dir.mkdir(exist_ok=True)
    n_actors = d.tokenize_actors or default_actor_count()
    sink = _part_sink(parts_dir)
    source = d.hf_name if d.source == "hf" else d.source
    tokens = ds.map_batches(_TokenizeBatch, fn_constructor_args=(str(tok_path), dtype.name, source),
                            batch_size=DOCS_PER_BATCH, batch_format="pyarrow", num_cpus=1,
                            compute=ray.data.ActorPoolStrategy(size=n_actors))
    t0 = time.perf_counter()
    tokens.write_datasink(sink)
    timings = {"tokenize_s": round(time.perf_counter() - t0, 2)}
    stats = StreamStats()
    for p in sink.parts:
        stats.merge(StreamStats.from_dict(p["stats"]))
    check_bad_records(stats.clean, d.on_bad_record, d.max_bad_fraction)
    if stats.clean.documents == 0:
        raise DataSourceError(f"no documents left after cleaning ({stats.clean.dropped_empty} empty or "
                              "whitespace-only were dropped); check data.path / data.text_column")
    _hold(out, "parts")

    # Stage 2: plan windows and the split.
    width = d.seq_len + 1
    n_windows = stats.tokens // width
    if n_windows == 0:
        raise DataSourceError(f"the corpus gives {stats.tokens} tokens, less than one row of seq_len+1={width}; "
                              "lower data.seq_len or add text")
    rule = SplitRule(n_windows, d.val_fraction, d.split_seed)
    specs, counts = plan_shards(rule, d.rows_per_shard)
    if d.val_fraction > 0 and counts["val"] == 0 and n_windows >= 2:
        rule = dataclasses.replace(rule, force_last_val=True)
        specs, counts = plan_shards(rule, d.rows_per_shard)

    # Stage 3: write the shards in parallel.
    parts = [(p["file"], p["stats"]["tokens"]) for p in sink.parts]
    kw = {"out_dir": str(out), "parts": parts, "rule": dataclasses.asdict(rule), "seq_len": d.seq_len,
          "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}
    shard_ds = ray.data.from_items(specs, override_num_blocks=min(len(specs), 4 * n_actors))
    shard_ds.context.execution_options.preserve_order = True
    t0 = time.perf_counter()
    written = shard_ds.map_batches(_write_shard_batch, fn_kwargs=kw, batch_size=None).take_all()
    timings["shards_s"] = round(time.perf_counter() - t0, 2)
    _hold(out, "shards")
    shutil.rmtree(parts_dir, ignore_errors=True)

    used = np.zeros(tok.vocab_size, bool)
    for w in written:
        used |= np.unpackbits(np.frombuffer(w["used"], np.uint8))[:tok.vocab_size].astype(bool)
    shards = {split: [ShardInfo(w["file"], w["rows"], w["sha256"])
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
        tokenizer_file=TOKENIZER_FILE, tokenizer_sha256=tok.sha256, settings_hash=key, source=settings["source"],
        settings=settings, counts=counts_out, packing_efficiency=kept / stats.tokens, remainder_policy=REMAINDER_POLICY,
        doc_length=stats.doc_length(), shards=shards, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        bad_records={f: {"count": n, "first": reason} for f, (n, reason) in bad_files.items()},
        extra={"tokenize_actors": n_actors, "parts": len(parts), "split_rule": dataclasses.asdict(rule), **timings})
