"""Deduplication's parts on tiny inputs whose answers are known by hand: hashing and its normalisations, MinHash and
the LSH banding, the check of candidates against their signatures, exact groups, buckets, connected components, the
settings (one line each when bad) and the cache key. No Ray: the partition functions are fed one partition that holds
every row, which is what Ray Data's hash shuffle guarantees for each key."""
from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.data.dedup_components import (EXACT, NEAR, bucket_edges, both_ways, exact_removed, large_star,
                                            small_star, star_removed, stars_in_one_task)
from pipeline.data.dedup_signatures import (DedupParams, Signer, candidate_probability, estimate_jaccard,
                                            exact_hashes, jaccard, lsh_shape, near_words, shingle_set)

WORDS = [f"word{i}" for i in range(100)]


def text(words: list[str]) -> str:
    return " ".join(words)


# ----------------------------------------------------------------------------------------------- hashing
def test_exact_hash_ignores_spacing_only():
    a = "The cat sat.\n\nOn the  mat. "
    same = ["  The cat sat. On the mat.", "The\tcat sat.\r\nOn the mat."]
    other = ["the cat sat. On the mat.", "The cat sat, On the mat."]  # case and punctuation count
    h = exact_hashes([a, *same, *other])
    assert h.dtype == np.uint64 and h.shape == (5, 2)
    assert all((h[i] == h[0]).all() for i in (1, 2))
    assert not any((h[i] == h[0]).all() for i in (3, 4))


def test_near_words_lowercase_and_drop_punctuation():
    assert near_words("Hello, World!  It's 2024:\tfine_ok.") == "hello world it s 2024 fine_ok"
    assert near_words("...!?") == ""
    assert shingle_set("a b c", 5) == {("a", "b", "c")}  # fewer words than n: one shingle of them all
    assert shingle_set("", 5) == set()


def test_jaccard_of_one_changed_word_is_known_by_hand():
    """100 words, 5-grams: 96 shingles; changing word 50 changes the 5 shingles that hold it, so the two sets share
    91 and their union holds 96 + 5 = 101."""
    changed = list(WORDS)
    changed[50] = "other"
    assert jaccard(text(WORDS), text(changed), 5) == pytest.approx(91 / 101)
    assert jaccard(text(WORDS), text(WORDS), 5) == 1.0


def test_lsh_shape_is_finewebs_at_its_threshold_and_candidates_follow_the_s_curve():
    assert lsh_shape(0.75) == (14, 8)  # FineWeb: 14 bands x 8 hashes = 112
    assert candidate_probability(0.6, 14, 8) == pytest.approx(1 - (1 - 0.6 ** 8) ** 14)  # ~0.21, the figure
    assert round(candidate_probability(0.6, 14, 8), 2) == 0.21
    for t in (0.5, 0.75, 0.8, 0.9, 1.0):
        bands, rows = lsh_shape(t)
        assert bands * rows <= 112 and candidate_probability(t, bands, rows) >= 0.75
    assert lsh_shape(0.5)[1] < lsh_shape(0.9)[1]  # a lower threshold: fewer rows a band, more candidates


def test_signatures_of_equal_texts_are_equal_and_bands_tell_candidates():
    signer = Signer(DedupParams())
    changed = list(WORDS)
    changed[50] = "other"
    far = [f"else{i}" for i in range(100)]
    sig = signer.sign([text(WORDS), "  " + text(WORDS) + "\n", text(changed), text(far), "!!!", ""])
    assert sig.minhash.shape == (6, 112) and sig.bands.shape == (6, 14) and sig.sketch.shape == (6, 112)
    assert (sig.minhash[0] == sig.minhash[1]).all() and (sig.exact[0] == sig.exact[1]).all()
    assert sig.has_words.tolist() == [True, True, True, True, False, False]
    # J = 91/101 = 0.90: 0.90^8 = 0.43 per band, so some of 14 bands agree; a distinct text shares none
    assert (sig.bands[0] == sig.bands[2]).any() and not (sig.bands[0] == sig.bands[3]).any()
    est = estimate_jaccard(sig.sketch[0], sig.sketch[2])
    assert abs(est - 91 / 101) < 0.12  # 112 hashes: a standard error of ~0.03
    assert estimate_jaccard(sig.sketch[0], sig.sketch[3]) < 0.1


def test_signatures_do_not_depend_on_the_batch():
    signer = Signer(DedupParams())
    texts = [text(WORDS[i:i + 30]) for i in range(0, 60, 7)]
    whole = signer.sign(texts)
    one_by_one = [signer.sign([t]) for t in texts]
    assert all((whole.minhash[i] == s.minhash[0]).all() for i, s in enumerate(one_by_one))
    assert (Signer(DedupParams()).sign(texts).bands == whole.bands).all()  # a new worker: the same hash functions


