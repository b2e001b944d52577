"""Duplicate groups, LSH buckets and connected components, one hash partition at a time (numpy), and the loop that
runs the components on Ray Data without collecting the graph anywhere.

    exact_removed(part)      rows of one partition of (node, ex_hi, ex_lo) -> the exact copies to remove
    bucket_edges(part, t)    rows of one partition of band rows (key, node, ex_lo, sketch) -> checked edges (hi, lo)
    components(edges, parts) a Ray Dataset of edges -> a Ray Dataset of stars (hi = a member, lo = its component's
                             smallest node), by alternating large-star and small-star (Kiveris et al., SoCC 2014)

A node is an int64 that orders the documents by who keeps what: (source priority << 56) | the document's id inside
its source (pipeline/data/dedup.py). The smallest node of a group is kept, so "the first occurrence in the corpus's
order, and the source the rule prefers" is the minimum, and a component's label (its minimum) is its keeper.

Partitions come from Ray Data's hash shuffle (`groupby(part).map_groups`, one call per partition): every function here
sees every row of its keys at once and no Python call is made per document or per group.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from pipeline.data.dedup_signatures import estimate_jaccard

if TYPE_CHECKING:
    import ray.data

EXACT, NEAR = 0, 1  # the `kind` of a removed row
ALL_PAIRS_UP_TO = 32  # a bucket of more documents checks each against its smallest and its neighbour in order only
MAX_ROUNDS = 64  # large-star/small-star rounds; O(log^2 n) in theory, a handful on duplicate clusters
ONE_TASK_EDGES = 1 << 22  # a graph of at most this many checked edges (64 MiB) is solved in one task
_REMOVED_SCHEMA = pa.schema([("node", pa.int64()), ("keeper", pa.int64()), ("kind", pa.int8()),
                             ("cluster", pa.int8())])
_EDGE_SCHEMA = pa.schema([("hi", pa.int64()), ("lo", pa.int64())])


def removed_table(node: np.ndarray, keeper: np.ndarray, kind: int, first_of_cluster: np.ndarray) -> pa.Table:
    """Rows (node, keeper, kind, cluster): `cluster` is 1 on one row per group of duplicates, so summing it counts
    the groups without another shuffle."""
    return pa.table([pa.array(node, pa.int64()), pa.array(keeper, pa.int64()),
                     pa.array(np.full(len(node), kind, np.int8)), pa.array(first_of_cluster.astype(np.int8))],
                    schema=_REMOVED_SCHEMA)


def edge_table(hi: np.ndarray, lo: np.ndarray) -> pa.Table:
    return pa.table([pa.array(hi, pa.int64()), pa.array(lo, pa.int64())], schema=_EDGE_SCHEMA)


def _col(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy()


def _group_starts(sorted_keys: list[np.ndarray]) -> np.ndarray:
    """Indices where a new group starts in rows sorted by `sorted_keys` (a group: equal in every key)."""
    n = len(sorted_keys[0])
    change = np.zeros(n, bool)
    if n:
        change[0] = True
        for k in sorted_keys:
            change[1:] |= k[1:] != k[:-1]
    return np.flatnonzero(change)


# ----------------------------------------------------------------------------------------------- exact copies
def exact_removed(part: pa.Table) -> pa.Table:
    """Every document whose exact hash an earlier node already has: removed, kept by the group's smallest node."""
    node, hi, lo = _col(part, "node"), _col(part, "ex_hi"), _col(part, "ex_lo")
    order = np.lexsort((node, lo, hi))
    node, hi, lo = node[order], hi[order], lo[order]
    starts = _group_starts([hi, lo])
    sizes = np.diff(np.append(starts, len(node)))
    keeper = np.repeat(node[starts], sizes)
    drop = node != keeper
    first = np.zeros(len(node), bool)
    first[starts[sizes > 1] + 1] = True  # the first copy after the keeper: one row per group
    return removed_table(node[drop], keeper[drop], EXACT, first[drop])


# ----------------------------------------------------------------------------------------------- LSH buckets
def bucket_edges(part: pa.Table, threshold: float) -> pa.Table:
    """`bucket_pairs` of one hash partition of band rows (key, node, ex_lo, sketch) as edges (hi, lo)."""
    key, node, ex = _col(part, "key"), _col(part, "node"), _col(part, "ex_lo")
    k = part.schema.field("sketch").type.list_size
    sketch = part.column("sketch").combine_chunks().flatten().to_numpy().reshape(-1, k)
    return edge_table(*bucket_pairs(key, node, ex, np.arange(len(key)), sketch.__getitem__, threshold))


