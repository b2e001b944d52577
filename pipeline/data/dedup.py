"""Exact and near-duplicate removal before tokenizing, on Ray Data (`data.dedup`: none | exact | near).

    spec = dedup_spec(cfg.data)                                   # None for data.dedup=none
    result = deduplicate([GroupSource("web", web_cfg.data, 0), GroupSource("edu", edu_cfg.data, 1)], spec)
    ds = result.removal(0).drop_from(read_documents(web_cfg.data))   # the web source without its duplicates
    manifest.dedup = result.record(0)                             # counts, settings, documents shared with others

One group of sources is deduplicated together (a flat config is a group of one; a mixture's sources, except those
given as prepared datasets, are one group), so a document found in two sources is trained once. Stages:
  1. signatures: each source's reader (its documents numbered by the reader: pipeline/data/corpus.py DOC_COLUMN),
     cleaned as the tokenizer will clean them, then `map_batches` computing per document its node (priority << 56
     | id), exact hash and, for near, MinHash band keys and sketch (pipeline/data/dedup_signatures.py, its kernels
     compiled by Numba: pipeline/data/dedup_kernels.py). Materialized in Ray's object store: ~30 bytes a document
     for exact, ~250 for near.
  2.-4. a corpus of up to ONE_TASK_DOCS documents (ONE_TASK_DOCS / 2 for near): a few plain Ray tasks over the
     materialized blocks, side by side (pipeline/data/dedup_tasks.py): the exact copies; the bands, split over the
     CPUs, each key sorted and the candidate pairs of shared keys checked against their signatures; the checked
     edges' connected components, and every removed document in one block sorted by node.
     A larger corpus (or an explicit `workers`), spread over the cluster by hash shuffles:
  2. exact: a hash shuffle by exact hash (Ray Data groupby over a hash partition column); in each partition every
     copy after the group's smallest node is removed.
  3. near: band rows (one per band and document with words) hash-shuffled by band key; each bucket's candidate pairs
     checked against their signatures; the checked edges' connected components by large-star/small-star rounds,
     each a shuffle (pipeline/data/dedup_components.py); every member but a component's smallest is removed.
  4. the removed nodes, sorted by Ray Data into ranges.
  Either way the tokenizing pass drops a document whose node lies in the sorted block of its range (a map before
  the tokenizer). The driver holds block bounds and references only.
Nothing is collected in the driver but counts; memory beyond the object store does not grow with the corpus.

Who keeps a document: the smallest node, i.e. the source first by `data.dedup_keep` (first: the order of
data.mixture; weight: the highest weight, then that order), then the first occurrence in the source's order. The
result depends only on the corpus and the settings, not on how many workers ran it.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pipeline.data.cleaning import clean_batch
from pipeline.data.corpus import DOC_COLUMN, DOC_ID_BITS
from pipeline.data.dedup_components import EXACT, NEAR, bucket_edges, by_partition, components, exact_removed, \
    star_removed
from pipeline.data.dedup_signatures import DedupParams, Signer, exact_hashes
from pipeline.data.dedup_tasks import counts_of, find_removed

if TYPE_CHECKING:
    import ray.data

    from pipeline.config import DataConfig

log = logging.getLogger("longtrain.data")
MODES = ("none", "exact", "near")
KEEP_RULES = ("first", "weight")
MAX_SOURCES = 127  # node = priority << 56 | id, an int64
PARTITION_BYTES = 64 << 20  # rows of a hash partition: what one task holds at once
_BATCH_DOCS = 256


@dataclass(frozen=True)
class DedupSpec:
    """The settings of deduplication (what the dataset's cache key holds of it)."""

    mode: str  # exact | near
    params: DedupParams
    keep: str = "first"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "exact_normalisation": "whitespace runs as one space, ends "
                                                                         "stripped; blake2b-128"}
        if self.mode == "near":
            out.update(self.params.to_dict())
        return out


def dedup_spec(d: "DataConfig") -> DedupSpec | None:
    """data.dedup's settings; None for data.dedup=none."""
    if d.dedup == "none":
        return None
    return DedupSpec(d.dedup, DedupParams(d.dedup_threshold, d.dedup_ngram), d.dedup_keep)


@dataclass(frozen=True)
class GroupSource:
    """One source of a group deduplicated together; priority 0 keeps first."""

    name: str
    data: "DataConfig"
    priority: int


