"""Rotary position embeddings (rotate-half form), shared by training forwards and the KV-cached decode step.

    cos, sin = rope_cos_sin(positions, head_dim, base)          # per forward: (B|1, T, 1, hd/2) fp32
    cos_t, sin_t = rope_table(max_len, head_dim, base, dtype=torch.bfloat16, device=dev)   # once per cache
    q = apply_rope(q, cos_t[pos][:, :, None], sin_t[pos][:, :, None])

The angles are always computed in float64 (fp32 products lose ~3 digits of the angle at position 32k) and
rounded once to the table's dtype; a table row equals rope_cos_sin at that position bit for bit.
"""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B|1, T) -> cos, sin each (B|1, T, 1, head_dim/2) fp32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (B|1, T, hd/2)
    return angles.cos().float()[:, :, None, :], angles.sin().float()[:, :, None, :]


def rope_table(n_positions: int, head_dim: int, base: float, *, dtype: torch.dtype,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin each (n_positions, head_dim/2) in `dtype`: row p is the rotation of position p.

    Built once per KV cache so that a decode step only indexes it (no float64 work, no allocation per step)."""
    positions = torch.arange(n_positions, device=device)[None]  # (1, n)
    cos, sin = rope_cos_sin(positions, head_dim, base)  # (1, n, 1, hd/2) fp32
    return cos[0, :, 0].to(dtype).contiguous(), sin[0, :, 0].to(dtype).contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, n_head, head_dim) by cos/sin broadcastable to (B, T, 1, head_dim/2).

    Computed in the dtype of cos/sin and returned in x's dtype: training passes fp32 tables (fp32 math under
    bf16 autocast, as before); a bf16 KV cache passes bf16 tables, so decoding has no fp32 round trip."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)  # (B, T, n_head, hd/2) each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)