_M64 = (1 << 64) - 1
TRICKY = ["Straße ΣΑΣ İstanbul café naïve — “quoted” x_y 1,000.5", "a\u00a0b\u2028c\x1cd\u3000e\u200bf",
          "emoji 😀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 words", "lone \ud800 surrogate", "one", "a b c", "\t\n ", "", "-- !! --",
          "e\u0301 combining", " ".join(WORDS[:40]), "CAPS Words MiXeD " * 7]


def _mix(x: int) -> int:
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 & _M64
    x ^= x >> 27
    x = x * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def _reference_minhash(text: str, signer: Signer, n: int) -> list[int] | None:
    """The near signature by its definition (dedup_signatures.py's docstring), one Python integer at a time."""
    words = re.findall(r"\w+", text.lower())
    if not words:
        return None
    hashes = []
    for w in words:
        h, pw, raw = 0, 1, w.encode("utf-8", "surrogatepass")
        for byte in raw:
            h, pw = (h + (byte + 1) * pw) & _M64, pw * 0x100000001B3 & _M64
        hashes.append(_mix(h ^ len(raw)))
    width = min(n, len(hashes))
    shingles = []
    for i in range(len(hashes) - width + 1):
        acc = 0
        for j in range(width):
            acc = (_mix(acc ^ hashes[i + j]) + j + 1) & _M64
        shingles.append(_mix(acc))
    return [min(((int(a) * x + int(b)) & _M64) >> 32 for x in shingles) for a, b in zip(signer.a, signer.b)]


@pytest.mark.parametrize("ngram", [5, 2])
def test_the_compiled_signatures_are_their_definition(ngram):
    """The Numba kernels (pipeline/data/dedup_kernels.py) against the definitions written out in Python: words as
    `re`'s \\w finds them in the lowercased text, whitespace as str.split() finds it, including Unicode's."""
    import hashlib

    signer = Signer(DedupParams(ngram=ngram))
    sig = signer.sign(TRICKY)
    for i, t in enumerate(TRICKY):
        want = _reference_minhash(t, signer, ngram)
        assert sig.has_words[i] == (want is not None), t
        assert sig.minhash[i].tolist() == (want or [0xFFFFFFFF] * 112), t
        digest = hashlib.blake2b(" ".join(t.split()).encode("utf-8", "surrogatepass"), digest_size=16).digest()
        assert sig.exact[i].tolist() == np.frombuffer(digest, ">u8").tolist(), t
    assert (exact_hashes(TRICKY) == sig.exact).all()  # exact deduplication's own path, without Numba
    every_space = "".join(chr(c) for c in range(0x110000) if chr(c).isspace())
    spaced = [f"{every_space}a{every_space}b{every_space}", "", *[f"x{ch}y" for ch in every_space]]
    assert (exact_hashes(spaced, compiled=True) == exact_hashes(spaced)).all()
    assert (sig.sketch == (sig.minhash & 0xFF)).all()


def test_the_kernels_classify_every_code_point_as_python_does():
    from pipeline.data.dedup_kernels import SPACE, WORD, char_classes

    table = char_classes()
    assert np.flatnonzero(table & SPACE).tolist() == [c for c in range(0x110000) if chr(c).isspace()]
    sample = list(range(0, 0x110000, 7)) + [0x5F, 0x2028, 0x200B, 0x0301, 0x1D518]
    assert [bool(table[c] & WORD) for c in sample] == [re.fullmatch(r"\w", chr(c)) is not None for c in sample]


# ----------------------------------------------------------------------------------------------- exact groups
def test_exact_groups_keep_the_smallest_node_and_count_each_group_once():
    part = pa.table({"node": pa.array([7, 3, 5, 9, 2, 8], pa.int64()),
                     "ex_hi": pa.array([1, 1, 1, 2, 3, 3], pa.uint64()),
                     "ex_lo": pa.array([10, 10, 10, 20, 30, 30], pa.uint64())})
    out = exact_removed(part).to_pydict()
    # groups {7, 3, 5} kept by 3; {9} alone; {2, 8} kept by 2
    assert sorted(zip(out["node"], out["keeper"])) == [(5, 3), (7, 3), (8, 2)]
    assert set(out["kind"]) == {EXACT} and sum(out["cluster"]) == 2


