"""What deduplication computes per document: an exact hash, a MinHash signature, its LSH band keys, and the check of
a candidate pair against the two signatures. Numpy and Numba (no Ray): the prepare stage (pipeline/data/dedup.py) runs it
inside Ray Data's map_batches, `validate` (pipeline/data/contamination.py) in one process.

    signer = Signer(DedupParams(threshold=0.75, ngram=5))
    sig = signer.sign(["a document ...", "another ..."])     # Signatures: exact (N, 2) uint64, minhash (N, K) uint32,
                                                             # bands (N, B) uint64, sketch (N, K) uint8
    estimate_jaccard(sig.sketch[0], sig.sketch[1])          # float, the check a candidate pair must pass

Normalisation (documented in docs/data.md#deduplication):
  exact   the cleaned text (what would be tokenized) with every run of whitespace made one space and the ends
          stripped; hashed with BLAKE2b to 128 bits (two uint64). Case, punctuation and Unicode form are kept: two
          documents are exact duplicates when they differ in spacing only.
  near    lowercased; words are maximal runs of Unicode word characters (Python's `\\w`), so punctuation and spacing
          do not count; shingles are the word n-grams (n = `ngram`, FineWeb's 5); a document of fewer than n words
          is one shingle of all its words. Word and shingle hashes are 64-bit (a polynomial hash of the UTF-8 bytes,
          then the splitmix64 finalizer), computed for a whole batch at once by one compiled kernel
          (pipeline/data/dedup_kernels.py): each shingle is hashed once, then all K hash functions run over it.

MinHash: K = bands x rows hash functions h_k(x) = (a_k * x + b_k mod 2^64) >> 32 with odd a_k (multiply-shift, a
universal family for 32-bit values), K minima per document. LSH: band j is rows consecutive minima hashed to one
64-bit key; two documents are candidates when any band key is equal. The banding follows the threshold
(`lsh_shape`): K = 112 hash functions as FineWeb, and the most rows per band whose candidate probability at the
threshold itself stays >= 0.75 (0.75 -> 14 bands x 8 rows, FineWeb's own). Candidates are checked against their
signatures: the 8-bit sketch (the low byte of each minimum: b-bit minwise hashing, Li & Koenig 2010) estimates the
Jaccard similarity, and only a pair whose estimate reaches the threshold is a duplicate. A pipeline that merges every
candidate merges about a fifth of the pairs at Jaccard 0.6 with 14 x 8; this check merges almost none.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

NUM_HASHES = 112  # FineWeb's 14 bands x 8 rows
MIN_CANDIDATE_PROBABILITY = 0.75  # LSH: a pair exactly at the threshold is a candidate at least this often
_SEED = 0x5EED_DED0  # fixed: the same corpus and settings give the same signatures on any machine
_WORD = re.compile(r"\W+")
_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer (uint64 in, uint64 out, elementwise): spreads a weak hash over all 64 bits."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def lsh_shape(threshold: float, num_hashes: int = NUM_HASHES) -> tuple[int, int]:
    """(bands, rows): the most rows per band (fewest candidates) whose probability of making a pair at Jaccard
    `threshold` a candidate, 1 - (1 - t^rows)^bands with bands = num_hashes // rows, stays >= 0.75."""
    best = (num_hashes, 1)
    for rows in range(1, num_hashes + 1):
        bands = num_hashes // rows
        if 1.0 - (1.0 - threshold ** rows) ** bands >= MIN_CANDIDATE_PROBABILITY:
            best = (bands, rows)
    return best


def candidate_probability(jaccard: float, bands: int, rows: int) -> float:
    """The chance that LSH with `bands` x `rows` makes a pair at this Jaccard similarity a candidate."""
    return 1.0 - (1.0 - jaccard ** rows) ** bands


@dataclass(frozen=True)
class DedupParams:
    """The settings that decide which documents are duplicates (they are part of the dataset's cache key)."""

    threshold: float = 0.75  # Jaccard similarity of word n-gram sets at and above which two documents are duplicates
    ngram: int = 5  # words per shingle

    @property
    def bands(self) -> int:
        return lsh_shape(self.threshold)[0]

    @property
    def rows(self) -> int:
        return lsh_shape(self.threshold)[1]

    @property
    def num_hashes(self) -> int:
        return self.bands * self.rows

    def to_dict(self) -> dict:
        return {"threshold": self.threshold, "ngram": self.ngram, "bands": self.bands, "rows": self.rows,
                "hash": "blake2b-128 exact; 64-bit polynomial+splitmix64 shingles; multiply-shift minhash; "
                        "8-bit sketch check"}


def exact_text(text: str) -> str:
    """The exact-duplicate normalisation: whitespace runs as one space, ends stripped."""
    return " ".join(text.split())


