"""Sampling Numba kernel under the CUDA simulator: the cases, and (run as a script) the kernel's tokens for them.

Run by tests/cuda_ops/test_sampling_cudasim.py in a subprocess (NUMBA_ENABLE_CUDASIM=1 must be set before numba is
imported); the assertions live there, against the torch reference. By hand:

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python tests/cuda_ops/cudasim_sampling.py

Prints one JSON object {case name: [token per row] | "error: traceback"}. The simulator runs every GPU thread as a
Python thread, so shapes are tiny, blocks small (8-16 threads) and the buckets per round few (4 or 8, so searches
take several rounds); rows are split over 2-4 blocks in most cases, so merges across blocks are exercised. Two
cases run the whole fixed launch sequence (finished rows idling through the rest, as on the GPU); the others stop
once every row is done, which only saves the simulator's time.
Importing this file only needs numpy.
"""
from __future__ import annotations

import numpy as np

PARAMS = ("temps", "ks", "ps", "minps", "seeds", "steps")


def _case(logits, block, temps=1.0, ks=0, ps=1.0, minps=0.0, seeds=0, steps=0, splits=1, nb=8, until_done=True):
    B = logits.shape[0]
    row = lambda v, dt: np.array(np.broadcast_to(np.asarray(v, dtype=dt), (B,)))  # noqa: E731
    return dict(logits=np.ascontiguousarray(logits, dtype=np.float32), block=block, splits=splits, nb=nb,
                until_done=until_done,
                temps=row(temps, np.float32), ks=row(ks, np.int64), ps=row(ps, np.float32),
                minps=row(minps, np.float32), seeds=row(seeds, np.int64), steps=row(steps, np.int64))


def cases() -> dict[str, dict]:
    rng = np.random.default_rng(1234)
    out = {}
    # one row per setting; V=200 is not a multiple of the block
    x = rng.normal(size=(4, 200)) * 3
    out["mixed"] = _case(x, 16, temps=[0.0, 1.0, 0.7, 1.3], ks=[0, 10, 0, 50], ps=[1.0, 1.0, 0.9, 0.8],
                         minps=[0.0, 0.0, 0.05, 0.02], seeds=[1, 2, 3, -4], steps=[0, 3, 5, 2**33], splits=3, nb=4, until_done=False)
    # repeated values: the k-th value and the top-p threshold fall inside tied groups
    t = np.tile(rng.integers(-3, 3, size=100).astype(np.float64), (8, 1))
    out["ties"] = _case(t, 16, temps=[1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 0.8, 1.0], ks=[3, 10, 0, 0, 20, 1, 5, 0],
                        ps=[1.0, 1.0, 0.6, 0.3, 0.9, 1.0, 0.7, 1.0], minps=[0, 0, 0, 0, 0, 0, 0.2, 0.4],
                        seeds=np.arange(8) + 50, splits=2)
    # greedy: V=257 (one past a multiple of 32), row 1 has its maximum twice, row 2 is constant
    g = rng.normal(size=(3, 257))
    g[1, [7, 200]] = 9.0
    g[2] = -2.5
    out["greedy"] = _case(g, 32, temps=0.0, ks=5, ps=0.5, splits=4)
    # +-1e4 logits: exp underflows to 0 except near the max; the hot rows keep a spread distribution
    e = rng.choice([-1e4, 1e4], size=(4, 130)) * rng.uniform(0.5, 1.0, size=(4, 130))
    out["extreme"] = _case(e, 16, temps=[1.0, 1e4, 5e3, 3e3], ks=[0, 0, 40, 0], ps=[1.0, 1.0, 0.9, 0.5],
                           minps=[0, 0.01, 0, 0], seeds=[9, 8, 7, 6], splits=2, until_done=False)
    out["extreme_again"] = dict(out["extreme"], until_done=True)  # the same tokens when the launches stop early
    # vocabulary smaller than the block: most threads own nothing
    out["small_vocab"] = _case(rng.normal(size=(4, 5)), 16, temps=[1.0, 0.5, 2.0, 1.0], ks=[0, 2, 0, 4],
                               ps=[1.0, 1.0, 0.5, 0.9], seeds=[1, 2, 3, 4])
    # exact top-p boundary: distinct logits with fp weights exactly 1, cumulative 1, 2, 3, 4 of 4, p = 0.5
    out["exact_p"] = _case(np.tile([3e-30, 2e-30, 1e-30, 0.0, -1000.0], (16, 1)), 8, ps=0.5, seeds=np.arange(16))
    # test_sampling_gpu.py's 1 x 32,000 at the simulator's size: one row over as many splits as the block has threads
    # (S = block = 16, 4 buckets a round: every merge folds several partials per bucket), the GPU test's filters;
    # V = 1000 leaves the last slice short, V = 100 leaves the last slice empty (slices of 7)
    w = rng.normal(size=(1, 1000)) * 3
    out["many_splits"] = _case(w, 16, temps=1.0, ks=100, ps=0.9, minps=0.001, seeds=5, splits=16, nb=4)
    out["many_splits_short"] = _case(w[:, :100], 16, temps=1.0, ks=30, ps=0.9, minps=0.001, seeds=7, splits=16, nb=4)
    # distribution: 96 independent draws = 96 rows of one logit vector with different seeds, one call (top-k
    # and top-p together are checked token for token above; here top-p and min-p, to keep the launches few)
    c = np.tile(rng.normal(size=50), (96, 1))
    out["chi2"] = _case(c, 8, temps=0.9, ps=0.8, minps=0.1, seeds=np.arange(96) * 7919, steps=3)
    return out


if __name__ == "__main__":
    import json
    import os
    import sys
    import time
    import traceback
    from pathlib import Path

    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("set NUMBA_ENABLE_CUDASIM=1 before running this file (numba reads it at import)")
    sys.setswitchinterval(5e-5)  # the simulator's block manager polls threads: a short GIL slice runs it ~4x faster
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from cuda_ops.sampling import _sample_numba_arrays

    report = {}
    for name, c in cases().items():
        try:
            t0 = time.perf_counter()
            toks, steps = _sample_numba_arrays(c["logits"], *(c[p] for p in PARAMS), block=c["block"], nb=c["nb"],
                                               splits=c["splits"], until_done=c["until_done"], return_steps=True)
            assert (steps == c["steps"] + 1).all(), "the last launch advances every row's step by one"
            print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            report[name] = toks.tolist()
        except Exception:  # report per case; the test shows the traceback
            report[name] = "error: " + traceback.format_exc()
    print(json.dumps(report))
