"""A test double of model/expert_dispatch.py's protocol over a real process group: experts split over the ranks,
rows moved by torch.distributed's autograd all-to-all with uneven splits (gloo on CPU).

It exists to show that a MoE layer is correct when its dispatch holds only a subset of the experts
(tests/model/test_moe_expert_split.py); it is the shape the training room's implementation takes, not that
implementation (no timeouts, no mesh, no FSDP: pipeline/train/distributed/ owns those).

    layer.dispatch = AllToAllExperts()     # inside a process group: rank r holds experts [r E/d, (r+1) E/d)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from model.expert_dispatch import ExpertDispatch


class AllToAllExperts(ExpertDispatch):
    """Every rank of the default group is one expert-parallel rank (degree = world size)."""

    def __init__(self):
        self.degree, self.rank = dist.get_world_size(), dist.get_rank()

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        per = weight.shape[0] // self.degree
        return weight[self.rank * per:(self.rank + 1) * per]  # a slice of the full parameter: its gradient lands there

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor):
        d = self.degree
        per = counts.numel() // d
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous())  # recv[s per + e]: rows rank s sends to local expert e
        send_splits = counts.view(d, per).sum(1).tolist()
        by_source = recv.view(d, per)  # (source rank, local expert)
        recv_splits = by_source.sum(1).tolist()
        received = all_to_all_single(rows.new_empty(sum(recv_splits), rows.shape[1]), rows, recv_splits, send_splits)
        # the received rows are grouped by source rank, then local expert: regroup by local expert, then source
        starts = torch.cumsum(by_source.flatten(), 0) - by_source.flatten()  # start of each (source, expert) block
        order = torch.cat([torch.arange(int(starts[s * per + e]), int(starts[s * per + e] + by_source[s, e]))
                           for e in range(per) for s in range(d)]) if received.shape[0] else \
            torch.zeros(0, dtype=torch.int64)
        return received.index_select(0, order), by_source.sum(0), (order, send_splits, recv_splits)

    def combine(self, out: torch.Tensor, handle) -> torch.Tensor:
        order, send_splits, recv_splits = handle
        back = torch.empty_like(out).index_copy(0, order, out)  # source-rank order again
        return all_to_all_single(out.new_empty(sum(send_splits), out.shape[1]), back, send_splits, recv_splits)
