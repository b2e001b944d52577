"""Routing for the mixture-of-experts layer (model/moe.py): top-k choice, the load statistics a layer records, and
the two ways of balancing the load (an auxiliary loss, or a selection bias updated from the load).

    route = top_k_route(logits, k, renormalize=True, bias=None)      # (N, E) fp32 router logits -> Route
    stats = route_stats(logits, route, E)                           # what one forward records (RouterStats)
    aux = balance_loss(stats.counts_global, stats.prob_sum, k)      # (E/k) sum_e f_e P_e, 1 at a perfect balance
    update_selection_bias(bias, load, rate)                          # after an optimizer step (aux-loss-free)

Router: softmax over the E logits in fp32, the k largest probabilities chosen, and (renormalize, default, as
Mixtral and Qwen3-MoE) divided by their sum, so each token's weights sum to 1. With a selection bias (DeepSeek-V3's
auxiliary-loss-free balancing) the choice is top-k of probability + bias, while the weights stay the chosen experts'
own probabilities: the bias moves tokens between experts without changing what the chosen ones contribute.

Balance by an auxiliary loss (Switch Transformer, with top-k as in DeepSeek and OLMoE):

    L_aux = (E / k) sum_e f_e P_e,      f_e = (tokens whose top-k holds e) / N,   P_e = mean over tokens of p_e

f sums to k and P to 1, so L_aux = 1 when every expert gets N k / E tokens and its mean probability is 1/E; it is
larger when both lean to the same experts. f counts choices (no gradient); the gradient flows through P. Over the
global batch: f from every rank's counts (summed: `RouterStats.counts` is what a distributed engine all-reduces) and
P from this rank's tokens; with equal tokens per rank the mean over ranks of this loss is the loss of the whole
batch, since f is the same on every rank (the global-batch balance of Qwen's "Demons in the detail", which lets
experts specialise by domain inside a batch).

Balance by a selection bias: after each optimizer step, b_e += rate * sign(mean load - load_e) (DeepSeek-V3, with
their rate 1e-3), from the step's load over every micro-batch and rank: overloaded experts become less likely to be
chosen. No gradient, no loss term.

Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2, keeping the logits small so the fp32 softmax stays
well conditioned. Router entropy (a metric): mean over tokens of -sum_e p_e log p_e, log E at a uniform router.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Route(NamedTuple):
    """A router's decision for N tokens: experts (N, k) int64, weights (N, k) fp32, probs (N, E) fp32 (softmax)."""
    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


class RouterStats(NamedTuple):
    """What one MoE layer's training forward records (tensors on the device, no host sync):
    counts (E,) fp32 assignments per expert (no gradient; sums to N k), prob_sum (E,) fp32 sum over tokens of the
    router probabilities (differentiable: the aux loss' P), z_sum () sum over tokens of logsumexp(logits)^2
    (differentiable), entropy_sum () sum of the router entropy (no gradient), tokens (python int N), dropped ()
    int64 assignments dropped by the capacity."""
    counts: torch.Tensor
    prob_sum: torch.Tensor
    z_sum: torch.Tensor
    entropy_sum: torch.Tensor
    tokens: int
    dropped: torch.Tensor


def top_k_route(logits: torch.Tensor, k: int, renormalize: bool = True,
                bias: torch.Tensor | None = None) -> Route:
    """(N, E) router logits (any float dtype; computed in fp32) -> Route. bias (E,): added to the probabilities for
    the choice only (the weights are the chosen experts' probabilities)."""
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
    if bias is None:
        weights, experts = torch.topk(probs, k, dim=-1)  # (N, k)
    else:
        experts = torch.topk(probs + bias.float(), k, dim=-1).indices
        weights = probs.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Route(experts, weights, probs)


def route_stats(logits: torch.Tensor, route: Route, num_experts: int, dropped: torch.Tensor | None = None
                ) -> RouterStats:
    """The RouterStats of one forward (module docstring); dropped: the capacity's count, or None (0)."""
    probs = route.probs
    flat = route.experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=flat.device).scatter_add_(
        0, flat, torch.ones(flat.shape, dtype=torch.float32, device=flat.device))
    z = torch.logsumexp(logits.float(), dim=-1)  # (N,)
    with torch.no_grad():
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum()
    if dropped is None:
        dropped = torch.zeros((), dtype=torch.int64, device=flat.device)
    return RouterStats(counts, probs.sum(0), z.square().sum(), entropy, int(probs.shape[0]), dropped)


def balance_loss(counts: torch.Tensor, prob_sum: torch.Tensor, tokens: float, k: int,
                 counted_tokens: float | None = None) -> torch.Tensor:
    """L_aux = (E / k) sum_e f_e P_e with f_e = counts_e / counted_tokens (the tokens the counts came from: every
    rank's, over the global batch) and P_e = prob_sum_e / tokens (this rank's). 1 at a perfect balance."""
    E = counts.shape[-1]
    f = counts.detach() / (tokens if counted_tokens is None else counted_tokens)
    P = prob_sum / tokens
    return (E / k) * (f * P).sum(-1)


@torch.no_grad()
def update_selection_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """bias (E,) += rate * sign(mean(load) - load): raise the underloaded experts, lower the overloaded ones; load
    (E,) the assignments of the step (all ranks). In place; an expert exactly at the mean keeps its bias."""
    bias.add_(torch.sign(load.float().mean() - load.float()), alpha=rate)