# ----------------------------------------------------------------------------------------------- stage 1
def _signature_rows(batch: pa.Table, priority: int, mode: str, params: DedupParams | None) -> pa.Table:
    """map_batches: one row per usable document (as the tokenizer would keep it): node, exact hash and, for near,
    band keys and sketch (documents without a word get no band rows: has_words false)."""
    kept: list[int] = []
    texts, _ = clean_batch(batch, kept_rows=kept)
    ids = batch.column(DOC_COLUMN).to_numpy()[np.asarray(kept, np.int64)] if kept else np.zeros(0, np.int64)
    node = (np.int64(priority) << np.int64(DOC_ID_BITS)) | ids.astype(np.int64)
    exact = exact_hashes(texts, compiled=mode == "near")  # exact alone never loads Numba (exact_hashes)
    cols: dict[str, pa.Array] = {"node": pa.array(node, pa.int64()), "ex_hi": pa.array(exact[:, 0]),
                                 "ex_lo": pa.array(exact[:, 1])}
    if mode == "near":
        sig = _signer(params).sign(texts, exact)
        b, k = sig.bands.shape[1], sig.sketch.shape[1]
        cols["has_words"] = pa.array(sig.has_words)
        cols["bands"] = pa.FixedSizeListArray.from_arrays(pa.array(sig.bands.reshape(-1)), b)
        cols["sketch"] = pa.FixedSizeListArray.from_arrays(pa.array(sig.sketch.reshape(-1)), k)
    return pa.table(cols)


_SIGNERS: dict[DedupParams, Signer] = {}


def _signer(params: DedupParams) -> Signer:
    """One Signer per worker process and settings (its hash parameters are drawn once)."""
    if params not in _SIGNERS:
        _SIGNERS[params] = Signer(params)
    return _SIGNERS[params]


def _band_rows(batch: pa.Table) -> pa.Table:
    """map_batches: a row per band of every document with words: (key, node, ex_lo, sketch)."""
    keep = batch.column("has_words").to_numpy(zero_copy_only=False)
    node, ex_lo = batch.column("node").to_numpy()[keep], batch.column("ex_lo").to_numpy()[keep]
    bands_t = batch.schema.field("bands").type
    b = bands_t.list_size
    bands = batch.column("bands").combine_chunks().flatten().to_numpy().reshape(-1, b)[keep]
    k = batch.schema.field("sketch").type.list_size
    sketch = batch.column("sketch").combine_chunks().flatten().to_numpy().reshape(-1, k)[keep]
    n = len(node)
    return pa.table({"key": pa.array(bands.reshape(-1)), "node": pa.array(np.repeat(node, b)),
                     "ex_lo": pa.array(np.repeat(ex_lo, b)),
                     "sketch": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(sketch, b, axis=0).reshape(-1)),
                                                                 k)}) if n else _empty_band_rows(k)


def _empty_band_rows(k: int) -> pa.Table:
    return pa.table({"key": pa.array([], pa.uint64()), "node": pa.array([], pa.int64()),
                     "ex_lo": pa.array([], pa.uint64()),
                     "sketch": pa.FixedSizeListArray.from_arrays(pa.array([], pa.uint8()), k)})


# ----------------------------------------------------------------------------------------------- removal index
def _bounds(table: pa.Table) -> tuple[int, int, int]:
    node = table.column("node").to_numpy()
    return (int(node[0]), int(node[-1]), len(node)) if len(node) else (0, -1, 0)


@dataclass
class Removal:
    """The removed nodes of one source: sorted blocks in Ray's object store and their bounds (what a read task needs
    to drop them). Picklable: Ray Data tasks get it as an argument."""

    priority: int
    lows: np.ndarray  # (blocks,) int64, the smallest node of each block
    highs: np.ndarray  # (blocks,) int64
    refs: list  # ObjectRef[pa.Table] per block, columns node (sorted), ...

    def drop_from(self, ds: "ray.data.Dataset") -> "ray.data.Dataset":
        """ds (a reader's dataset, with the DOC_COLUMN) without this source's removed documents: a map fused into
        its read tasks. Unreadable and empty records stay (the tokenize pass counts them)."""
        if not len(self.refs):
            return ds
        return ds.map_batches(_drop_removed, fn_kwargs={"removal": self}, batch_format="pyarrow", batch_size=None)


