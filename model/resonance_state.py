"""The generation state of model/resonance.py and its one-token decode step (the twin of model/kv_cache.py).

    cache = model.new_kv_cache(batch_size=B, max_len=P + N, left_pad=pad)   # every buffer allocated here, once
    h = model(prompt, kv_cache=cache)            # prefill (B, P): the scan kernel on CUDA, the FFT form on CPU
    h = model.decode_step(tok, cache)            # tok (B,) -> (B, D); the same as model(tok[:, None], kv_cache=cache)
    h = model.decode_compute(tok, cache)         # the graph-safe part generate.py compiles and captures

O(1) per token whatever the prompt length: a layer's whole memory of the past is its state, G x K complex numbers
per row, and a decode step is s = lambda s + b . u(t) on it plus the block's per-token work, the same number of
operations after 10 tokens or 100,000.

Static, like the attention family's KV cache, so the step can be compiled and captured once in a CUDA graph with
the sampler, and replayed (model/decode_loop.py): the states (n_layers, B, G, K, 2) are fp32 buffers allocated
zeroed here and updated in place with real arithmetic (no complex dtype, which inductor does not fuse); the
position `pos` is a (1,) int64 device tensor; the left pads (B,) live on the device. There is no attention span:
the step is the same at every length, so one graph serves the whole generation. Fixed for one generation, and so computed here once from the weights rather than at every step (a dozen small kernels per layer):
lambda per layer (exponentiated in float64 and rounded once, as the scan kernel does) and the mixer's folded
projections (G, P, 2K) and (G, 2K, P), in the decode dtype (bf16 under autocast: a step reads them once per token).
A model whose weights change after the state was made (training) needs a new state: generate.py makes one per call.
The state itself never drops to bf16: it accumulates 1e5 tokens of inputs with decays as slow as 1e-5 a token.

`length` (host int) and `pos` both count the tokens seen, pads included. Eager calls (prefill, `decode_step`, which
is model/kv_cache.py's for both families) advance both; `decode_compute`, the graph-safe part, advances only `pos`,
and whoever replays it keeps `length`.
"""
from __future__ import annotations

import copy

import torch

from cuda_ops.resonance_scan import lambdas


def _folded_input(block, b_in: torch.Tensor) -> torch.Tensor:
    """block.w_in (2D, D) and the mixer's input weight b_in (G, P, 2K) -> (D, G x 2K + D): RMSNorm(x) @ it gives z
    (the mixer's input, (re, im) pairs per group) and then the gate, as block.mix computes them in two matmuls."""
    G, P, K2 = b_in.shape
    w = block.w_in.weight.double()  # (2D, D): rows [0, D) make u, rows [D, 2D) the gate
    D = w.shape[1]
    w_u = w[:D].t().reshape(D, G, P)  # (D_in, G, P)
    w_z = torch.einsum("dgp,gpk->dgk", w_u, b_in.double()).reshape(D, G * K2)  # (D_in, G x 2K), rounded once
    return torch.cat([w_z, w[D:].t()], dim=1).to(b_in.dtype)


