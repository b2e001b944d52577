"""Named model sizes, from a CPU test size up to ~3B parameters.

Head dim is 128 wherever the width allows (the fast attention kernels on Hopper are tuned for it);
`nano` is too narrow for that and uses 16. RoPE base 500,000 keeps positions distinguishable out to
32k tokens and beyond (the base Llama 3 uses for long context). Tiers E (~1.5B) and F (~2.9B) do not fit
one 80 GB GPU with their AdamW state and 32k activations at batch 1 together; they train sharded
(train.parallel=fsdp, docs/scaling.md), and `python -m pipeline.train.max_batch --tier F --seq-len 32768
--workers 8 --memory-limit-gib 80` prints the plan.

    python -m model          # prints every tier with its exact parameter count (total and active for MoE tiers)

Mixture-of-experts tiers (`<dense tier>-moe`, both families) replace the SwiGLU MLP of each block by a MoE
feed-forward (model/moe.py) described by a MoESpec: E routed SwiGLU experts of width `expert_ffn`, k of them per
token, optional shared experts and dense first layers. `nano-moe` keeps nano's active MLP width (2 experts x 96 =
192); `A-moe`, `B-moe` and `C-moe` have OLMoE-1B-7B's shape scaled to the tier: 64 experts, 8 active, each half
the model width wide (fine-grained), so a token runs 4 d_model of expert width, about 5x fewer parameters than
the layer holds. The model.* MoE fields (pipeline/config.py) change any of this per run; `with_moe` applies them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts feed-forward: what the model builds (model/moe.py) and counts (model/flops.py)."""
    num_experts: int  # routed experts per MoE layer
    experts_per_token: int  # k: routed experts each token runs (top-k of the router)
    expert_ffn: int  # SwiGLU hidden width of one expert (fine-grained experts: a fraction of a dense d_ff)
    shared_experts: int = 0  # experts every token runs: one SwiGLU of shared_experts x expert_ffn, sigmoid-gated
    dense_first_layers: int = 0  # the first blocks keep the tier's dense MLP (d_ff)
    renormalize: bool = True  # the k selected probabilities are renormalised to sum to 1 (Mixtral, Qwen3)
    selection_bias: bool = False  # a per-expert bias added to the scores for selection only (aux-loss-free)
    capacity_factor: float = 0.0  # > 0: an expert takes at most ceil(cf x tokens x k / E) in training; 0 = dropless

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.dense_first_layers

    def moe_layers(self, n_layers: int) -> int:
        return max(0, n_layers - self.dense_first_layers)

    @property
    def shared_ffn(self) -> int:
        return self.shared_experts * self.expert_ffn


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
    moe: MoESpec | None = None  # a mixture-of-experts feed-forward instead of the SwiGLU MLP (model/moe.py)

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
        Tier("E", d_model=2048, n_layers=28, n_heads=16, n_kv_heads=16, d_ff=5632, max_seq_len=32768),
        Tier("F", d_model=2560, n_layers=36, n_heads=20, n_kv_heads=20, d_ff=6912, max_seq_len=32768),
    )
}


