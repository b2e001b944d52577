"""Named model sizes, from a CPU test size up to ~760M parameters.

Head dim is 128 wherever the width allows (the fast attention kernels on Hopper are tuned for it);
`nano` is too narrow for that and uses 16. RoPE base 500,000 keeps positions distinguishable out to
32k tokens and beyond (the base Llama 3 uses for long context).

    python -m model          # prints every tier with its exact parameter count
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    name: str
    d_model: int  # residual width
    n_layers: int
    n_heads: int  # query heads; head_dim = d_model // n_heads
    n_kv_heads: int  # key/value heads (grouped-query attention when < n_heads)
    d_ff: int  # SwiGLU hidden width
    max_seq_len: int  # longest context the tier is configured (and tested) for
    rope_base: float = 500_000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


TIERS: dict[str, Tier] = {
    t.name: t
    for t in (
        Tier("nano", d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=192, max_seq_len=4096),
        Tier("A", d_model=384, n_layers=8, n_heads=3, n_kv_heads=3, d_ff=1024, max_seq_len=32768),
        Tier("B", d_model=768, n_layers=12, n_heads=6, n_kv_heads=6, d_ff=2048, max_seq_len=32768),
        Tier("C", d_model=1024, n_layers=24, n_heads=8, n_kv_heads=8, d_ff=2816, max_seq_len=32768),
        Tier("D", d_model=1536, n_layers=24, n_heads=12, n_kv_heads=12, d_ff=4352, max_seq_len=32768),
    )
}


def get_tier(name: str) -> Tier:
    """The tier called `name`; a ValueError naming the known tiers otherwise."""
    try:
        return TIERS[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; known tiers: {', '.join(TIERS)}") from None