_BLOCKS: dict[str, np.ndarray] = {}  # a read task's process: the last few removed blocks fetched


def _removed_nodes(ref) -> np.ndarray:
    import ray

    key = ref.hex()
    if key not in _BLOCKS:
        while len(_BLOCKS) >= 4:
            _BLOCKS.pop(next(iter(_BLOCKS)))
        _BLOCKS[key] = ray.get(ref).column("node").to_numpy()
    return _BLOCKS[key]


def _drop_removed(batch: pa.Table, removal: Removal) -> pa.Table:
    if batch.num_rows == 0:
        return batch
    ids = batch.column(DOC_COLUMN).to_numpy()
    node = (np.int64(removal.priority) << np.int64(DOC_ID_BITS)) | ids.astype(np.int64)
    lo, hi = int(node.min()), int(node.max())
    blocks = [_removed_nodes(removal.refs[i]) for i in np.flatnonzero((removal.lows <= hi) & (removal.highs >= lo))]
    gone = removed_mask(node, blocks)
    return batch.filter(pa.array(~gone)) if gone.any() else batch


def removed_mask(node: np.ndarray, blocks: list[np.ndarray]) -> np.ndarray:
    """(len(node),) bool: which nodes one of the sorted arrays `blocks` holds."""
    gone = np.zeros(len(node), bool)
    for nodes in blocks:
        at = np.clip(np.searchsorted(nodes, node), 0, len(nodes) - 1)
        gone |= nodes[at] == node
    return gone


# ----------------------------------------------------------------------------------------------- the result
@dataclass
class DedupResult:
    """What a group's deduplication found: per source (by priority) its counts and its Removal."""

    spec: DedupSpec
    names: list[str]  # by priority
    read: np.ndarray  # (S,) documents read per source (usable ones: what the tokenizer would keep)
    removed: np.ndarray  # (S, S, 2) documents removed from source j because source i kept a copy, [i, j, kind]
    clusters: np.ndarray  # (S, 2) groups of duplicates kept by source i, [i, kind]
    removals: list[Removal]
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def removal(self, priority: int) -> Removal:
        return self.removals[priority]

    def record(self, priority: int) -> dict[str, Any]:
        """The manifest's `dedup` of one source: settings, counts, and the documents it shares with each other
        source (clusters holding documents of both, counted by the documents removed from either)."""
        i = priority
        shared = {self.names[j]: int(self.removed[i, j].sum() + self.removed[j, i].sum())
                  for j in range(len(self.names)) if j != i}
        return {**self.spec.to_dict(), "keep": self.spec.keep, "documents_read": int(self.read[i]),
                "removed_exact": int(self.removed[:, i, EXACT].sum()), "removed_near": int(self.removed[:, i, NEAR].sum()),
                "removed_as_copies_of_other_sources": int(self.removed[:, i].sum() - self.removed[i, i].sum()),
                "kept": int(self.read[i] - self.removed[:, i].sum()),
                "clusters_exact": int(self.clusters[i, EXACT]), "clusters_near": int(self.clusters[i, NEAR]),
                "group": list(self.names) if len(self.names) > 1 else [],
                "shared_with": {k: v for k, v in shared.items()},
                "seconds": round(self.seconds, 2), "stage_seconds": self.stage_seconds}


def _counts_rows(batch: pa.Table) -> pa.Table:
    """map_batches over removed rows: (keeper priority, own priority, kind) -> (rows, clusters), a few rows a block."""
    node, keeper = batch.column("node").to_numpy(), batch.column("keeper").to_numpy()
    kind, cluster = batch.column("kind").to_numpy(), batch.column("cluster").to_numpy()
    shift = np.int64(DOC_ID_BITS)
    key = ((keeper >> shift) * 256 + (node >> shift)) * 2 + kind
    uniq, inv = np.unique(key, return_inverse=True)
    return pa.table({"key": pa.array(uniq, pa.int64()), "rows": pa.array(np.bincount(inv), pa.int64()),
                     "clusters": pa.array(np.bincount(inv, weights=cluster).astype(np.int64))})


def _read_rows(batch: pa.Table) -> pa.Table:
    prio = batch.column("node").to_numpy() >> np.int64(DOC_ID_BITS)
    uniq, n = np.unique(prio, return_counts=True)
    return pa.table({"priority": pa.array(uniq, pa.int64()), "documents": pa.array(n, pa.int64())})


