"""Deduplication after the signatures, in a few plain Ray tasks and no shuffle: the path of a corpus whose signatures
(materialized by Ray Data in the object store) one task can hold, ~24 bytes a document per band it reads.

    removed_ref, read, info = find_removed(signature_refs, bands=14, threshold=0.75, sources=1, tasks=4)

    exact task     every block's (node, ex_hi, ex_lo): the exact copies (pipeline/data/dedup_components.py
                   exact_removed), and the documents read per source
    band tasks     near only: the bands split over `tasks` tasks; per band, every document's key sorted, and only the
                   rows of keys two or more documents share (the candidates, a few per cent) go on: their pairs are
                   checked against the two sketches (bucket_pairs), the sketches read from the blocks for those
                   rows alone
    removal task   the checked edges' connected components (stars_in_one_task), every member but a component's
                   smallest removed; with the exact copies, one table sorted by node (what the tokenizing pass
                   drops), its counts (documents and clusters per pair of sources and kind) and its bounds

The tasks are submitted at once (the removal task takes the others' results as its arguments) and run side by side;
the driver gets the counts and one object reference. A band's hash shuffle across the cluster (the other path,
pipeline/data/dedup.py) would move the same rows at a fixed cost of seconds that a corpus of this size does not need.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.data.corpus import DOC_ID_BITS
from pipeline.data.dedup_components import (EXACT, bucket_pairs, edge_table, exact_removed, removed_table,
                                            star_removed, stars_in_one_task)


def _column(tables: list[pa.Table], name: str) -> np.ndarray:
    arrays = [t.column(name).to_numpy() for t in tables]
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int64)


def _matrix(table: pa.Table, name: str) -> np.ndarray:
    """A fixed-size-list column as an (rows, width) array: a view of the block's buffer, no copy."""
    width = table.schema.field(name).type.list_size
    return table.column(name).combine_chunks().flatten().to_numpy().reshape(-1, width)


def sorted_by_node(table: pa.Table) -> pa.Table:
    return table.take(pa.array(np.argsort(table.column("node").to_numpy(), kind="stable")))


# ----------------------------------------------------------------------------------------------- the tasks
def exact_rows(tables: list[pa.Table], sources: int) -> tuple[pa.Table, np.ndarray]:
    """(the exact copies' removed rows, documents read per source (S,)) over every signature block."""
    tables = [t.select(["node", "ex_hi", "ex_lo"]) for t in tables]
    if not tables:
        return removed_table(*(np.zeros(0, np.int64),) * 2, EXACT, np.zeros(0, bool)), np.zeros(sources, np.int64)
    rows = pa.concat_tables(tables)
    read = np.bincount(rows.column("node").to_numpy() >> np.int64(DOC_ID_BITS), minlength=sources)
    return exact_removed(rows), read.astype(np.int64)


def exact_task(refs: list, sources: int) -> tuple[pa.Table, np.ndarray]:
    """exact_rows of the signature blocks `refs` (a Ray task: they come from the object store, without a copy)."""
    import ray

    return exact_rows(ray.get(refs), sources)


def band_edges(tables: list[pa.Table], bands: list[int], threshold: float) -> pa.Table:
    """The checked edges (hi, lo) of these bands over every document with words of the signature blocks."""
    has = _column(tables, "has_words").astype(bool)
    rows = np.flatnonzero(has)  # a document's row in the blocks laid end to end
    node, ex = _column(tables, "node")[rows], _column(tables, "ex_lo")[rows]
    keys = [_matrix(t, "bands") for t in tables]
    sketches = [_matrix(t, "sketch") for t in tables]
    firsts = np.cumsum([0] + [t.num_rows for t in tables])

    def sketch_of(at: np.ndarray) -> np.ndarray:  # (len(at), K) uint8 of rows `at`, gathered block by block
        out = np.empty((len(at), sketches[0].shape[1] if sketches else 0), np.uint8)
        block = np.searchsorted(firsts, at, side="right") - 1
        for b in np.unique(block):
            sel = block == b
            out[sel] = sketches[b][at[sel] - firsts[b]]
        return out

    his, los = [], []
    for band in bands:
        key = np.concatenate([k[:, band] for k in keys])[rows] if keys else np.zeros(0, np.uint64)
        order = np.argsort(key)
        sorted_key = key[order]
        same = sorted_key[1:] == sorted_key[:-1]
        shared = np.zeros(len(key), bool)  # rows whose key another row has: the candidates
        shared[1:] |= same
        shared[:-1] |= same
        cand = order[shared]
        hi, lo = bucket_pairs(key[cand], node[cand], ex[cand], rows[cand], sketch_of, threshold)
        his.append(hi)
        los.append(lo)
    hi, lo = (np.concatenate(his), np.concatenate(los)) if his else (np.zeros(0, np.int64),) * 2
    return edge_table(hi, lo)


