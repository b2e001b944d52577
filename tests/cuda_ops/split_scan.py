"""A row's resonance scan split into contiguous slices, the ranks of a context group emulated one after another in
one process: the exchange (`carry`) is the same exclusive prefix the process-group version computes
(pipeline/train/distributed/context_parallel.py), over the summaries the slices before (forward) or after (backward)
recorded. Forward runs the slices in rank order and backward in reverse, as the real exchange would deliver them.
Used by tests/cuda_ops/test_resonance_scan.py (reference) and cudasim_resonance_scan.py (the kernels)."""
from __future__ import annotations

import torch


def exclusive_carry(summaries: dict[int, tuple[torch.Tensor, torch.Tensor]], ranks) -> torch.Tensor:
    """carry = sum over `ranks` (in fold order) of value_q times the decays after it: c = decay_q c + value_q."""
    out = None
    for q in ranks:
        decay, value = (torch.view_as_complex(t.contiguous()) for t in summaries[q])
        out = value if out is None else decay * out + value
    return out


class SequentialCarry:
    def __init__(self, degree: int):
        self.degree = degree
        self.forward: dict[int, tuple] = {}
        self.backward: dict[int, tuple] = {}

    def for_rank(self, rank: int):
        def carry(decay, state, reverse=False):
            book = self.backward if reverse else self.forward
            book[rank] = (decay.detach().clone(), state.detach().clone())
            ranks = range(self.degree - 1, rank, -1) if reverse else range(rank)
            c = exclusive_carry(book, ranks)
            return torch.zeros_like(state) if c is None else torch.view_as_real(c).to(state.dtype)
        return carry


def split_scan(scan, z, log_lam, starts, gs, degree: int):
    """(s, dz, dlog_lam) of the whole row, computed as `degree` contiguous slices: scan(z_r, log_lam, starts_r,
    carry) -> (s_r, last_r) for each slice in rank order, then each slice's backward in reverse rank order."""
    T = z.shape[1]
    n = T // degree
    ll = log_lam.clone().requires_grad_()
    exchange, outs, inputs = SequentialCarry(degree), [], []
    for r in range(degree):
        zr = z[:, r * n:(r + 1) * n].clone().requires_grad_()
        sr = None if starts is None else starts[:, r * n:(r + 1) * n]
        outs.append(scan(zr, ll, sr, exchange.for_rank(r))[0])
        inputs.append(zr)
    for r in reversed(range(degree)):
        torch.autograd.backward(outs[r], gs[:, r * n:(r + 1) * n].to(outs[r].dtype))
    return (torch.cat([o.detach() for o in outs], dim=1), torch.cat([i.grad for i in inputs], dim=1), ll.grad)
