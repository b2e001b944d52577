"""Test-side oracles for cuda_ops.sampling, written independently of the module's reference (loops, numpy, fp64).

kept_set(...)       the support after temperature -> top-k -> top-p -> min-p, straight from the documented rules.
filtered_probs(...) the renormalised distribution on that support (fp64 softmax).
fragile_rows(...)   rows whose drawn token could legitimately differ between two correct implementations because
                    a sum or weight lands within `rel` of a decision boundary (the "fp ties" the module documents).
fewest_blocks(B, V) the fewest blocks the kernel's planner promises a (B, V) call, which the GPU test checks before
                    it draws (BENCHMARK_SHAPES); tests/cuda_ops/test_sampling.py holds the planner to it on CPU.
"""
from __future__ import annotations

import numpy as np
import torch

from cuda_ops.sampling import counter_uniform


BENCHMARK_SHAPES = [(1, 32000), (256, 128256), (3, 8000)]  # (B, V) of test_sampling_gpu.py's benchmark-shape test


def fewest_blocks(B: int, V: int) -> int:
    """Blocks (rows x splits) the planner promises (cuda_ops/sampling_kernel.py pick_splits): MIN_GRID in all, unless
    slices of at least MIN_SLICE entries or MAX_SPLITS blocks a row stop it first (1 x 32,000: 64, not 125)."""
    from cuda_ops.sampling_kernel import MAX_SPLITS, MIN_GRID, MIN_SLICE

    return min(MIN_GRID, B * min(MAX_SPLITS, max(1, V // MIN_SLICE)))


def _row(value, b):
    return float(value[b]) if np.ndim(value) else float(value)


def kept_set(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """(V,) logits -> (V,) bool support, computed with an fp64 softmax and an explicit sort."""
    x = np.asarray(logits_row, dtype=np.float64)
    V = x.size
    if temperature <= 0:
        keep = np.zeros(V, bool)
        keep[int(np.argmax(x))] = True
        return keep
    keep = np.ones(V, bool)
    if 0 < top_k < V:
        kth = np.sort(x)[::-1][int(top_k) - 1]
        keep &= x >= kth  # ties with the k-th value are kept
    if top_p < 1:
        w = np.exp((x - x.max()) / temperature) * keep
        order = np.argsort(-x, kind="stable")
        mass, need, n = 0.0, top_p * w.sum(), 0
        for n, i in enumerate(order):  # fewest leading tokens reaching p of the mass
            mass += w[i]
            if mass >= need:
                break
        keep &= x >= x[order[n]]
    if min_p > 0:
        p = np.exp((x - x.max()) / temperature)  # p_i / p_max
        keep &= p >= min_p
    return keep


def filtered_probs(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """(V,) logits -> (V,) fp64 probabilities renormalised on kept_set."""
    x = np.asarray(logits_row, dtype=np.float64)
    keep = kept_set(x, temperature, top_k, top_p, min_p)
    if temperature <= 0:
        return keep.astype(np.float64)
    w = np.exp((x - x.max()) / temperature) * keep
    return w / w.sum()


def fragile_rows(logits, temps, ks, ps, minps, seeds, steps, rel=1e-6) -> np.ndarray:
    """(B,) bool: rows where an fp difference of relative size `rel` could change the token (CDF boundary within
    rel of the target, top-p cumulative mass within rel of p * total, a weight within rel of min_p).

    Why 1e-6: both sides compute w = exp((l - m) / T) in fp32 with correctly rounded - and /, and exp within 1 ulp
    (torch CPU) or 2 ulp (CUDA expf); sums of nonnegative w in fp64 then differ by at most ~3 ulp of fp32 = 3.6e-7
    relative to the sum, and a single w by the same relative amount."""
    x = np.asarray(logits, dtype=np.float64)
    B, V = x.shape
    u = counter_uniform(torch.as_tensor(np.broadcast_to(seeds, (B,)).copy()),
                        torch.as_tensor(np.broadcast_to(steps, (B,)).copy())).numpy()
    out = np.zeros(B, bool)
    for b in range(B):
        T, k, p, q = _row(temps, b), int(_row(ks, b)), _row(ps, b), _row(minps, b)
        if T <= 0:
            continue
        w_all = np.exp((x[b] - x[b].max()) / T)
        keep_k = kept_set(x[b], T, k, 1.0, 0.0)
        if p < 1:
            wk = w_all * keep_k
            cum = np.cumsum(wk[np.argsort(-x[b], kind="stable")])
            out[b] |= np.min(np.abs(cum - p * cum[-1])) <= rel * cum[-1]
        if q > 0:
            out[b] |= np.any(np.abs(w_all - q) <= rel * q)
        w = w_all * kept_set(x[b], T, k, p, q)
        cum = np.cumsum(w)
        target = u[b] * cum[-1]
        boundaries = np.concatenate([[0.0], cum[w > 0]])
        out[b] |= np.min(np.abs(boundaries - target)) <= rel * cum[-1]
    return out
