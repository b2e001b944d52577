"""Experts split over ranks (expert parallelism), as a mixture-of-experts layer sees it: the protocol, and `LOCAL`.

    from model.expert_dispatch import LOCAL
    from model.moe import set_expert_dispatch
    set_expert_dispatch(model, split)     # model/moe.py: every MoE layer of the model; LOCAL (the default) = all here

The model stays single-device code (as with context parallelism, model/context.py): a MoE layer routes its own
tokens, orders their rows by expert, and hands them to its `ExpertDispatch`, which returns the rows for the experts
this rank holds; the layer runs those experts and hands the outputs back, and the dispatch returns them to the ranks
(and the order) the rows came from. `LOCAL` holds every expert and moves nothing, so a one-process forward has fixed
shapes and no host sync (the decode step is captured in a CUDA graph). What an implementation over a process group
(pipeline/train/distributed/, all-to-all over the expert-parallel group) must provide:

    degree, rank                  ranks the experts are split over, and this rank's index among them
    local_experts(E) -> range     the global ids of the experts this rank holds: the contiguous block
                                  [rank E/degree, (rank+1) E/degree) (E divisible by degree; config checks it)
    local_weight(w) -> tensor     an expert weight of the layer, (E, ...) as the module declares it, -> this rank's
                                  experts' slice (E/degree, ...) (a DTensor sharded on dim 0: its local tensor);
                                  differentiable, so the gradient reaches the parameter (or its shard)
    exchange(rows, counts) -> (received, local_counts, handle)
                                  rows (M, D): this rank's token rows ordered by global expert id, counts (E,) int64
                                  on the rows' device: how many rows go to each expert (sum = M). Returns the rows of
                                  every rank for this rank's experts, ordered by local expert (then by source rank),
                                  received (R, D), local_counts (E/degree,) int64 with sum R, and whatever `combine`
                                  needs to send them back. Differentiable in rows (its backward sends the gradients
                                  back: the all-to-all with the splits reversed). Uneven splits: R differs by rank.
    combine(out, handle) -> rows  out (R, D): the experts' outputs in `received` order -> (M, D) in the order of
                                  `rows`, on the rank they came from; differentiable in out.

Every rank calls exchange and combine once per MoE layer in the same order (forward, and backward in reverse), also
for a micro-batch that sends it no rows. The layer calls only these methods; it never reads the process group.
Routing, the top-k, the load statistics and the auxiliary loss are computed before `exchange` on this rank's own
tokens, and the router and the selection bias are replicated, so they need nothing from the dispatch: the load
statistics over the global batch are summed over every rank by the training engine (pipeline/train/moe_balance.py),
whatever the degree.
"""
from __future__ import annotations

from typing import Any

import torch


class ExpertDispatch:
    """The protocol (module docstring), and itself the one-rank default: every expert here, nothing moved."""

    degree: int = 1
    rank: int = 0

    def local_experts(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds (a contiguous block)."""
        if num_experts % self.degree:
            raise ValueError(f"{num_experts} experts do not split over {self.degree} ranks; choose a degree that "
                             "divides the number of experts")
        per = num_experts // self.degree
        return range(self.rank * per, (self.rank + 1) * per)

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """(E, ...) expert weight -> (E / degree, ...) this rank's slice; LOCAL: the weight itself."""
        return weight

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(M, D) rows ordered by expert, (E,) counts -> (rows for this rank's experts, their counts, handle)."""
        return rows, counts, None

    def combine(self, out: torch.Tensor, handle: Any) -> torch.Tensor:
        """(R, D) outputs in `exchange`'s received order -> (M, D) in the order of the rows sent."""
        return out


LOCAL = ExpertDispatch()