def exact_hashes(texts: Sequence[str], compiled: bool = False) -> np.ndarray:
    """(N, 2) uint64: BLAKE2b-128 of each text's exact normalisation, as (high, low) halves. `compiled`: normalise
    in one Numba kernel over the batch's bytes (pipeline/data/dedup_kernels.py; ~2x the Python's ~100 MB a
    CPU-second, the same bytes), for a process that loads Numba anyway (near deduplication). Exact deduplication
    alone does not: Numba's first call in a process costs ~0.5-0.9 CPU-seconds (LLVM's start-up, even from its
    cache), which a Ray worker would pay before it had hashed ~170 MB."""
    if compiled:
        from pipeline.data.dedup_kernels import exact_normalised, utf8_batch

        buf, starts, ends = exact_normalised(*utf8_batch(texts))
        view = memoryview(buf)
        pieces = (view[s:e] for s, e in zip(starts.tolist(), ends.tolist()))
    else:
        pieces = (exact_text(t).encode("utf-8", "surrogatepass") for t in texts)
    digests = b"".join([hashlib.blake2b(p, digest_size=16).digest() for p in pieces])
    return np.frombuffer(digests, ">u8").astype(np.uint64).reshape(len(texts), 2)


def near_words(text: str) -> str:
    """The near-duplicate normalisation: lowercased words (runs of `\\w`) joined by single spaces."""
    return _WORD.sub(" ", text.lower()).strip()


@dataclass
class Signatures:
    """One batch's signatures, row i for document i."""

    exact: np.ndarray  # (N, 2) uint64
    minhash: np.ndarray  # (N, K) uint32; all 0xFFFFFFFF for a document without words
    bands: np.ndarray  # (N, B) uint64
    sketch: np.ndarray  # (N, K) uint8: the low byte of each minimum
    has_words: np.ndarray  # (N,) bool: documents without a word take no part in near deduplication


class Signer:
    """Computes Signatures for batches of texts; the hash functions are fixed by _SEED and the params."""

    def __init__(self, params: DedupParams):
        self.params = params
        self.bands, self.rows = params.bands, params.rows
        k = self.bands * self.rows
        rng = np.random.Generator(np.random.PCG64(_SEED))
        self.a = rng.integers(0, 1 << 63, k, dtype=np.uint64) * _U64(2) + _U64(1)  # odd multipliers
        self.b = rng.integers(0, 1 << 63, k, dtype=np.uint64) * _U64(2)
        self.band_salt = rng.integers(0, 1 << 63, (self.bands, self.rows), dtype=np.uint64) | _U64(1)

    def sign(self, texts: Sequence[str], exact: np.ndarray | None = None) -> Signatures:
        """Signatures of `texts`; `exact`: their exact hashes when already computed. Words, shingles and all K
        MinHash functions of the whole batch run in one compiled kernel (pipeline/data/dedup_kernels.py)."""
        from pipeline.data.dedup_kernels import near_minhash, utf8_batch

        exact = exact_hashes(texts, compiled=True) if exact is None else exact
        minhash, has_words = near_minhash(utf8_batch([t.lower() for t in texts]), self.params.ngram, self.a, self.b)
        return Signatures(exact, minhash, self.band_keys(minhash), (minhash & 0xFF).astype(np.uint8), has_words)

    def band_keys(self, minhash: np.ndarray) -> np.ndarray:
        """(N, B) uint64: each band's `rows` minima hashed to one key, salted per band so bands never collide."""
        n = len(minhash)
        m = minhash.astype(np.uint64).reshape(n, self.bands, self.rows)
        key = np.zeros((n, self.bands), np.uint64)
        for r in range(self.rows):
            key = _splitmix64(key ^ (m[:, :, r] * self.band_salt[None, :, r]))
        return key


def estimate_jaccard(sketch_a: np.ndarray, sketch_b: np.ndarray) -> np.ndarray:
    """The Jaccard similarity estimated from two 8-bit sketches ((..., K) uint8): the share of equal bytes, less the
    1/256 chance that two different minima share their low byte (b-bit minwise hashing). Any leading shape."""
    equal = np.mean(sketch_a == sketch_b, axis=-1)
    return np.clip((equal - 1 / 256) / (1 - 1 / 256), 0.0, 1.0)


def shingle_set(text: str, ngram: int) -> set[tuple[str, ...]]:
    """The exact set of word n-grams of a text under the near normalisation (for tests and the benchmark's ground
    truth; the pipeline hashes them instead)."""
    words = near_words(text).split()
    if len(words) < ngram:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + ngram]) for i in range(len(words) - ngram + 1)}


def jaccard(a: str, b: str, ngram: int) -> float:
    """The true Jaccard similarity of two texts' shingle sets."""
    sa, sb = shingle_set(a, ngram), shingle_set(b, ngram)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0
