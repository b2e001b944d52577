"""The resonance mixer: learned damped oscillators ("eigenstates") in place of attention, O(T log T).

    from model.resonance import build_resonance_model
    model = build_resonance_model("nano", vocab_size=2000)     # or model.decoder.build_model(..., mixer="resonance")
    hidden = model(tokens, doc_ids)                            # (B, T, D) after the final RMSNorm

The layer. Channels are split into G groups of P = D / G channels (tier: n_groups, n_eigen = K). Group g has K
complex eigenvalues, for k = 1..K:

    lambda_k = exp(-(softplus(alpha_k) * dt_k + MIN_DECAY) + i * omega_k * dt_k),   dt_k = exp(clamp(log_dt_k))

so |lambda_k| = exp(-decay) <= exp(-MIN_DECAY) < 1 for ANY parameter values (stable by construction, as in
S4D and LRU), and complex input weights b_k = dt_k * (B_re + i B_im)[k] (a row of P) and output weights
c_k = (C_re + i C_im)[:, k] (a column of P). With u (B, T, G, P) the mixer's input, its output is

    y(t) = sum_{s <= t} h(t - s) u(s),      h(j) = Re( sum_k c_k lambda_k^j b_k )   (P x P, j >= 0)

i.e. per group a causal long convolution whose kernel has rank <= 2K. Written through the complex state
s_k(t) = lambda_k s_k(t-1) + b_k . u(t), y(t) = Re(sum_k c_k s_k(t)); the three forms compute exactly that:

  fft        s = causal convolution of z = b . u with lambda^t by FFT of length 2T  -- O(T log T); whole rows
             with no document resets (training without doc masking, and the generation prefill).
  scan       chunked scan: within chunks of `chunk_size` tokens a parallel (Hillis-Steele) scan of
             s(t) = a(t) s(t-1) + z(t), across chunks the state carried forward; a(t) = 0 at a document start,
             so no document sees its neighbour -- O(T log chunk); training with doc masking.
  recurrent  one token: s = lambda s + z -- generation with a state of G x K complex numbers per layer
             (O(1) memory per token instead of a KV cache).
The model picks the form itself: scan when doc_ids are given and doc masking is on, fft otherwise, recurrent for
one new token with a state. No RoPE: the kernel is the position code.

The block is x + Out(GroupRMSNorm(y) * silu(gate)), then x + SwiGLU(RMSNorm(x)), with u, gate = In(RMSNorm(x)).
Why the extra norm and gate: the state's size scales like 1 / sqrt(1 - |lambda|^2), which differs by orders of
magnitude between eigenvalues and moves during training; an RMSNorm per channel group puts the output back at
unit scale whatever the decays are, and the SiLU gate (as in H3 / Mamba) gives the layer the multiplicative
interaction a linear convolution lacks. Both are per token, so causality and document isolation are untouched.

Generation uses the same protocol as model/decoder.py: cache = model.new_kv_cache(B, max_len, left_pad);
model(prompt, kv_cache=cache); model(next[:, None], kv_cache=cache). The "cache" is ResonanceState. Left-pad
positions have their mixer input zeroed in every layer, so the state of a padded row stays exactly zero until
its first real token: each row equals its prompt run alone.

The complex core always runs in fp32 (fp64 when the model is fp64) with autocast off: cuFFT has no bf16, and
products of many eigenvalue powers need the mantissa. Powers lambda^t are formed from float64 logarithms.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.layers import RMSNorm, SwiGLU, TokenModel, eager_only
from model.tiers import ResonanceTier, get_mixer_tier

MIN_DECAY = 1e-5  # |lambda| <= exp(-1e-5): memory up to ~100k tokens, yet strictly inside the unit circle
LOG_DT_RANGE = (math.log(1e-4), 0.0)  # dt in [1e-4, 1]: omega * dt stays finite for any finite omega
FORMS = ("auto", "fft", "scan", "recurrent")


def eigen_log(alpha: torch.Tensor, omega: torch.Tensor, log_dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, K) parameters -> (log lambda complex (G, K), dt (G, K)); Re(log lambda) <= -MIN_DECAY always."""
    dt = log_dt.clamp(*LOG_DT_RANGE).exp()
    decay = F.softplus(alpha) * dt + MIN_DECAY
    return torch.complex(-decay, omega * dt), dt


