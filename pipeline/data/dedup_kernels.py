"""Numba kernels of deduplication's per-document hashing, over a whole batch's UTF-8 bytes at once: the exact
normalisation, and the near signature (words, shingles, all the MinHash functions). No Python runs per word or per
shingle; pipeline/data/dedup_signatures.py defines what they compute and calls them.

    buf, starts, ends = utf8_batch(texts)                       # uint8 (bytes,), int64 (N,), int64 (N,)
    out, o_starts, o_ends = exact_normalised(buf, starts, ends)  # whitespace runs as one space, ends stripped
    minhash, has_words = near_minhash(utf8_batch([t.lower() for t in texts]), ngram, a, b)   # (N, K) uint32, (N,)

Characters are classified by one table over every code point (`char_classes`), built from Python's own definitions
so that the kernels split exactly as `str.split()` (whitespace) and `re`'s `\\w` (word characters) do.

Per shingle the MinHash loop is K multiply-add-shift-min steps over contiguous arrays, which LLVM vectorizes (8 lanes
of uint64 with AVX-512). Compiled once per machine (`cache=True`: the first process compiles, ~seconds; the others
load the cache, ~0.2 s).
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Sequence

import numpy as np
from numba import njit

SPACE, WORD = 1, 2  # bits of char_classes()
_P = np.uint64(0x100000001B3)  # the word hash's polynomial base (odd)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_ONE, _ZERO = np.uint64(1), np.uint64(0)


@lru_cache(maxsize=1)
def char_classes() -> np.ndarray:
    """(0x110000,) uint8 per code point: SPACE where str.isspace() (what str.split() splits on), WORD where `re`'s
    `\\w` matches (str.isalnum() or the underscore). ~0.1 s, once per process."""
    chars = np.arange(0x110000, dtype="<u4").tobytes().decode("utf-32-le", "surrogatepass")
    table = np.zeros(0x110000, np.uint8)
    for m in re.finditer(r"\s+", chars):
        table[m.start():m.end()] |= SPACE
    for m in re.finditer(r"\w+", chars):
        table[m.start():m.end()] |= WORD
    return table


def utf8_batch(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every text's UTF-8 bytes laid end to end (lone surrogates kept as their 3-byte forms), and where each starts
    and ends."""
    parts = [t.encode("utf-8", "surrogatepass") for t in texts]
    ends = np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)))
    buf = np.frombuffer(b"".join(parts), np.uint8)
    return buf, ends - np.fromiter(map(len, parts), np.int64, len(parts)), ends


@njit(cache=True, nogil=True)
def _mix(x):
    """The splitmix64 finalizer (uint64 -> uint64)."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


@njit(cache=True, nogil=True)
def _code_point(buf, i):
    """(code point, its byte length) of the UTF-8 sequence at buf[i] (the bytes come from Python's encoder: valid)."""
    b0 = np.int64(buf[i])
    if b0 < 0x80:  # ASCII: most of most corpora
        return b0, 1
    if b0 < 0xE0:
        return ((b0 & 0x1F) << 6) | (np.int64(buf[i + 1]) & 0x3F), 2
    if b0 < 0xF0:
        return ((b0 & 0x0F) << 12) | ((np.int64(buf[i + 1]) & 0x3F) << 6) | (np.int64(buf[i + 2]) & 0x3F), 3
    return (((b0 & 0x07) << 18) | ((np.int64(buf[i + 1]) & 0x3F) << 12) | ((np.int64(buf[i + 2]) & 0x3F) << 6)
            | (np.int64(buf[i + 3]) & 0x3F)), 4


@njit(cache=True, nogil=True)
def _exact_normalised(buf, starts, ends, classes, out, out_starts, out_ends):
    o = 0
    for d in range(len(starts)):
        out_starts[d] = o
        pending, seen = False, False
        i = starts[d]
        while i < ends[d]:
            cp, n = _code_point(buf, i)
            if classes[cp] & SPACE:
                pending = seen
            else:
                if pending:
                    out[o] = 32
                    o += 1
                    pending = False
                for j in range(n):
                    out[o] = buf[i + j]
                    o += 1
                seen = True
            i += n
        out_ends[d] = o


def exact_normalised(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each text's UTF-8 bytes as `" ".join(text.split())` has them: runs of whitespace one space, ends stripped."""
    out = np.empty(len(buf), np.uint8)
    out_starts, out_ends = np.empty(len(starts), np.int64), np.empty(len(starts), np.int64)
    _exact_normalised(buf, starts, ends, char_classes(), out, out_starts, out_ends)
    return out, out_starts, out_ends


@njit(cache=True, nogil=True)
def _near_minhash(buf, starts, ends, classes, ngram, a, b, words, shingles, minhash, has_words):
    k_all = len(a)
    mins = np.empty(k_all, np.uint64)
    for d in range(len(starts)):
        # the document's words: maximal runs of word characters, each hashed over its UTF-8 bytes
        nw, h, pw, length = 0, _ZERO, _ONE, 0
        i = starts[d]
        while i < ends[d]:
            cp, n = _code_point(buf, i)
            if classes[cp] & WORD:
                for j in range(n):
                    h = h + (np.uint64(buf[i + j]) + _ONE) * pw
                    pw = pw * _P
                length += n
            elif length:
                words[nw] = _mix(h ^ np.uint64(length))
                nw, h, pw, length = nw + 1, _ZERO, _ONE, 0
            i += n
        if length:
            words[nw] = _mix(h ^ np.uint64(length))
            nw += 1
        has_words[d] = nw > 0
        if nw == 0:
            continue
        width = ngram if nw >= ngram else nw  # a document of fewer words than n: one shingle of them all
        count = nw - width + 1
        for s in range(count):  # independent of each other: the CPU overlaps their chains of mixes
            acc = _ZERO
            for j in range(width):
                acc = _mix(acc ^ words[s + j]) + np.uint64(j + 1)
            shingles[s] = _mix(acc)
        mins[:] = np.uint64(0xFFFFFFFF)
        for s in range(count):
            x = shingles[s]
            for k in range(k_all):  # multiply-shift: the top 32 bits of a_k x + b_k (mod 2^64); vectorized over k
                v = (a[k] * x + b[k]) >> _S32
                mins[k] = min(mins[k], v)
        for k in range(k_all):
            minhash[d, k] = np.uint32(mins[k])


def near_minhash(batch: tuple[np.ndarray, np.ndarray, np.ndarray], ngram: int, a: np.ndarray, b: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(minhash (N, K) uint32, has_words (N,) bool) of lowercased texts' UTF-8 bytes (`utf8_batch`): per document the
    minimum over its shingles of each hash function h_k(x) = (a_k x + b_k mod 2^64) >> 32; all 0xFFFFFFFF for a
    document without a word."""
    buf, starts, ends = batch
    minhash = np.full((len(starts), len(a)), 0xFFFFFFFF, np.uint32)
    has_words = np.zeros(len(starts), np.bool_)
    longest = int((ends - starts).max()) if len(starts) else 0
    words = np.empty(longest // 2 + 1, np.uint64)  # a word and its separator take at least two bytes
    _near_minhash(buf, starts, ends, char_classes(), np.int64(ngram), a, b, words, np.empty_like(words), minhash,
                  has_words)
    return minhash, has_words
