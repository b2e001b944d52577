"""The sampling Numba kernel under the CUDA simulator, checked against the torch reference and the test oracle.

    .venv/bin/python -m pytest tests/cuda_ops/test_sampling_cudasim.py -q      (~40 s on 2 cores)

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, and other test modules may already have imported
it in this process, so the kernel runs once over every case in a subprocess (tests/cuda_ops/cudasim_sampling.py,
started in the background by tests/cuda_ops/conftest.py) and each property is asserted here. Reference and kernel
share the counter-based uniform, so they must return the same token per row, except on rows `fragile_rows` flags (a
CDF boundary or filter threshold within fp rounding).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from cuda_ops.sampling import _sample_reference_rows
from tests.cuda_ops.cudasim_sampling import PARAMS, cases
from tests.cuda_ops.sampling_checks import filtered_probs, fragile_rows, kept_set

pytestmark = pytest.mark.system  # docs/tests.md: over ~5 s (the simulator's run)

pytest.importorskip("numba")

SCRIPT = Path(__file__).with_name("cudasim_sampling.py")
CASES = cases()


@pytest.fixture(scope="module")
def tokens(cudasim_runs) -> dict[str, np.ndarray]:
    out = cudasim_runs.result(SCRIPT)  # started in the background by tests/cuda_ops/conftest.py
    assert out.returncode == 0, f"simulator run crashed:\n{out.stdout}\n{out.stderr}"
    report = json.loads(out.stdout.strip().splitlines()[-1])
    errors = {k: v for k, v in report.items() if isinstance(v, str)}
    assert not errors, "\n".join(f"{k}: {v}" for k, v in errors.items())
    return {k: np.asarray(v) for k, v in report.items()}


def _reference(case) -> np.ndarray:
    return _sample_reference_rows(torch.from_numpy(case["logits"]),
                                  *(torch.from_numpy(case[p]) for p in PARAMS)).numpy()


def _kept(case, b) -> np.ndarray:
    return kept_set(case["logits"][b], *(case[p][b] for p in ("temps", "ks", "ps", "minps")))


def test_the_kernel_compiles_for_sm90_without_local_memory(cudasim_runs):
    """tests/cuda_ops/ptx_decoder_kernels.py: the real compiler's view (the simulator cannot see registers)."""
    out = cudasim_runs.result(Path(__file__).with_name("ptx_decoder_kernels.py"))
    assert out.returncode == 0, f"ptx_decoder_kernels.py crashed:\n{out.stdout}\n{out.stderr}"
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if "skipped" in report:
        pytest.skip(report["skipped"])
    assert report["sampling"] == "ok", report["sampling"]


def test_every_case_ran(tokens):
    assert sorted(tokens) == sorted(CASES)
    for name, toks in tokens.items():
        assert toks.shape == (CASES[name]["logits"].shape[0],) and toks.min() >= 0, name


@pytest.mark.parametrize("name", ["mixed", "ties", "greedy", "extreme", "small_vocab", "exact_p", "chi2",
                                  "many_splits", "many_splits_short"])
def test_kernel_draws_the_reference_token(tokens, name):
    case = CASES[name]
    if name == "exact_p":  # sits on the top-p boundary on purpose, with exact fp weights: no exemption
        assert np.array_equal(tokens[name], _reference(case))
        return
    fragile = fragile_rows(case["logits"], *(case[p] for p in PARAMS))
    mismatch = tokens[name] != _reference(case)
    assert not (mismatch & ~fragile).any(), (np.nonzero(mismatch)[0], tokens[name], _reference(case))
    assert fragile.mean() < 0.05, "too many near-tie rows for this check to mean anything"


@pytest.mark.parametrize("name", ["mixed", "ties", "extreme", "small_vocab", "exact_p", "chi2", "many_splits",
                                  "many_splits_short"])
def test_kernel_never_outside_the_kept_set(tokens, name):
    case = CASES[name]
    for b, tok in enumerate(tokens[name]):
        assert _kept(case, b)[tok], f"{name} row {b}: token {tok} is filtered out"


def test_greedy_is_argmax_with_lowest_index_on_ties(tokens):
    x = CASES["greedy"]["logits"]
    assert tokens["greedy"].tolist() == x.argmax(axis=1).tolist() == [int(x[0].argmax()), 7, 0]
    assert tokens["mixed"][0] == CASES["mixed"]["logits"][0].argmax()  # temperature-0 row inside a mixed batch


def test_seeded_launch_repeats(tokens):
    assert np.array_equal(tokens["extreme"], tokens["extreme_again"])


def test_ties_at_thresholds_are_kept(tokens):
    # exact_p: mass exactly p after two tokens -> exactly tokens {0, 1}, both drawn across the 16 seeds
    assert set(tokens["exact_p"].tolist()) == {0, 1}
    # ties: row 0 keeps every logit equal to the 3rd largest; the kept group is larger than k
    assert _kept(CASES["ties"], 0).sum() > 3


def test_different_seeds_give_the_filtered_distribution(tokens):
    case, toks = CASES["chi2"], tokens["chi2"]
    probs = filtered_probs(case["logits"][0], float(case["temps"][0]), int(case["ks"][0]), float(case["ps"][0]),
                           float(case["minps"][0]))
    counts = np.bincount(toks, minlength=probs.size)
    assert counts[probs == 0].sum() == 0
    nz = probs > 0
    assert nz.sum() >= 4
    res = stats.chisquare(counts[nz], probs[nz] * len(toks))
    assert res.pvalue > 1e-3, (counts[nz], probs[nz] * len(toks))