# ----------------------------------------------------------------------------------------------- buckets
def _band_rows(rows: list[tuple[int, int, int, list[int]]]) -> pa.Table:
    k = len(rows[0][3])
    return pa.table({"key": pa.array([r[0] for r in rows], pa.uint64()), "node": pa.array([r[1] for r in rows], pa.int64()),
                     "ex_lo": pa.array([r[2] for r in rows], pa.uint64()),
                     "sketch": pa.FixedSizeListArray.from_arrays(pa.array([b for r in rows for b in r[3]], pa.uint8()), k)})


def test_a_bucket_checks_its_candidates_against_their_sketches():
    """Bucket 1: nodes 4 and 6 agree on 100 of 112 sketch bytes (estimate ~0.89), node 9 on 50 (~0.44); node 12 is
    an exact copy of 4 (same exact hash): it counts as 4. Bucket 2: one document, no pair."""
    base = list(range(112))
    near = base[:100] + [200 + i for i in range(12)]
    far = base[:50] + [150 + i for i in range(62)]
    part = _band_rows([(1, 6, 60, near), (1, 4, 40, base), (1, 9, 90, far), (1, 12, 40, base), (2, 5, 50, base)])
    out = bucket_edges(part, 0.75).to_pydict()
    assert list(zip(out["hi"], out["lo"])) == [(6, 4)]
    assert bucket_edges(part, 0.4).num_rows == 3  # every pair of 4, 6, 9 passes a lower threshold


def test_a_large_bucket_is_checked_linearly_and_still_links_its_chain():
    sk = list(range(112))
    part = _band_rows([(7, n, n, sk) for n in range(1, 41)])  # 40 identical sketches, 40 distinct texts
    out = bucket_edges(part, 0.75).to_pydict()
    assert len(out["hi"]) == 39 + 38  # each against the smallest, and each against the one before: not 780 pairs
    assert set(out["lo"]) >= {1} and all(h > lo for h, lo in zip(out["hi"], out["lo"]))


# ----------------------------------------------------------------------------------------------- components
def _components(edges: list[tuple[int, int]]) -> dict[int, int]:
    """The Ray loop (pipeline/data/dedup_components.py components) with one partition: node -> its component's
    smallest node."""
    cur = pa.table({"hi": pa.array([max(e) for e in edges], pa.int64()), "lo": pa.array([min(e) for e in edges], pa.int64())})
    for _ in range(64):
        big = large_star(both_ways(cur))
        if sum(big.column("mixed").to_pylist()) == 0:
            out = star_removed(big.select(["hi", "lo"])).to_pydict()
            assert set(out["kind"]) == {NEAR}
            return dict(zip(out["node"], out["keeper"]))
        cur = small_star(big.select(["hi", "lo"]))
    raise AssertionError("no convergence")


@pytest.mark.parametrize("edges, expected", [
    ([(1, 2), (2, 3), (3, 4), (4, 5)], {2: 1, 3: 1, 4: 1, 5: 1}),  # a chain
    ([(5, 1), (5, 2)], {2: 1, 5: 1}),  # two smaller neighbours: not a star yet
    ([(10, 11), (20, 21), (21, 22), (11, 12)], {11: 10, 12: 10, 21: 20, 22: 20}),  # two components
    ([(9, 8), (8, 7), (7, 6), (6, 1), (3, 9)], {3: 1, 6: 1, 7: 1, 8: 1, 9: 1}),  # a path through a larger node
])
def test_components_label_every_node_with_its_components_smallest(edges, expected):
    assert _components(edges) == expected


def test_components_of_a_random_graph_match_union_find():
    rng = np.random.default_rng(3)
    edges = [tuple(int(x) for x in rng.choice(200, 2, replace=False)) for _ in range(150)]
    parent = list(range(200))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    expected = {n: find(n) for n in {x for e in edges for x in e} if find(n) != n}
    assert _components(edges) == expected
    hi, lo = np.array([max(e) for e in edges]), np.array([min(e) for e in edges])
    member, smallest = stars_in_one_task(hi, lo)  # what a graph small enough for one task gets
    assert dict(zip(member.tolist(), smallest.tolist())) == expected


