"""Building blocks both model families share (model/decoder.py's attention blocks and model/resonance.py's
resonance blocks): RMSNorm, the SwiGLU MLP, and which blocks activation checkpointing recomputes."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # normalize in fp32 even under bf16 autocast
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, tier):  # any tier with d_model and d_ff
        super().__init__()
        self.w_gate_up = nn.Linear(tier.d_model, 2 * tier.d_ff, bias=False)  # gate and up in one matmul
        self.w_down = nn.Linear(tier.d_ff, tier.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # (B, T, d_ff) each
        return self.w_down(F.silu(gate) * up)


def checkpointed_layers(spec: str, n_layers: int) -> frozenset[int]:
    """'none' | 'all' | 'every_<k>' (blocks 0, k, 2k, ...) -> the block indices to recompute in backward."""
    if spec == "none":
        return frozenset()
    if spec == "all":
        return frozenset(range(n_layers))
    if spec.startswith("every_") and spec[6:].isdigit() and int(spec[6:]) >= 1:
        return frozenset(range(0, n_layers, int(spec[6:])))
    raise ValueError(f"activation_checkpointing={spec!r} is not allowed; choose none, all or every_<k> (k >= 1)")