class ResonanceState:
    """The resonance model's generation "cache": one (B, G, K, 2) fp32 state per layer, O(1) in the prompt length.

    Same constructor protocol as model/kv_cache.py's KVCache (max_len only bounds `length`: the state never grows).
    state: a list of n_layers buffers (B, G, K, 2) fp32 (fp64 for an fp64 model); lam (n_layers, G, K, 2) (re, im)
    in the state's dtype; w_step (n_layers, D, G x 2K + D): [W_z | W_gate], the block's input side folded (module
    docstring), and w_out (n_layers, G, 2K, P) in `dtype`; pos (1,) int64; pad (B,) int64 (zeros without left_pad)."""

    def __init__(self, model, batch_size: int, max_len: int, left_pad: torch.Tensor | None = None, *,
                 dtype: torch.dtype | None = None):
        if left_pad is not None and tuple(left_pad.shape) != (batch_size,):
            raise ValueError(f"left_pad must have shape ({batch_size},), got {tuple(left_pad.shape)}")
        if max_len < 1:
            raise ValueError(f"generation state max_len must be >= 1, got {max_len}")
        weight = model.output_weight
        device = weight.device
        if dtype is None:
            autocast = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if autocast else weight.dtype
        mixers = [block.mixer for block in model.blocks]
        m = mixers[0]
        self.batch_size, self.max_len, self.dtype, self.length = batch_size, max_len, dtype, 0
        # one buffer per layer (as model/kv_cache.py's): a compiled step's in-place write into a view of one stacked
        # tensor would be functionalised into a copy of the whole stack per layer
        self.state = [torch.zeros(batch_size, m.G, m.K, 2, dtype=m.work_dtype, device=device) for _ in mixers]
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)  # the next token's index, pads included
        self.left_pad = None if left_pad is None else left_pad.to(device=device, dtype=torch.int64)
        self.pad = self.left_pad if self.left_pad is not None else torch.zeros(batch_size, dtype=torch.int64,
                                                                                device=device)
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            eigen = [mixer.eigen(mixer.work_dtype) for mixer in mixers]  # (log lambda, dt) per layer
            self.lam = torch.stack([torch.view_as_real(lambdas(torch.view_as_real(log_lam)))
                                    for log_lam, _ in eigen])  # (L, G, K, 2) (re, im)
            self.w_step = torch.stack([_folded_input(block, mx.in_weight(dt).to(mx.work_dtype))
                                       for block, mx, (_, dt) in zip(model.blocks, mixers, eigen)]).to(dtype)
            self.w_out = torch.stack([mx.out_weight() for mx in mixers]).to(dtype)

    def reset(self) -> None:
        self.length = 0
        self.pos.zero_()
        for s in self.state:
            s.zero_()

    def check(self, B: int, T: int) -> None:
        """A clear error for a batch of the wrong size or a state without room for T more tokens (host-side)."""
        if B != self.batch_size:
            raise ValueError(f"state was made for batch size {self.batch_size}, got a batch of {B}")
        if self.length + T > self.max_len:
            raise ValueError(f"generation state is full: {self.length} + {T} tokens > max_len={self.max_len}; "
                             "create it with a larger max_len")

    def advance(self, T: int) -> None:
        self.length += T
        self.pos += T

    def select_rows(self, index: torch.Tensor) -> "ResonanceState":
        """A state whose row i is a copy of this state's row index[i] (index (R,) int64): one prompt's prefix, run
        once, continued by several rows (as model/kv_cache.py KVCache.select_rows). The weights are shared."""
        rows = copy.copy(self)
        rows.batch_size = int(index.numel())
        rows.state = [s.index_select(0, index) for s in self.state]
        rows.left_pad = None if self.left_pad is None else self.left_pad.index_select(0, index)
        rows.pad = self.pad.index_select(0, index)
        rows.pos = self.pos.clone()
        return rows

    def valid(self, T: int, device: torch.device) -> torch.Tensor | None:
        """(B, T) bool, False at left-pad positions of the next T tokens (device ops, no host sync); None when the
        rows have no left pads."""
        if self.left_pad is None:
            return None
        t_abs = torch.arange(self.length, self.length + T, device=device)
        return t_abs[None, :] >= self.left_pad.to(device)[:, None]


def decode_compute(model, tok: torch.Tensor, cache: ResonanceState) -> torch.Tensor:
    """The graph-safe part of a decode step: tok (B,) int64 -> hidden (B, D) after the final RMSNorm.

    Reads and writes only device state (the states in place, cache.pos += 1); every shape is fixed by the batch,
    so the step never recompiles and a CUDA graph can replay it. Does not check capacity and does not advance
    cache.length: use `decode_step` unless you replay this in a CUDA graph."""
    B = tok.shape[0]
    mixer0 = model.blocks[0].mixer
    G, K, P = mixer0.G, mixer0.K, mixer0.P
    keep = (cache.pos >= cache.pad).to(cache.state[0].dtype)[:, None, None, None]  # (B, 1, 1, 1): 0 on a left pad
    x = model.tok_emb(tok[:, None])  # (B, 1, D)
    for i, block in enumerate(model.blocks):
        zg = block.mix_norm(x)[:, 0].to(cache.w_step.dtype) @ cache.w_step[i]  # (B, G*2K + D): z, then the gate
        z = zg[:, :G * 2 * K].view(B, G, K, 2).to(cache.state[0].dtype) * keep  # (B, G, K, 2)
        gate = zg[:, None, G * 2 * K:]  # (B, 1, D) in the decode dtype, as block.w_in gives it
        s, lam = cache.state[i], cache.lam[i]  # (B, G, K, 2), (G, K, 2): real pairs, so torch.compile fuses it
        s_re = lam[..., 0] * s[..., 0] - lam[..., 1] * s[..., 1] + z[..., 0]  # s = lambda s + z
        s_im = lam[..., 0] * s[..., 1] + lam[..., 1] * s[..., 0] + z[..., 1]
        s.copy_(torch.stack([s_re, s_im], dim=-1))  # in place: the static buffer
        y = torch.bmm(cache.state[i].flatten(-2).transpose(0, 1).to(cache.w_out.dtype), cache.w_out[i])  # (G, B, P)
        x = x + block.gated_out(y.transpose(0, 1)[:, None].to(gate.dtype), gate)  # y (B, 1, G, P) as the mixer's
        x = x + block.mlp(block.mlp_norm(x))
    cache.pos += 1
    return model.norm(x)[:, 0]  # (B, D)