def band_task(refs: list, bands: list[int], threshold: float) -> pa.Table:
    """band_edges of the signature blocks `refs` (a Ray task)."""
    import ray

    return band_edges(ray.get(refs), bands, threshold)


def removal_task(exact: pa.Table, *edges: pa.Table) -> tuple[pa.Table, dict[str, Any]]:
    """Every removed document (exact and near) in one table sorted by node, and what the record needs of it: counts
    (keeper priority, own priority, kind) -> (documents, clusters), the table's node bounds, the edges and seconds."""
    t0 = time.process_time()
    parts = [exact]
    hi = np.concatenate([e.column("hi").to_numpy() for e in edges]) if edges else np.zeros(0, np.int64)
    lo = np.concatenate([e.column("lo").to_numpy() for e in edges]) if edges else np.zeros(0, np.int64)
    if len(hi):
        member, smallest = stars_in_one_task(hi, lo)
        parts.append(star_removed(edge_table(member, smallest)))
    removed = sorted_by_node(pa.concat_tables(parts))
    node, keeper = removed.column("node").to_numpy(), removed.column("keeper").to_numpy()
    kind, cluster = removed.column("kind").to_numpy(), removed.column("cluster").to_numpy()
    shift = np.int64(DOC_ID_BITS)
    key = ((keeper >> shift) * 256 + (node >> shift)) * 2 + kind
    uniq, inv = np.unique(key, return_inverse=True)
    counts = {"key": uniq.tolist(), "rows": np.bincount(inv).tolist(),
              "clusters": np.bincount(inv, weights=cluster).astype(np.int64).tolist()}
    bounds = (int(node[0]), int(node[-1]), len(node)) if len(node) else (0, -1, 0)
    return removed, {"counts": counts, "bounds": bounds, "edges": int(len(hi)),
                     "removal_task_cpu_s": round(time.process_time() - t0, 3)}


# ----------------------------------------------------------------------------------------------- the driver's part
def find_removed(refs: list, bands: int, threshold: float, sources: int, tasks: int
                 ) -> tuple[Any, np.ndarray, dict[str, Any]]:
    """Submit the tasks over the signature blocks `refs` (`bands` 0: exact copies only); returns (the removed table's
    object reference, documents read per source, the removal task's info with `stage_seconds`)."""
    import ray

    t0 = time.perf_counter()
    exact_ref, read_ref = ray.remote(exact_task).options(num_returns=2).remote(refs, sources)
    groups = np.array_split(np.arange(bands), max(1, min(tasks, bands))) if bands else []
    edge_refs = [ray.remote(band_task).remote(refs, g.tolist(), threshold) for g in groups]
    removed_ref, info_ref = ray.remote(removal_task).options(num_returns=2).remote(exact_ref, *edge_refs)
    ray.wait([exact_ref, *edge_refs], num_returns=1 + len(edge_refs), fetch_local=False)
    t1 = time.perf_counter()
    read, info = ray.get([read_ref, info_ref])
    info["stage_seconds"] = {"exact_and_bands_s": round(t1 - t0, 2),
                             "components_and_removal_s": round(time.perf_counter() - t1, 2)}
    return removed_ref, read, info


def counts_of(info: dict[str, Any], sources: int) -> tuple[np.ndarray, np.ndarray]:
    """((S, S, 2) documents removed from source j because source i kept a copy, (S, 2) clusters kept by source i)."""
    counts = np.zeros((sources, sources, 2), np.int64)
    clusters = np.zeros((sources, 2), np.int64)
    for key, rows, n_clusters in zip(info["counts"]["key"], info["counts"]["rows"], info["counts"]["clusters"]):
        key, kind = divmod(key, 2)
        keeper, own = divmod(key, 256)
        counts[keeper, own, kind] += rows
        clusters[keeper, kind] += n_clusters
    return counts, clusters