def _olmoe_shape(d_model: int) -> MoESpec:
    """OLMoE-1B-7B's expert shape (64 experts, 8 active, each d_model / 2 wide) at this width."""
    return MoESpec(num_experts=64, experts_per_token=8, expert_ffn=d_model // 2)


def _moe_tiers(table: dict, nano_ffn: int) -> dict:
    """`<name>-moe` for nano (8 experts, 2 active, nano_ffn wide: nano's active MLP width) and A, B, C (OLMoE's
    shape), beside the dense tiers of `table`."""
    out = {}
    for name in ("nano", "A", "B", "C"):
        spec = (MoESpec(num_experts=8, experts_per_token=2, expert_ffn=nano_ffn) if name == "nano"
                else _olmoe_shape(table[name].d_model))
        out[f"{name}-moe"] = replace(table[name], name=f"{name}-moe", moe=spec)
    return out


TIERS.update(_moe_tiers(TIERS, nano_ffn=96))


def get_tier(name: str) -> Tier:
    """The tier called `name`; a ValueError naming the known tiers otherwise."""
    try:
        return TIERS[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; known tiers: {', '.join(TIERS)}") from None


# ----------------------------------------------------------------------------------------------
# Resonance tiers (model.mixer=resonance, model/resonance.py): the same names as the attention tiers, with
# d_ff chosen so that each tier's parameter count is within 1% of the attention tier of that name (at vocab
# 32,000) (the
# resonance mixer has 3 d_model^2 projection weights where attention has 4). Channel groups play the role of
# heads (128 channels each from tier A up); each group has `n_eigen` learned complex eigenvalues, so the
# recurrent generation state is n_groups x n_eigen complex numbers per layer. `small_32k` is the shape the
# ResonanceNet seed trained at 32k context: d_model 1,024, 8 layers, 128 eigenstates per layer, chunk 256.


@dataclass(frozen=True)
class ResonanceTier:
    name: str
    d_model: int
    n_layers: int
    n_groups: int  # channel groups; d_model // n_groups channels share one set of eigenvalues
    n_eigen: int  # complex eigenvalues (damped oscillators) per group
    d_ff: int  # SwiGLU hidden width
    chunk_size: int  # tokens per chunk of the chunked scan (document-masked training)
    max_seq_len: int
    norm_eps: float = 1e-5
    moe: MoESpec | None = None  # a mixture-of-experts feed-forward instead of the SwiGLU MLP (model/moe.py)

    @property
    def group_dim(self) -> int:
        return self.d_model // self.n_groups

    @property
    def eigen_per_layer(self) -> int:
        return self.n_groups * self.n_eigen


RESONANCE_TIERS: dict[str, ResonanceTier] = {
    t.name: t
    for t in (
        ResonanceTier("nano", d_model=64, n_layers=2, n_groups=4, n_eigen=8, d_ff=208, chunk_size=64,
                      max_seq_len=4096),
        ResonanceTier("A", d_model=384, n_layers=8, n_groups=3, n_eigen=64, d_ff=1088, chunk_size=256,
                      max_seq_len=262144),
        ResonanceTier("B", d_model=768, n_layers=12, n_groups=6, n_eigen=64, d_ff=2240, chunk_size=256,
                      max_seq_len=262144),
        ResonanceTier("C", d_model=1024, n_layers=24, n_groups=8, n_eigen=64, d_ff=3072, chunk_size=256,
                      max_seq_len=262144),
        ResonanceTier("D", d_model=1536, n_layers=24, n_groups=12, n_eigen=64, d_ff=4800, chunk_size=256,
                      max_seq_len=262144),
        ResonanceTier("E", d_model=2048, n_layers=28, n_groups=16, n_eigen=64, d_ff=6208, chunk_size=256,
                      max_seq_len=262144),
        ResonanceTier("F", d_model=2560, n_layers=36, n_groups=20, n_eigen=64, d_ff=7680, chunk_size=256,
                      max_seq_len=262144),
        ResonanceTier("small_32k", d_model=1024, n_layers=8, n_groups=8, n_eigen=16, d_ff=2688, chunk_size=256,
                      max_seq_len=262144),
    )
}
RESONANCE_TIERS.update(_moe_tiers(RESONANCE_TIERS, nano_ffn=104))

MIXERS = ("attention", "resonance")


def tiers_for(mixer: str) -> dict:
    """The tier table of a model family: TIERS (attention) or RESONANCE_TIERS."""
    if mixer not in MIXERS:
        raise ValueError(f"unknown mixer {mixer!r}; known mixers: {', '.join(MIXERS)}")
    return TIERS if mixer == "attention" else RESONANCE_TIERS


def get_mixer_tier(name: str, mixer: str = "attention") -> Tier | ResonanceTier:
    """The tier called `name` of the `mixer` family; a ValueError naming that family's tiers otherwise."""
    table = tiers_for(mixer)
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {mixer} tier {name!r}; known tiers: {', '.join(table)}") from None


# ----------------------------------------------------------------------------------------------
# Mixture-of-experts settings of a run (pipeline/config.py model.*) applied to a tier

MOE_FIELDS = ("num_experts", "experts_per_token", "expert_ffn", "shared_experts", "dense_first_layers")


def with_moe(tier, *, num_experts: int = -1, experts_per_token: int = -1, expert_ffn: int = -1,
             shared_experts: int = -1, dense_first_layers: int = -1, renormalize: bool = True,
             selection_bias: bool = False, capacity_factor: float = 0.0):
    """`tier` with its MoESpec changed by a run's settings: -1 keeps the tier's value (for a dense tier: 8 experts,
    2 per token, d_ff / 2 wide, no shared experts, no dense layers); num_experts=0 makes it dense. The result is a
    tier of the same name (its shape is in the run's config, which the checkpoint keeps)."""
    base = tier.moe
    if num_experts == 0 or (base is None and num_experts < 0):
        return replace(tier, moe=None) if tier.moe is not None else tier
    base = base or MoESpec(num_experts=8, experts_per_token=2, expert_ffn=max(1, tier.d_ff // 2))

    def pick(value: int, default: int) -> int:
        return default if value < 0 else value

    spec = MoESpec(num_experts=pick(num_experts, base.num_experts),
                   experts_per_token=pick(experts_per_token, base.experts_per_token),
                   expert_ffn=pick(expert_ffn, base.expert_ffn),
                   shared_experts=pick(shared_experts, base.shared_experts),
                   dense_first_layers=pick(dense_first_layers, base.dense_first_layers),
                   renormalize=renormalize, selection_bias=selection_bias, capacity_factor=capacity_factor)
    return tier if spec == tier.moe else replace(tier, moe=spec)
