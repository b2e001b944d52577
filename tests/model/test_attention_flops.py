"""Attention FLOPs counted from a batch's documents: the executed count and the causal-equivalent convention."""
from __future__ import annotations

import itertools

import pytest
import torch

from model.flops import (attention_flops_per_pair, causal_pairs, flops_per_token, matmul_flops_per_token,
                         matmul_params, training_flops, within_document_causal_pairs)
from model.tiers import get_tier


def brute_force_pairs(doc_ids: torch.Tensor) -> int:
    """Every (query, key) pair with key <= query and the same document, counted one by one."""
    count = 0
    for row in doc_ids.tolist():
        for q, k in itertools.product(range(len(row)), repeat=2):
            count += k <= q and row[k] == row[q]
    return count


def random_boundaries(B: int, T: int, p: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, T, generator=g) < p
    starts[:, 0] = False
    return starts.cumsum(dim=1).to(torch.int32)


@pytest.mark.parametrize("seed,p", [(0, 0.05), (1, 0.3), (2, 0.9), (3, 0.0)])
def test_within_document_pairs_equal_a_brute_force_count_on_random_boundaries(seed, p):
    doc_ids = random_boundaries(B=3, T=57, p=p, seed=seed)
    got = within_document_causal_pairs(doc_ids)
    assert got.dtype == torch.int64 and got.dim() == 0
    assert int(got) == brute_force_pairs(doc_ids)


def test_pairs_edge_cases():
    one_doc = torch.zeros(2, 10, dtype=torch.int32)
    assert int(within_document_causal_pairs(one_doc)) == 2 * causal_pairs(10) == 110
    every_token_its_own_doc = torch.arange(10, dtype=torch.int32).expand(2, 10)
    assert int(within_document_causal_pairs(every_token_its_own_doc)) == 20  # the diagonal only


def test_training_flops_adds_matmuls_and_the_pairs_that_were_computed():
    tier, V = get_tier("B"), 32000
    assert attention_flops_per_pair(tier) == 12 * 12 * 6 * 128
    assert matmul_flops_per_token(tier, V) == 6 * matmul_params(tier, V)
    doc_ids = random_boundaries(B=2, T=64, p=0.1, seed=4)
    pairs = within_document_causal_pairs(doc_ids)
    executed = training_flops(tier, V, tokens=128, attention_pairs=pairs)  # a tensor when pairs is one
    assert int(executed) == 6 * matmul_params(tier, V) * 128 + 12 * 12 * 6 * 128 * brute_force_pairs(doc_ids)


def test_causal_equivalent_count_is_the_whole_row_formula():
    """flops_per_token (what train/mfu_causal_equiv uses) is the old formula: T^2/2 pairs per row, whatever the
    documents; the executed count of one whole-row document differs from it by the diagonal's T/2 pairs."""
    tier, V, T = get_tier("B"), 32000, 4096
    old_formula = 6 * matmul_params(tier, V) + 6 * tier.n_layers * tier.n_heads * tier.head_dim * T
    assert flops_per_token(tier, T, V) == old_formula
    assert flops_per_token(tier, T, V) * T == training_flops(tier, V, T, T * T / 2)
    whole_row = training_flops(tier, V, T, causal_pairs(T))
    assert whole_row - flops_per_token(tier, T, V) * T == attention_flops_per_pair(tier) * T / 2
