"""Building blocks both model families share (model/decoder.py's attention blocks and model/resonance.py's
resonance blocks): RMSNorm, the SwiGLU MLP (model/moe.py's feed_forward puts a mixture of experts in its place in a
MoE tier's MoE layers), which blocks activation checkpointing recomputes, and the token-in / hidden-out shell around
the blocks (TokenModel)."""
from __future__ import annotations

import functools
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


def eager_only(fn):
    """`torch.compiler.disable(fn)` without importing torch._dynamo when this module loads.

    That import costs ~2 CPU-s per process (it doubles `import torch`), and every process that imports the model
    paid it: CLI runs, Ray Train workers, tests. Here it is paid only where torch._dynamo is loaded anyway (some
    torch.compile ran or is running): the wrapper carries the attribute dynamo reads to never trace into a
    function (so compiled graphs break around it, as with torch.compiler.disable), and calls `fn` through
    torch.compiler.disable once dynamo is loaded, so nothing `fn` calls is compiled either."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:  # nothing was ever compiled in this process
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True  # what torch.compiler.disable sets on its wrapper
    return call


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
    def __init__(self, tier, *, d_model: int | None = None, d_ff: int | None = None):  # a tier's d_model and d_ff
        super().__init__()
        d_model = d_model or tier.d_model
        d_ff = d_ff or tier.d_ff
        self.w_gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)  # gate and up in one matmul
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # (B, T, d_ff) each
        return self.w_down(F.silu(gate) * up)


# Parameters that write into the residual stream in a feed-forward (initialised smaller, TokenModel.init_weights):
# the dense MLP's down projection, the experts' and the shared experts' down projections
FEED_FORWARD_WRITERS = ("mlp.w_down.weight", "experts.w_down", "shared.w_down.weight")


def checkpointed_layers(spec: str, n_layers: int) -> frozenset[int]:
    """'none' | 'all' | 'every_<k>' (blocks 0, k, 2k, ...) -> the block indices to recompute in backward."""
    if spec == "none":
        return frozenset()
    if spec == "all":
        return frozenset(range(n_layers))
    if spec.startswith("every_") and spec[6:].isdigit() and int(spec[6:]) >= 1:
        return frozenset(range(0, n_layers, int(spec[6:])))
    raise ValueError(f"activation_checkpointing={spec!r} is not allowed; choose none, all or every_<k> (k >= 1)")


class TokenModel(nn.Module):
    """The shell both families share around their blocks: token embedding (V, D), the final RMSNorm, and
    the output projection, tied to the embedding or a separate (V, D) weight. Subclasses set `blocks` and
    name the projections that write into the residual stream (RESIDUAL_WRITERS, initialised smaller)."""

    RESIDUAL_WRITERS: tuple[str, ...] = ()
    SKIP_INIT: str | None = None  # parameters whose names contain this initialise themselves

    def _build_shell(self, tier, vocab_size: int, tie_embeddings: bool, activation_checkpointing: str,
                     make_block) -> None:
        """Embedding, `tier.n_layers` blocks from make_block(tier, layer index), final norm, separate head when
        untied, in this order (the order fixes parameter names' order and so what a seed initialises)."""
        self.checkpointed = checkpointed_layers(activation_checkpointing, tier.n_layers)
        self.tok_emb = nn.Embedding(vocab_size, tier.d_model)
        self.blocks = nn.ModuleList(make_block(tier, i) for i in range(tier.n_layers))
        self.norm = RMSNorm(tier.d_model, tier.norm_eps)
        self.lm_head = None if tie_embeddings else nn.Linear(tier.d_model, vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """(V, D) weight of the output projection: logits = hidden @ output_weight.T."""
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) everywhere; the projections that write into the residual stream get
        0.02 / sqrt(2 * n_layers), so the residual's variance does not grow with depth (GPT-2); norms at 1.
        Call again after `to_empty(device=...)` when the model was built on the meta device."""
        resid_std = 0.02 / math.sqrt(2 * self.tier.n_layers)
        for name, p in self.named_parameters():
            if self.SKIP_INIT and self.SKIP_INIT in name:
                continue
            if p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(self.RESIDUAL_WRITERS):
                p.normal_(0.0, resid_std)
            else:
                p.normal_(0.0, 0.02)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Exact parameter count; exclude_embedding drops every vocabulary-sized matrix (the token
        embedding, and the separate output weight when untied), leaving the body."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.tok_emb.weight.numel() + (0 if self.lm_head is None else self.lm_head.weight.numel())
        return n

    def compile_blocks(self, **compile_kwargs):
        """torch.compile each block separately (regional compilation: one block's graph, compiled once and
        reused by the identical blocks, so compile time stays short). State-dict keys do not change."""
        for block in self.blocks:
            block.compile(**compile_kwargs)
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., V) fp32 logits, for generation and inspection of a few positions only; training
        never forms full logits (cuda_ops' fused cross-entropy takes hidden and output_weight)."""
        return F.linear(hidden, self.output_weight.to(hidden.dtype)).float()