def _union_find_clusters(edges: list[tuple[int, int]]) -> tuple[dict[int, int], int]:
    """node -> its component's smallest node (for every node but the smallest), and the number of components."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    label = {n: find(n) for n in parent}
    return {n: r for n, r in label.items() if n != r}, len(set(label.values()))


@pytest.mark.parametrize("edges", [
    [(3, 1), (5, 3), (4, 2)],  # a chain 1-3-5 and a pair 2-4: 2 clusters (star_removed once counted 3)
    [(2, 1), (3, 2), (4, 3), (5, 4), (6, 5)],  # one chain of six: 1 cluster
    [(11, 10), (12, 11), (21, 20), (22, 20), (23, 22), (31, 30), (9, 1), (8, 9)],  # four clusters, chains and stars
    [(7, 1), (6, 2), (5, 3), (8, 7), (8, 6), (9, 5)],  # two chains joined through 8 (1-7-8-6-2) and 3-5-9
])
def test_clusters_are_counted_as_connected_components(edges):
    """The record's clusters_near: one per connected component of the checked edges, whichever way the components
    are found (in one task, or by the large-star/small-star rounds), whatever order the edges come in."""
    expected, clusters = _union_find_clusters(edges)
    for order in (edges, edges[::-1], sorted(edges)):
        hi, lo = np.array([max(e) for e in order]), np.array([min(e) for e in order])
        member, smallest = stars_in_one_task(hi, lo)
        out = star_removed(pa.table({"hi": member, "lo": smallest})).to_pydict()
        assert dict(zip(out["node"], out["keeper"])) == expected
        assert sum(out["cluster"]) == clusters, (order, out)
    assert _components(edges) == expected


def test_star_removed_counts_each_centre_once_in_any_row_order():
    """Rows of one partition by centre, members interleaved across centres (sorted by member): two clusters."""
    part = pa.table({"hi": pa.array([3, 4, 5, 6], pa.int64()), "lo": pa.array([1, 2, 1, 2], pa.int64())})
    out = star_removed(part).to_pydict()
    assert sum(out["cluster"]) == 2 and sorted(zip(out["node"], out["keeper"])) == [(3, 1), (4, 2), (5, 1), (6, 2)]


# ----------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("override, message", [
    ({"data.dedup": "fuzzy"}, "data.dedup='fuzzy' is not allowed; choose one of: none, exact, near"),
    ({"data.dedup_threshold": 0.0}, "data.dedup_threshold=0.0 is invalid; it must be in (0, 1]"),
    ({"data.dedup_threshold": 1.5}, "data.dedup_threshold=1.5 is invalid; it must be in (0, 1]"),
    ({"data.dedup_ngram": 0}, "data.dedup_ngram=0 is invalid; it must be >= 1"),
    ({"data.dedup_keep": "last"}, "data.dedup_keep='last' is not allowed; choose one of: first, weight"),
])
def test_a_bad_setting_is_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("cpu", override)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_cache_key_holds_the_settings_and_none_keeps_the_old_key(tmp_path):
    from pipeline.data.pack import dataset_settings, settings_hash

    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    source = {"data.source": "files", "data.path": str(tmp_path / "a.jsonl")}

    def key(**over):
        return settings_hash(dataset_settings(load_config("test", {**source, **{f"data.{k}": v
                                                                              for k, v in over.items()}})))

    none = dataset_settings(load_config("test", {**source, "data.dedup": "none"}))
    assert "dedup" not in none  # datasets prepared before deduplication keep their hash
    keys = {key(dedup="none"), key(dedup="exact"), key(dedup="near"), key(dedup="near", dedup_threshold=0.8),
            key(dedup="near", dedup_ngram=3)}
    assert len(keys) == 5
    assert key(dedup="exact", dedup_threshold=0.8) == key(dedup="exact")  # exact reads no threshold


def test_the_exact_copies_in_one_task_are_those_of_the_partitions_sorted_by_node():
    """pipeline/data/dedup_tasks.py (a corpus of up to ONE_TASK_DOCS) runs exact_removed on every row at once and
    sorts the result: the same rows as the hash partitions give, each partition on its own, merged and sorted."""
    from pipeline.data.dedup_components import exact_removed
    from pipeline.data.dedup_tasks import sorted_by_node as _sorted

    rng = np.random.default_rng(0)
    node = rng.permutation(1000).astype(np.int64)
    hi = rng.integers(0, 40, 1000).astype(np.uint64)  # many equal texts
    lo = (hi * np.uint64(7)) % np.uint64(13)
    rows = pa.table({"node": node, "ex_hi": hi, "ex_lo": lo})
    whole = _sorted(exact_removed(rows))
    parts = [exact_removed(rows.filter(pa.array(lo % np.uint64(3) == p))) for p in range(3)]
    merged = _sorted(pa.concat_tables(parts))
    assert whole.equals(merged) and whole.num_rows == 1000 - len(np.unique(np.stack([hi, lo]), axis=1).T)
    assert np.all(np.diff(whole.column("node").to_numpy()) > 0)
