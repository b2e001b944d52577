"""Rotary position embeddings (rotate-half form), shared by training forwards and the KV-cached decode step,
with the RoPE base and the context-extension scalings (linear, YaRN, Llama 3) in one place.

    rope = RopeConfig(theta=10_000.0, scaling="yarn", factor=4.0, original_max_len=256)
    cos, sin = rope_cos_sin(positions, head_dim, rope)          # per forward: (B|1, T, 1, hd/2) fp32
    cos_t, sin_t = rope_table(max_len, head_dim, rope, dtype=torch.bfloat16, device=dev)   # once per cache
    q = apply_rope(q, cos_t[pos][:, :, None], sin_t[pos][:, :, None])

Training, evaluation, the KV cache's prefill and its one-token step (eager or replayed in a CUDA graph) all read
their tables from these two functions, so every path rotates by the same angles. A bare float in place of a
RopeConfig is a plain base (no scaling).

The angles are always computed in float64 (fp32 products lose ~3 digits of the angle at position 32k) and
rounded once to the table's dtype; a table row equals rope_cos_sin at that position bit for bit.

The scalings are those of transformers' modeling_rope_utils.py (the export, pipeline/train/handoff/hf_export.py, writes them
to config.json as `rope_parameters`, and tests/pipeline/train/test_rope_export.py checks LlamaForCausalLM's logits
against this model's for each), with inverse frequencies inv_freq_i = theta^(-2i/head_dim), i < head_dim/2:
    linear  inv_freq_i / factor (position interpolation: every position divided by factor)
    yarn    per dimension a blend of inv_freq_i (dimensions that turn more than beta_fast times in the original
            length: kept) and inv_freq_i / factor (fewer than beta_slow turns: interpolated), linear in between
            over the integer dimension range (truncated, as transformers does); and cos/sin multiplied by
            mscale = 0.1 ln(factor) + 1, which scales every attention logit by mscale^2 (YaRN's temperature)
    llama3  wavelengths 2 pi / inv_freq_i shorter than original/high_freq_factor kept, longer than
            original/low_freq_factor divided by factor, and in between the smooth blend
            (1 - s) inv_freq_i / factor + s inv_freq_i with s = (original / wavelength - low) / (high - low)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_SCALINGS = ("none", "linear", "yarn", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """The RoPE base and its scaling. Fields a scaling does not use keep their defaults."""

    theta: float = 500_000.0  # the base
    scaling: str = "none"  # none | linear | yarn | llama3
    factor: float = 1.0  # linear, yarn, llama3: the context is `factor` times the original length
    original_max_len: int = 0  # yarn, llama3: the context length trained before scaling
    beta_fast: float = 32.0  # yarn: dimensions turning more than this many times in the original length are kept
    beta_slow: float = 1.0  # yarn: dimensions turning fewer times than this are fully interpolated
    low_freq_factor: float = 1.0  # llama3: wavelengths above original / low_freq_factor are interpolated
    high_freq_factor: float = 4.0  # llama3: wavelengths below original / high_freq_factor are kept

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(f"RoPE settings: {problem}")

    def problem(self) -> str | None:
        """What is wrong with these settings (one line), or None."""
        if self.scaling not in ROPE_SCALINGS:
            return f"scaling={self.scaling!r} is not one of {', '.join(ROPE_SCALINGS)}"
        if not (math.isfinite(self.theta) and self.theta > 1):
            return f"theta={self.theta!r} must be a finite base > 1"
        if not (math.isfinite(self.factor) and self.factor > 0):
            return f"factor={self.factor!r} must be > 0"
        if self.scaling in ("yarn", "llama3"):
            if self.factor < 1:
                return f"{self.scaling} needs factor >= 1, got {self.factor!r}"
            if self.original_max_len < 1:
                return f"{self.scaling} needs original_max_len, the context length trained before scaling"
        if self.scaling == "yarn" and not self.beta_fast > self.beta_slow > 0:
            return f"yarn needs beta_fast > beta_slow > 0, got {self.beta_fast!r} and {self.beta_slow!r}"
        if self.scaling == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            return (f"llama3 needs high_freq_factor > low_freq_factor > 0, got {self.high_freq_factor!r} and "
                    f"{self.low_freq_factor!r}")
        return None

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by: YaRN's mscale = 0.1 ln(factor) + 1 (factor > 1), else 1."""
        if self.scaling == "yarn" and self.factor > 1:
            return 0.1 * math.log(self.factor) + 1.0
        return 1.0

    def inv_freq(self, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(head_dim/2,) float64 inverse frequencies (radians per position) after the scaling."""
        dims = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)  # 2i
        inv = self.theta ** (-dims / head_dim)
        if self.scaling == "linear":
            return inv / self.factor
        if self.scaling == "yarn":
            low, high = self._yarn_range(head_dim)
            if low == high:
                high += 0.001  # transformers' guard against a zero-width ramp
            ramp = ((torch.arange(head_dim // 2, device=device, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
            # ramp 0: fast dimension (kept); 1: slow dimension (interpolated)
            return inv * (1 - ramp) + inv / self.factor * ramp
        if self.scaling == "llama3":
            original = self.original_max_len
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > original / self.low_freq_factor, inv / self.factor, inv)
            smooth = (original / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            blended = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= original / self.high_freq_factor) & (wavelen <= original / self.low_freq_factor)
            return torch.where(medium, blended, scaled)
        return inv

    def _yarn_range(self, head_dim: int) -> tuple[float, float]:
        """The dimension range [low, high] over which YaRN ramps from kept to interpolated (floor/ceil, clipped)."""
        def dim_for(rotations: float) -> float:  # the dimension that turns `rotations` times in the original length
            return head_dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = math.floor(dim_for(self.beta_fast)), math.ceil(dim_for(self.beta_slow))
        return max(low, 0), min(high, head_dim - 1)

    def describe(self) -> str:
        """`theta 10,000, yarn x4 from 256` for logs and phase lines."""
        text = f"theta {self.theta:,.0f}"
        if self.scaling == "linear":
            text += f", linear x{self.factor:g}"
        elif self.scaling in ("yarn", "llama3"):
            text += f", {self.scaling} x{self.factor:g} from {self.original_max_len:,}"
        return text


def as_rope(rope: RopeConfig | float) -> RopeConfig:
    """A RopeConfig from a RopeConfig or a bare base."""
    return rope if isinstance(rope, RopeConfig) else RopeConfig(theta=float(rope))


def rope_cos_sin(positions: torch.Tensor, head_dim: int,
                 rope: RopeConfig | float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B|1, T) -> cos, sin each (B|1, T, 1, head_dim/2) fp32, scaled by rope's attention_scaling."""
    rope = as_rope(rope)
    inv_freq = rope.inv_freq(head_dim, positions.device)  # (hd/2,) float64
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (B|1, T, hd/2)
    cos, sin = angles.cos(), angles.sin()
    if rope.attention_scaling != 1.0:
        cos, sin = cos * rope.attention_scaling, sin * rope.attention_scaling
    return cos.float()[:, :, None, :], sin.float()[:, :, None, :]


def rope_table(n_positions: int, head_dim: int, rope: RopeConfig | float, *, dtype: torch.dtype,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin each (n_positions, head_dim/2) in `dtype`: row p is the rotation of position p.

    Built once per KV cache so that a decode step only indexes it (no float64 work, no allocation per step)."""
    positions = torch.arange(n_positions, device=device)[None]  # (1, n)
    cos, sin = rope_cos_sin(positions, head_dim, rope)  # (1, n, 1, hd/2) fp32
    return cos[0, :, 0].to(dtype).contiguous(), sin[0, :, 0].to(dtype).contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, n_head, head_dim) by cos/sin broadcastable to (B, T, 1, head_dim/2).

    Computed in the dtype of cos/sin and returned in x's dtype: training passes fp32 tables (fp32 math under
    bf16 autocast, as before); a bf16 KV cache passes bf16 tables, so decoding has no fp32 round trip."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)  # (B, T, n_head, hd/2) each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)