def bucket_pairs(key: np.ndarray, node: np.ndarray, ex: np.ndarray, rows: np.ndarray, sketch_of,
                 threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Candidate pairs of each band bucket (rows with one key), checked against their signatures: an edge (hi, lo)
    when the sketches' estimated Jaccard similarity reaches `threshold`. Every bucket's rows must be there (a hash
    partition, or only the rows of buckets of two or more). `rows`: each row's index for `sketch_of(rows) -> (len,
    K) uint8`. Exact copies in a bucket count once (by their smallest node: the copies themselves are the exact
    stage's). A bucket of up to ALL_PAIRS_UP_TO documents checks every pair; a larger one (boilerplate shared by many
    pages) each document against the bucket's smallest and against the one before it, which keeps it linear and
    still links every chain of near copies."""
    order = np.lexsort((node, ex, key))
    key, node, ex, rows = key[order], node[order], ex[order], rows[order]
    reps = _group_starts([key, ex])  # the smallest node of each exact text in each bucket
    key, node, rows = key[reps], node[reps], rows[reps]
    starts = _group_starts([key])
    sizes = np.diff(np.append(starts, len(key)))
    a_idx, b_idx = [], []
    pairs = starts[sizes == 2]  # most buckets with a pair hold two documents: all of them at once
    a_idx.append(pairs)
    b_idx.append(pairs + 1)
    for s, m in zip(starts[sizes > 2], sizes[sizes > 2]):
        if m <= ALL_PAIRS_UP_TO:
            i, j = np.triu_indices(m, 1)
        else:
            i = np.concatenate([np.zeros(m - 1, np.int64), np.arange(1, m - 1)])
            j = np.concatenate([np.arange(1, m), np.arange(2, m)])
        a_idx.append(s + i)
        b_idx.append(s + j)
    a, b = np.concatenate(a_idx).astype(np.int64), np.concatenate(b_idx).astype(np.int64)
    ok = estimate_jaccard(sketch_of(rows[a]), sketch_of(rows[b])) >= threshold if len(a) else np.zeros(0, bool)
    a, b = node[a[ok]], node[b[ok]]
    return np.maximum(a, b), np.minimum(a, b)


# ----------------------------------------------------------------------------------------------- components
def _unique_edges(part: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    hi, lo = _col(part, "hi"), _col(part, "lo")
    order = np.lexsort((lo, hi))
    hi, lo = hi[order], lo[order]
    keep = _group_starts([hi, lo])
    return hi[keep], lo[keep]


def large_star(part: pa.Table) -> pa.Table:
    """One partition of directed rows (a, b) (every edge both ways, partitioned by a): each node a links its larger
    neighbours, and itself, to m = the smallest of a and its neighbours. `mixed` marks the rows of a node that has
    both smaller and larger neighbours or more than one smaller: none in the whole graph means it is a forest of
    stars around each component's minimum (done)."""
    a, b = _col(part, "a"), _col(part, "b")
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    starts = _group_starts([a])
    sizes = np.diff(np.append(starts, len(a)))
    nodes = a[starts]
    m = np.minimum(np.minimum.reduceat(b, starts), nodes)  # (groups,)
    smaller = np.add.reduceat((b < a).astype(np.int64), starts)
    larger = np.add.reduceat((b > a).astype(np.int64), starts)
    mixed = ((smaller > 0) & (larger > 0)) | (smaller > 1)
    m_row, mixed_row = np.repeat(m, sizes), np.repeat(mixed, sizes)
    up = b > a
    own = nodes != m  # the node's own link to its minimum
    hi = np.concatenate([b[up], nodes[own]])
    lo = np.concatenate([m_row[up], m[own]])
    flag = np.concatenate([mixed_row[up], mixed[own]])
    return pa.table({"hi": pa.array(hi, pa.int64()), "lo": pa.array(lo, pa.int64()),
                     "mixed": pa.array(flag.astype(np.int8))})


def small_star(part: pa.Table) -> pa.Table:
    """One partition of edges (hi, lo) partitioned by hi: each node u and its smaller neighbours N are linked to
    m = min(N)."""
    hi, lo = _unique_edges(part)
    starts = _group_starts([hi])
    sizes = np.diff(np.append(starts, len(hi)))
    m_row = np.repeat(np.minimum.reduceat(lo, starts), sizes)
    others = lo != m_row
    new_hi = np.concatenate([hi[starts], lo[others]])
    new_lo = np.concatenate([m_row[starts], m_row[others]])
    return edge_table(new_hi, new_lo)


def star_removed(part: pa.Table) -> pa.Table:
    """Converged stars partitioned by their centre (lo): every member but the centre is removed, kept by it; one row
    per centre has `cluster` 1, so the clusters counted are the connected components (a chain A-B-C is one)."""
    hi, lo = _unique_edges(part)
    order = np.lexsort((hi, lo))  # by centre: each centre's members in one run
    hi, lo = hi[order], lo[order]
    starts = _group_starts([lo])
    first = np.zeros(len(hi), bool)
    first[starts] = True
    return removed_table(hi, lo, NEAR, first)


def both_ways(batch: pa.Table) -> pa.Table:
    hi, lo = _col(batch, "hi"), _col(batch, "lo")
    return pa.table({"a": pa.array(np.concatenate([hi, lo]), pa.int64()),
                     "b": pa.array(np.concatenate([lo, hi]), pa.int64())})


def with_partition(batch: pa.Table, column: str, parts: int) -> pa.Table:
    """The batch with a `part` column: a hash of `column` modulo `parts` (the key Ray Data's shuffle groups by)."""
    from pipeline.data.dedup_signatures import _splitmix64

    x = batch.column(column).to_numpy().astype(np.uint64)
    return batch.append_column("part", pa.array((_splitmix64(x) % np.uint64(parts)).astype(np.int32)))


def by_partition(ds: "ray.data.Dataset", column: str, parts: int, fn, compute=None, **fn_kwargs) -> "ray.data.Dataset":
    """fn over each hash partition of ds by `column` (all rows of a key in one call; `part` dropped first).
    `compute`: Ray Data's compute strategy of the two maps (None: as many tasks as Ray Data likes)."""
    keyed = ds.map_batches(with_partition, fn_kwargs={"column": column, "parts": parts}, batch_format="pyarrow",
                           batch_size=None, compute=compute)
    return keyed.groupby("part", num_partitions=parts).map_groups(
        _without_part, fn_kwargs={"fn": fn, "kwargs": fn_kwargs}, batch_format="pyarrow", compute=compute)


def _without_part(part: pa.Table, fn, kwargs: dict) -> pa.Table:
    return fn(part.drop_columns(["part"]), **kwargs)


def stars_in_one_task(hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same stars as `components`, computed at once (numpy min-label propagation with pointer jumping) for a
    graph small enough to hold: (member, smallest node of its component) for every member but the smallest."""
    nodes, inv = np.unique(np.concatenate([hi, lo]), return_inverse=True)
    a, b = inv[:len(hi)], inv[len(hi):]
    label = np.arange(len(nodes))
    while True:
        new = label.copy()
        np.minimum.at(new, a, label[b])
        np.minimum.at(new, b, label[a])
        new = new[new]  # pointer jumping: follow the label's own label
        if np.array_equal(new, label):
            break
        label = new
    member = label != np.arange(len(nodes))
    return nodes[member], nodes[label[member]]


def _stars_task(refs: list) -> pa.Table:
    import ray

    tables = [ray.get(r) for r in refs]
    hi = np.concatenate([t.column("hi").to_numpy() for t in tables]) if tables else np.zeros(0, np.int64)
    lo = np.concatenate([t.column("lo").to_numpy() for t in tables]) if tables else np.zeros(0, np.int64)
    return edge_table(*stars_in_one_task(hi, lo))


def components(edges: "ray.data.Dataset", parts: int, compute=None) -> "ray.data.Dataset":
    """Stars (hi = a node, lo = the smallest node of its component) of the graph `edges` (hi > lo), materialized.
    A graph of at most ONE_TASK_EDGES edges (~16 bytes each: the duplicate pairs, not the documents) is solved in one
    Ray task. A larger one in rounds: each a large-star (a hash shuffle by node over both directions) and, unless that
    found the graph already a forest of stars, a small-star (a shuffle by hi); only a per-round count reaches the
    driver. Both give the same stars (tests/pipeline/data/test_dedup.py)."""
    import ray
    import ray.data

    current = edges.materialize()
    if current.count() <= ONE_TASK_EDGES:
        stars = ray.remote(_stars_task).remote(current.to_arrow_refs())
        return ray.data.from_arrow_refs([stars]).materialize()
    for _ in range(MAX_ROUNDS):
        if current.count() == 0:
            return current
        big = by_partition(current.map_batches(both_ways, batch_format="pyarrow", batch_size=None, compute=compute),
                           "a", parts, large_star, compute).materialize()
        if int(big.sum("mixed") or 0) == 0:
            return big.select_columns(["hi", "lo"]).materialize()
        current = by_partition(big.select_columns(["hi", "lo"]), "hi", parts, small_star, compute).materialize()
    raise RuntimeError(f"connected components did not converge in {MAX_ROUNDS} rounds")