ONE_TASK_DOCS = 1 << 23  # a corpus of at most this many documents is deduplicated in a few plain Ray tasks after its
# signatures (pipeline/data/dedup_tasks.py: 24 bytes a document for its exact copies, 192 MiB; near halves it, ~40
# bytes a document in each band task) instead of hash shuffles, whose fixed costs (seconds of tasks and object
# transfers) outweighed the work up to that size; a larger corpus takes the shuffles, spread over the cluster


def _partitions(rows: int, row_bytes: int) -> int:
    """Hash partitions of a shuffle: ~PARTITION_BYTES each, at least one per CPU Ray has (up to 256)."""
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    return int(min(256, max(cpus, math.ceil(rows * row_bytes / PARTITION_BYTES))))


def deduplicate(sources: list[GroupSource], spec: DedupSpec, workers: int | None = None) -> DedupResult:
    """Deduplicate `sources` together (module docstring); Ray must be up. The sources' priorities are 0..S-1.
    `workers`: at most this many Ray Data tasks per stage and this many hash partitions, and the shuffles whatever
    the corpus's size (None: Ray Data's choice, partitions sized from the data, and a corpus of up to ONE_TASK_DOCS
    documents in plain Ray tasks); the result is the same either way."""
    import ray
    import ray.data

    from pipeline.data.corpus import read_documents

    if len(sources) > MAX_SOURCES:
        raise ValueError(f"data.dedup: {len(sources)} sources, at most {MAX_SOURCES} deduplicate together")
    t0, stages = time.perf_counter(), {}
    compute = ray.data.TaskPoolStrategy(size=workers) if workers else None
    cpus = int(ray.cluster_resources().get("CPU", 1))
    s = len(sources)
    params = spec.params if spec.mode == "near" else None
    parts = []
    for src in sorted(sources, key=lambda x: x.priority):
        ds = read_documents(src.data)
        ds.context.execution_options.preserve_order = False  # rows carry their ids: any order gives one result
        parts.append(ds.map_batches(_signature_rows, fn_kwargs={"priority": src.priority, "mode": spec.mode,
                                                                "params": params},
                                    batch_format="pyarrow", batch_size=_BATCH_DOCS, compute=compute))
    sigs = (parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]).materialize()
    stages["signatures_s"] = round(time.perf_counter() - t0, 2)
    if log.isEnabledFor(logging.DEBUG):  # Ray Data's per-operator times (bench/dedup_speed.py records them)
        log.debug("Ray Data, the signatures:\n%s", sigs.stats())
    docs = sigs.count()  # the materialized blocks' metadata: no pass over them
    if workers is None and docs <= (ONE_TASK_DOCS if spec.mode == "exact" else ONE_TASK_DOCS // 2):
        bands = spec.params.bands if spec.mode == "near" else 0
        removed_ref, read, info = find_removed(sigs.to_arrow_refs(), bands, spec.params.threshold, s, cpus)
        counts, clusters = counts_of(info, s)
        stages.update(info["stage_seconds"])
        blocks = [(*info["bounds"], removed_ref)]
    else:
        read, counts, clusters, blocks = _by_shuffles(sigs, spec, s, workers, compute, stages)
    del sigs
    removals = []
    shift = DOC_ID_BITS
    for p in range(s):
        lo_p, hi_p = p << shift, ((p + 1) << shift) - 1
        mine = [(lo, hi, r) for lo, hi, n, r in blocks if n and lo <= hi_p and hi >= lo_p]
        removals.append(Removal(p, np.array([m[0] for m in mine], np.int64), np.array([m[1] for m in mine], np.int64),
                                [m[2] for m in mine]))
    names = [src.name for src in sorted(sources, key=lambda x: x.priority)]
    result = DedupResult(spec, names, read, counts, clusters, removals, time.perf_counter() - t0, stages)
    log.info("dedup %s: %s", spec.mode, summary(result))
    return result


def _by_shuffles(sigs: "ray.data.Dataset", spec: DedupSpec, s: int, workers: int | None, compute, stages: dict
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """The path of a corpus too large for dedup_tasks.py (or of an explicit `workers`): exact copies by a hash shuffle
    on the exact hash, near copies by a shuffle of band rows on their key, components by large-star/small-star rounds
    (pipeline/data/dedup_components.py), the removed rows sorted by Ray Data. Returns (read, counts, clusters, removed
    blocks as (lowest node, highest node, rows, object reference))."""
    import ray

    def partitions(rows: int, row_bytes: int) -> int:
        return workers or _partitions(rows, row_bytes)

    t1 = time.perf_counter()
    read = np.zeros(s, np.int64)
    for row in sigs.map_batches(_read_rows, batch_format="pyarrow", batch_size=None).take_all():
        read[row["priority"]] += row["documents"]
    docs = int(read.sum())
    exact = by_partition(sigs.select_columns(["node", "ex_hi", "ex_lo"]), "ex_lo", partitions(docs, 24),
                         exact_removed, compute)
    removed_parts = [exact]
    if spec.mode == "near":
        k, b = spec.params.num_hashes, spec.params.bands
        bands = sigs.select_columns(["node", "ex_lo", "has_words", "bands", "sketch"]).map_batches(
            _band_rows, batch_format="pyarrow", batch_size=None, compute=compute)
        edges = by_partition(bands, "key", partitions(docs * b, 24 + k), bucket_edges, compute,
                             threshold=spec.params.threshold)
        stars = components(edges, partitions(docs, 32), compute)
        stages["near_components_s"] = round(time.perf_counter() - t1, 2)
        if stars.count():
            removed_parts.append(by_partition(stars, "lo", partitions(docs, 32), star_removed, compute))
    removed = (removed_parts[0].union(*removed_parts[1:]) if len(removed_parts) > 1 else removed_parts[0])
    removed = removed.sort("node").materialize()
    stages["removal_s"] = round(time.perf_counter() - t1, 2)
    counts = np.zeros((s, s, 2), np.int64)
    clusters = np.zeros((s, 2), np.int64)
    for row in removed.map_batches(_counts_rows, batch_format="pyarrow", batch_size=None).take_all():
        key, kind = divmod(row["key"], 2)
        keeper, own = divmod(key, 256)
        counts[keeper, own, kind] += row["rows"]
        clusters[keeper, kind] += row["clusters"]
    refs = removed.to_arrow_refs()
    bounds = ray.get([ray.remote(num_cpus=0)(_bounds).remote(r) for r in refs]) if refs else []
    return read, counts, clusters, [(lo, hi, n, r) for (lo, hi, n), r in zip(bounds, refs)]


def summary(result: DedupResult) -> str:
    """One line: documents read, removed as exact and as near copies, clusters."""
    r = result
    exact, near = int(r.removed[..., EXACT].sum()), int(r.removed[..., NEAR].sum())
    return (f"{int(r.read.sum()):,} documents read, {exact:,} removed as exact copies, {near:,} as near copies "
            f"({int(r.clusters[:, EXACT].sum()):,} + {int(r.clusters[:, NEAR].sum()):,} clusters) in {r.seconds:.1f} s")


def summary_line(record: dict[str, Any]) -> str:
    """The prepare summary's line of a dataset's manifest `dedup` record."""
    if not record:
        return "dedup none"
    near = (f", {record['removed_near']:,} as near copies (Jaccard >= {record['threshold']:g} of word "
            f"{record['ngram']}-grams, {record['bands']} bands x {record['rows']} rows)" if record["mode"] == "near"
            else "")
    others = record.get("removed_as_copies_of_other_sources", 0)
    return (f"dedup {record['mode']}: {record['documents_read']:,} documents read, {record['removed_exact']:,} removed "
            f"as exact copies{near}; {record['clusters_exact']:,} + {record['clusters_near']:,} clusters"
            + (f"; {others:,} were copies of documents another source keeps" if others else "")
            + f" ({record.get('seconds', 0):.1f} s)")


def mixture_dedup_line(record: dict[str, Any]) -> str:
    """The prepare summary's line of a mixture manifest's `dedup`: removed per source and shared per pair."""
    per = ", ".join(f"{n} {r['removed_exact']:,} exact + {r['removed_near']:,} near" for n, r in record["sources"].items())
    pairs = ", ".join(f"{p['sources'][0]}/{p['sources'][1]} {p['documents']:,}" for p in record["shared"]) or "none"
    return (f"dedup {record['mode']} across the sources (data.dedup_keep={record.get('keep', 'first')}): removed {per}; "
            f"documents shared by two sources: {pairs}")