def powers(log_lam: torch.Tensor, T: int, offset: int = 0, block: int = 256) -> torch.Tensor:
    """lambda^(t + offset) for t in [0, T): (T, G, K) in log_lam's complex dtype.

    Both factors of lambda^(q*block + r) = lambda^(q*block) * lambda^r come from float64 logarithms, so the phase
    at t = 131,072 is as exact as the dtype allows (fp32 products t * angle would lose ~0.03 rad there)."""
    lg = log_lam.to(torch.complex128)
    r = torch.arange(block, device=lg.device, dtype=torch.float64)  # (block,)
    q = torch.arange(offset // block, (offset + T - 1) // block + 1, device=lg.device, dtype=torch.float64) * block
    small = torch.exp(r[:, None, None] * lg).to(log_lam.dtype)  # (block, G, K)
    big = torch.exp(q[:, None, None] * lg).to(log_lam.dtype)  # (nq, G, K)
    out = (big[:, None] * small[None]).flatten(0, 1)  # (nq * block, G, K)
    start = offset - int(q[0].item())
    return out[start:start + T]


def fft_conv(z: torch.Tensor, log_lam: torch.Tensor) -> torch.Tensor:
    """s(t) = sum_{s<=t} lambda^(t-s) z(s) for z (B, T, G, K) complex, by FFT of length 2T (no wrap-around)."""
    T = z.shape[1]
    kernel = powers(log_lam, T)  # (T, G, K)
    zf = torch.fft.fft(z, n=2 * T, dim=1)  # (B, 2T, G, K)
    kf = torch.fft.fft(kernel, n=2 * T, dim=0)  # (2T, G, K)
    return torch.fft.ifft(zf * kf, dim=1)[:, :T]  # (B, T, G, K)


def linear_scan(a: torch.Tensor, z: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of s(t) = a(t) s(t-1) + z(t), s(-1) = 0, along `dim` in log2(n) parallel steps
    (Hillis-Steele). Returns (A, S): A(t) = a(0)...a(t) (what multiplies a state entering before 0), S(t) = s(t)."""
    n, d = z.shape[dim], 1
    A, S = a.expand_as(z), z
    while d < n:
        head_A, head_S = A.narrow(dim, 0, d), S.narrow(dim, 0, d)
        S = torch.cat([head_S, S.narrow(dim, d, n - d) + A.narrow(dim, d, n - d) * S.narrow(dim, 0, n - d)], dim)
        A = torch.cat([head_A, A.narrow(dim, d, n - d) * A.narrow(dim, 0, n - d)], dim)
        d *= 2
    return A, S


def chunked_scan(z: torch.Tensor, log_lam: torch.Tensor, starts: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """s for z (B, T, G, K) complex, the state reset to 0 before every token where starts (B, T) bool is True."""
    B, T, G, K = z.shape
    lam = torch.exp(log_lam.to(torch.complex128)).to(z.dtype)  # (G, K)
    a = lam.expand(B, T, G, K)
    if starts is not None:
        a = a * (~starts)[:, :, None, None].to(z.dtype)  # a(t) = 0: nothing from before t survives
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    if pad:  # trailing padding: its outputs are cut off and nothing flows backwards, so any values do
        z, a = F.pad(z, (0, 0, 0, 0, 0, pad)), F.pad(a, (0, 0, 0, 0, 0, pad))
    zc = z.view(B, n_chunks, chunk, G, K)
    A, S = linear_scan(a.reshape(B, n_chunks, chunk, G, K), zc, dim=2)  # within each chunk, from a zero state
    # Across chunks: the state leaving chunk j is A_j(last) * (state entering j) + S_j(last).
    _, H = linear_scan(A[:, :, -1], S[:, :, -1], dim=1)  # (B, n_chunks, G, K) state after each chunk
    entering = torch.cat([torch.zeros_like(H[:, :1]), H[:, :-1]], dim=1)  # (B, n_chunks, G, K)
    s = S + A * entering[:, :, None]  # (B, n_chunks, chunk, G, K)
    return s.reshape(B, n_chunks * chunk, G, K)[:, :T]


class ResonanceMixer(nn.Module):
    """u (B, T, D) real -> y (B, T, D) real: the causal kernel of the module docstring, per channel group."""

    def __init__(self, d_model: int, n_groups: int, n_eigen: int, chunk_size: int):
        super().__init__()
        if d_model % n_groups:
            raise ValueError(f"d_model={d_model} must split into n_groups={n_groups} equal groups")
        self.G, self.K, self.P, self.chunk_size = n_groups, n_eigen, d_model // n_groups, chunk_size
        G, K, P = self.G, self.K, self.P
        # 1-D on purpose: the engine applies weight decay to matrices only, and eigenvalues should not decay
        self.alpha = nn.Parameter(torch.empty(G * K))
        self.omega = nn.Parameter(torch.empty(G * K))
        self.log_dt = nn.Parameter(torch.empty(G * K))
        self.B_re, self.B_im = nn.Parameter(torch.empty(G, K, P)), nn.Parameter(torch.empty(G, K, P))
        self.C_re, self.C_im = nn.Parameter(torch.empty(G, P, K)), nn.Parameter(torch.empty(G, P, K))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """S4D-Lin: decay rate 1/2 (softplus(alpha) = 0.5), frequencies pi * k, dt log-uniform in [1e-3, 1e-1];
        B ~ N(0, 1/P), C ~ N(0, 1/K) (the group norm after the mixer makes their scale irrelevant at start)."""
        G, K, P = self.G, self.K, self.P
        self.alpha.fill_(math.log(math.expm1(0.5)))
        self.omega.copy_((math.pi * torch.arange(K, dtype=torch.float64)).repeat(G).to(self.omega.dtype))
        lo, hi = math.log(1e-3), math.log(1e-1)
        self.log_dt.copy_(torch.rand(G * K, dtype=torch.float64, device="cpu").mul(hi - lo).add(lo).to(self.log_dt))
        for w in (self.B_re, self.B_im):
            w.normal_(0.0, (2 * P) ** -0.5)
        for w in (self.C_re, self.C_im):
            w.normal_(0.0, (2 * K) ** -0.5)

    def eigen(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log lambda (G, K) complex, dt (G, K)) computed in `dtype` (default: the parameters'); lambda = exp(log lambda)."""
        shape = (self.G, self.K)
        return eigen_log(*(p.to(dtype or p.dtype).view(shape) for p in (self.alpha, self.omega, self.log_dt)))

    def eigenvalues(self) -> torch.Tensor:
        return torch.exp(self.eigen()[0])  # (G, K) complex

    def kernel(self, T: int) -> torch.Tensor:
        """The materialised causal kernel h(j), j in [0, T): (T, G, P, P) real, h[j, g, p, q] from input q to p."""
        log_lam, dt = self.eigen()
        b = torch.complex(self.B_re, self.B_im) * dt[..., None]  # (G, K, P)
        c = torch.complex(self.C_re, self.C_im)  # (G, P, K)
        return torch.einsum("gpk,jgk,gkq->jgpq", c, powers(log_lam, T), b).real

    def project_in(self, u: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """u (B, T, G, P) real -> z = b . u (B, T, G, K) complex (two real matmuls, in u's dtype)."""
        z_re = torch.einsum("btgp,gkp->btgk", u, self.B_re.to(u.dtype))
        z_im = torch.einsum("btgp,gkp->btgk", u, self.B_im.to(u.dtype))
        return torch.complex(z_re, z_im) * dt

    def project_out(self, s: torch.Tensor) -> torch.Tensor:
        """s (B, T, G, K) complex -> Re(c . s) (B, T, G, P) real."""
        c_re, c_im = self.C_re.to(s.real.dtype), self.C_im.to(s.real.dtype)
        return torch.einsum("btgk,gpk->btgp", s.real, c_re) - torch.einsum("btgk,gpk->btgp", s.imag, c_im)

    @eager_only  # complex FFTs and scans stay eager; compile fuses the rest of the block
    def forward(self, u: torch.Tensor, *, form: str = "fft", starts: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, state: torch.Tensor | None = None):
        """u (B, T, D) -> (y (B, T, D) in u's dtype, final state (B, G, K) complex).

        form: fft | scan | recurrent (token by token; generation and tests). starts (B, T) bool: document
        starts (scan only). valid (B, T) bool: False zeroes the input there (left padding). state (B, G, K):
        the state before token 0 (generation), None = zeros."""
        B, T, D = u.shape
        work = torch.float64 if self.B_re.dtype == torch.float64 else torch.float32
        with torch.autocast(device_type=u.device.type, enabled=False):
            log_lam, dt = self.eigen(work)  # fp32 even for bf16 weights
            z = self.project_in(u.to(work).view(B, T, self.G, self.P), dt)  # (B, T, G, K)
            if valid is not None:
                z = z * valid[:, :, None, None].to(z.dtype)
            if state is not None:  # s(0) = lambda s_prev + z(0): fold the incoming state into the first input
                z = torch.cat([z[:, :1] + torch.exp(log_lam) * state.to(z.dtype)[:, None], z[:, 1:]], dim=1)
            if form == "fft":
                if starts is not None:
                    raise ValueError("the FFT form cannot reset at document starts; use form='scan'")
                s = fft_conv(z, log_lam)
            elif form == "scan":
                s = chunked_scan(z, log_lam, starts, self.chunk_size)
            elif form == "recurrent":
                lam, prev, out = torch.exp(log_lam), torch.zeros_like(z[:, 0]), []
                for t in range(T):
                    keep = lam if starts is None else lam * (~starts[:, t, None, None]).to(lam.dtype)
                    prev = keep * prev + z[:, t]  # (B, G, K)
                    out.append(prev)
                s = torch.stack(out, dim=1)
            else:
                raise ValueError(f"form={form!r} is not allowed; choose fft, scan or recurrent")
            y = self.project_out(s).reshape(B, T, D)
        return y.to(u.dtype), s[:, -1]


class ResonanceState:
    """The generation "cache" of the resonance model: one (B, G, K) complex state per layer, O(1) per token.

    Same constructor as model/decoder.py's KVCache; max_len is accepted for that protocol and only bounds
    `length` (the state itself never grows). left_pad (B,) int64: pad tokens at the start of each row."""

    def __init__(self, n_layers: int, batch_size: int, max_len: int, left_pad: torch.Tensor | None = None):
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0
        self.state: list[torch.Tensor | None] = [None] * n_layers
        if left_pad is not None and tuple(left_pad.shape) != (batch_size,):
            raise ValueError(f"left_pad must have shape ({batch_size},), got {tuple(left_pad.shape)}")
        self.left_pad = None if left_pad is None else left_pad.to(torch.int64)

    def reset(self) -> None:
        self.length, self.state = 0, [None] * len(self.state)

    def valid(self, B: int, T: int, device: torch.device) -> torch.Tensor | None:
        """(B, T) bool, False at left-pad positions of the next T tokens; None when there are none."""
        if B != self.batch_size:
            raise ValueError(f"state was made for batch size {self.batch_size}, got a batch of {B}")
        if self.length + T > self.max_len:
            raise ValueError(f"generation state is full: {self.length} + {T} tokens > max_len={self.max_len}; "
                             "create it with a larger max_len")
        if self.left_pad is None or self.length >= int(self.left_pad.max()):
            return None
        t_abs = torch.arange(self.length, self.length + T, device=device)
        return t_abs[None, :] >= self.left_pad.to(device)[:, None]


class ResonanceBlock(nn.Module):
    def __init__(self, tier: ResonanceTier):
        super().__init__()
        D = tier.d_model
        self.mix_norm = RMSNorm(D, tier.norm_eps)
        self.w_in = nn.Linear(D, 2 * D, bias=False)  # mixer input u and gate in one matmul
        self.mixer = ResonanceMixer(D, tier.n_groups, tier.n_eigen, tier.chunk_size)
        self.group_norm = RMSNorm(tier.group_dim, tier.norm_eps)  # per channel group, weight shared by groups
        self.w_out = nn.Linear(D, D, bias=False)
        self.mlp_norm = RMSNorm(D, tier.norm_eps)
        self.mlp = SwiGLU(tier)

    def forward(self, x: torch.Tensor, form: str, starts=None, valid=None, state=None):
        """x (B, T, D) -> (x (B, T, D), final mixer state (B, G, K))."""
        B, T, D = x.shape
        u, gate = self.w_in(self.mix_norm(x)).chunk(2, dim=-1)  # (B, T, D) each
        y, last = self.mixer(u, form=form, starts=starts, valid=valid, state=state)
        y = self.group_norm(y.view(B, T, self.mixer.G, self.mixer.P)).view(B, T, D)
        x = x + self.w_out(y * F.silu(gate))
        return x + self.mlp(self.mlp_norm(x)), last


class ResonanceLM(TokenModel):
    """Token ids (B, T) -> hidden states (B, T, D) after the final RMSNorm; the same interface as
    model/decoder.py's Decoder (output_weight, logits, num_params, compile_blocks, new_kv_cache)."""

    RESIDUAL_WRITERS = ("w_out.weight", "mlp.w_down.weight")
    SKIP_INIT = ".mixer."  # the mixer's own reset_parameters initialises its eigenvalues and projections

    def __init__(self, tier: ResonanceTier, vocab_size: int, *, tie_embeddings: bool = True, doc_masking: bool = True,
                 activation_checkpointing: str = "none", form: str = "auto", attention: str = "auto"):
        super().__init__()
        del attention  # accepted so that build_model passes the same keywords to both families
        if form not in FORMS:
            raise ValueError(f"form={form!r} is not allowed; choose one of: {', '.join(FORMS)}")
        self.tier, self.vocab_size, self.tie_embeddings, self.doc_masking = tier, vocab_size, tie_embeddings, doc_masking
        self.form = form
        self._build_shell(tier, vocab_size, tie_embeddings, activation_checkpointing, ResonanceBlock)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """As the attention decoder (N(0, 0.02), residual writers 0.02 / sqrt(2L), norms 1), plus S4D-Lin
        eigenvalues. Call again after to_empty(device=...) when built on the meta device."""
        super().init_weights()
        for block in self.blocks:
            block.mixer.reset_parameters()

    def new_kv_cache(self, batch_size: int, max_len: int, left_pad: torch.Tensor | None = None) -> ResonanceState:
        return ResonanceState(self.tier.n_layers, batch_size, max_len, left_pad)

    def forward(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None,
                kv_cache: ResonanceState | None = None) -> torch.Tensor:
        """idx (B, T) int64, doc_ids (B, T) int or None -> hidden states (B, T, D) after the final RMSNorm."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if doc_ids is not None and doc_ids.shape != idx.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} must equal idx shape {tuple(idx.shape)}")
        starts = valid = None
        if kv_cache is not None:
            if doc_ids is not None:
                raise ValueError("generation with a state has no document masking; pass doc_ids=None")
            valid = kv_cache.valid(B, T, idx.device)
            form = "recurrent" if T == 1 else "fft"
        else:
            if self.doc_masking and doc_ids is not None:
                starts = torch.zeros_like(doc_ids, dtype=torch.bool)
                starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]  # (B, T) True at each document start
            form = self.form if self.form != "auto" else ("scan" if starts is not None else "fft")
            if form == "fft" and starts is not None:
                raise ValueError("form='fft' cannot isolate documents; use form='scan' or auto with doc masking")

        x = self.tok_emb(idx)  # (B, T, D)
        for i, block in enumerate(self.blocks):
            if kv_cache is not None:
                x, kv_cache.state[i] = block.forward(x, form, None, valid, kv_cache.state[i])  # eager
            elif self.training and i in self.checkpointed and torch.is_grad_enabled():
                x, _ = checkpoint(block, x, form, starts, use_reentrant=False)
            else:
                x, _ = block(x, form, starts)
        if kv_cache is not None:
            kv_cache.length += T
        return self.norm(x)  # (B, T, D)


def build_resonance_model(tier_name: str, vocab_size: int, **kw) -> ResonanceLM:
    """ResonanceLM for the named resonance tier; kw: tie_embeddings, doc_masking, activation_checkpointing, form."""
    return ResonanceLM(get_mixer_tier(tier_name, "resonance"), vocab_size, **kw)
