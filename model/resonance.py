"""The resonance mixer: learned damped oscillators ("eigenstates") in place of attention, O(T log T) or O(T).

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
s_k(t) = lambda_k s_k(t-1) + b_k . u(t), y(t) = Re(sum_k c_k s_k(t)). Complex numbers between the projections and
the core are (re, im) pairs on a trailing axis of 2: z = b . u is ONE real matmul (B, T, G, P) @ (G, P, 2K), and
Re(c . s) another, (B, T, G, 2K) @ (G, 2K, P); both run in the autocast dtype (bf16 on tensor cores). Only the core
between them keeps fp32 (cuda_ops/resonance_scan.py; the FFT below). The three forms compute exactly the same s:

  fft        s = causal convolution of z with lambda^t by FFT of length 2T  -- O(T log T); whole rows with no
             document resets. A custom autograd Function keeps only s (which the output projection keeps anyway)
             and gets both gradients from it and the incoming one, with no 2T-long spectrum on the tape.
  scan       s(t) = a(t) s(t-1) + z(t), a(t) = 0 at a document start, so no document sees its neighbour -- O(T).
             cuda_ops.resonance_scan: on CUDA the Numba kernel (each thread walks one channel's chunk with the
             state in registers, plus a carry across chunks; backward the reverse recurrence); elsewhere a
             log-depth (Hillis-Steele) scan within chunks of `chunk_size` tokens.
  recurrent  token by token, the definition (tests); generation steps by model/resonance_state.py, with a state
             of G x K complex numbers per layer (O(1) per token instead of a KV cache).
The model picks the form itself (`core_form`): on CUDA with the kernel, the scan for every row (it moves seven
passes of z-sized bytes per layer, fwd + bwd, where the FFT moves several 2T-long fp32 spectra); elsewhere the
scan when doc_ids are given and doc masking is on, the FFT otherwise. No RoPE: the kernel is the position code.

The block is x + Out(GroupRMSNorm(y) * silu(gate)), then x + SwiGLU(RMSNorm(x)), with u, gate = In(RMSNorm(x)).
Why the extra norm and gate: the state's size scales like 1 / sqrt(1 - |lambda|^2), which differs by orders of
magnitude between eigenvalues and moves during training; an RMSNorm per channel group puts the output back at
unit scale whatever the decays are, and the SiLU gate (as in H3 / Mamba) gives the layer the multiplicative
interaction a linear convolution lacks. Both are per token, so causality and document isolation are untouched.

Generation uses the same protocol as model/decoder.py: cache = model.new_kv_cache(B, max_len, left_pad);
model(prompt, kv_cache=cache); model(next[:, None], kv_cache=cache) (= model.decode_step(next, cache)). The
"cache" is model/resonance_state.py's ResonanceState: static fp32 state buffers and a fixed-shape step that a CUDA
graph can capture. Left-pad positions have their mixer input zeroed in every layer, so the state of a padded row
stays exactly zero until its first real token: each row equals its prompt run alone.

Precision: the core's state and sums are fp32 (fp64 when the model is fp64): cuFFT has no bf16, and a state that
decays by 1e-5 a token needs the mantissa. Powers lambda^t (FFT form) come from float64 logarithms.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cuda_ops.dispatch import resolve_backend
from cuda_ops.resonance_scan import like, resonance_scan, sequential_scan
from model.context import NOT_SPLIT, RowSplit
from model.layers import FEED_FORWARD_WRITERS, RMSNorm, TokenModel, eager_only
from model.moe import feed_forward
from model.kv_cache import decode_step
from model.resonance_state import ResonanceState
from model.resonance_state import decode_compute as state_decode_compute
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
    start = offset % block  # q starts at the block holding `offset`
    return out[start:start + T]


def _causal_conv(x: torch.Tensor, kernel_f: torch.Tensor, T: int) -> torch.Tensor:
    """x (B, T, G, K) complex convolved causally with the kernel whose length-2T spectrum is kernel_f (2T, G, K)."""
    return torch.fft.ifft(torch.fft.fft(x, n=2 * T, dim=1) * kernel_f, dim=1)[:, :T]


def _fft_states(z: torch.Tensor, log_lam: torch.Tensor, state0: torch.Tensor | None) -> torch.Tensor:
    """z (B, T, G, K, 2), log_lam (G, K, 2), state0 (B, G, K, 2) | None -> s (B, T, G, K) complex in the work dtype:
    s(t) = sum_{u<=t} lambda^(t-u) z(u) (+ lambda^(t+1) state0)."""
    work = torch.float64 if z.dtype == torch.float64 else torch.float32
    T = z.shape[1]
    llc = torch.view_as_complex(log_lam.to(work).contiguous())  # (G, K)
    kernel = powers(llc, T)  # (T, G, K)
    s = _causal_conv(torch.view_as_complex(z.to(work).contiguous()), torch.fft.fft(kernel, n=2 * T, dim=0), T)
    if state0 is not None:
        s = s + powers(llc, T, offset=1) * torch.view_as_complex(state0.to(work).contiguous())[:, None]
    return s


class FFTConv(torch.autograd.Function):
    """The FFT form without its complex intermediates on the tape: forward saves only its output s (which the
    output projection keeps anyway), log_lam and state0. Backward gets dLoss/dz(u) = sum_{t>=u} conj(lambda)^(t-u)
    gs(t) by an FFT of the time-reversed gradient, and dLoss/dlambda = sum_t r(t) conj(s(t-1)) from the saved s
    (the algebra of cuda_ops/resonance_scan.py); the 2T-long spectra of forward are never kept."""

    @staticmethod
    def forward(ctx, z, log_lam, state0):
        s = _fft_states(z, log_lam, state0)
        out = like(z, torch.view_as_real(s))
        last = torch.view_as_real(s[:, -1]).contiguous()
        ctx.save_for_backward(out, log_lam, state0)
        ctx.mark_non_differentiable(last)
        return out, last

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gs, _glast):
        out, log_lam, state0 = ctx.saved_tensors
        work = torch.float64 if out.dtype == torch.float64 else torch.float32
        B, T = out.shape[:2]
        llc = torch.view_as_complex(log_lam.to(work).contiguous())  # (G, K)
        g = torch.view_as_complex(gs.to(work).contiguous())  # (B, T, G, K)
        kernel_f = torch.fft.fft(powers(llc, T).conj(), n=2 * T, dim=0)
        r = _causal_conv(g.flip(1), kernel_f, T).flip(1)  # dLoss/dz
        s = torch.view_as_complex(out.to(work).contiguous())
        first = torch.zeros_like(s[:, :1]) if state0 is None else torch.view_as_complex(
            state0.to(work).contiguous())[:, None]
        dlam = (r * torch.cat([first, s[:, :-1]], dim=1).conj()).sum(dim=(0, 1))  # (G, K)
        dlog = dlam * torch.exp(llc).conj()  # lambda = exp(log lambda)
        return torch.view_as_real(r).to(out.dtype), torch.view_as_real(dlog).to(log_lam.dtype), None


def fft_conv(z: torch.Tensor, log_lam: torch.Tensor, state0: torch.Tensor | None = None, *,
             plain_autograd: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The FFT form: z (B, T, G, K, 2), log_lam (G, K, 2) -> (s like z, last (B, G, K, 2) in the work dtype).
    plain_autograd=True runs the same ops under autograd, which keeps every complex intermediate on the tape (the
    memory comparison of bench/mixer.py and the gradient oracle of the tests)."""
    if not plain_autograd and torch.is_grad_enabled() and (z.requires_grad or log_lam.requires_grad):
        return FFTConv.apply(z, log_lam, state0)
    s = _fft_states(z, log_lam, state0)
    return like(z, torch.view_as_real(s)), torch.view_as_real(s[:, -1])


def core_form(device: torch.device | str, doc_masked: bool) -> str:
    """The form form='auto' runs: the scan wherever the Numba kernel runs (O(T), and it resets at document starts
    for free); elsewhere the log-depth reference scan only when documents must be isolated, else the FFT."""
    if resolve_backend(device) == "numba":
        return "scan"
    return "scan" if doc_masked else "fft"


@eager_only  # complex FFTs and Numba launches stay eager; compile fuses the projections and the rest of the block
def mixer_core(form: str, z: torch.Tensor, log_lam: torch.Tensor, starts, state, chunk: int, carry=None):
    """z (B, T, G, K, 2) -> (s like z, last state (B, G, K, 2) fp32), in the named form. carry: z is one slice of a
    row split over ranks (model/context.py RowSplit.scan_carry; the scan form only)."""
    with torch.autocast(device_type=z.device.type, enabled=False):
        if carry is not None:
            if form != "scan":
                raise ValueError(f"form={form!r} cannot continue a row split over ranks; use form='scan'")
            return resonance_scan(z, log_lam, starts, chunk=chunk, carry=carry)
        if form == "fft":
            if starts is not None:
                raise ValueError("the FFT form cannot reset at document starts; use form='scan'")
            return fft_conv(z, log_lam, state)
        if form == "scan":
            return resonance_scan(z, log_lam, starts, state, chunk=chunk)
        if form == "recurrent":
            return sequential_scan(z, log_lam, starts, state)
    raise ValueError(f"form={form!r} is not allowed; choose fft, scan or recurrent")


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

    @property
    def work_dtype(self) -> torch.dtype:
        """The core's real dtype: fp32, or fp64 for an fp64 model (tests); never the autocast dtype."""
        return torch.float64 if self.B_re.dtype == torch.float64 else torch.float32

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

    def in_weight(self, dt: torch.Tensor) -> torch.Tensor:
        """(G, P, 2K): column 2k is dt_k B_re[k], column 2k + 1 is dt_k B_im[k], so u @ it = z as (re, im) pairs."""
        w = torch.stack([self.B_re, self.B_im], dim=-1) * dt.to(self.B_re.dtype)[:, :, None, None]  # (G, K, P, 2)
        return w.transpose(1, 2).flatten(2)

    def out_weight(self) -> torch.Tensor:
        """(G, 2K, P): rows 2k, 2k + 1 are C_re[:, k] and -C_im[:, k], so s @ it = Re(c . s)."""
        return torch.stack([self.C_re, -self.C_im], dim=-1).permute(0, 2, 3, 1).flatten(1, 2)

    def forward(self, u: torch.Tensor, *, form: str = "fft", starts: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, state: torch.Tensor | None = None, carry=None):
        """u (B, T, D) -> (y (B, T, G, P) in u's dtype, final state (B, G, K, 2) fp32 (re, im)).

        form: fft | scan | recurrent. starts (B, T) bool: document starts (scan, recurrent). valid (B, T) bool: False
        zeroes the input there (left padding). state (B, G, K, 2): the state before token 0 (generation), None = 0.
        carry: u is this rank's slice of a row split over ranks (RowSplit.scan_carry; the scan form)."""
        B, T, D = u.shape
        G, K, P = self.G, self.K, self.P
        log_lam, dt = self.eigen(self.work_dtype)  # (G, K): fp32 even for bf16 weights
        # One batched matmul per group in the autocast dtype (bf16 tensor cores), like any nn.Linear. The (G, B*T, .)
        # layout is the matmuls' own: u is read through a strided view, and z, s stay in it (the kernel and the FFT
        # take strided tensors), so neither projection copies its input and autograd keeps no second copy of s.
        z = torch.bmm(u.reshape(B * T, G, P).transpose(0, 1), self.in_weight(dt))  # (G, B*T, 2K)
        z = z.view(G, B, T, K, 2).permute(1, 2, 0, 3, 4)  # (B, T, G, K, 2) view
        if valid is not None:
            z = z * valid[:, :, None, None, None].to(z.dtype)
        s, last = mixer_core(form, z, torch.view_as_real(log_lam), starts, state, self.chunk_size, carry)  # z's layout
        y = torch.bmm(s.permute(2, 0, 1, 3, 4).reshape(G, B * T, 2 * K), self.out_weight())  # (G, B*T, P)
        return y.view(G, B, T, P).permute(1, 2, 0, 3).to(u.dtype), last  # (B, T, G, P) view


class ResonanceBlock(nn.Module):
    """x + mixer half, then x + MLP half. recompute_mixer: the mixer half (norm, projections, core, group norm,
    gate, W_out) is recomputed in backward instead of kept (activation_checkpointing="mixer"): a quarter to a third
    of a block's saved activations for ~7% more FLOPs (tier B), since the core is a few cheap passes and its
    matmuls are a quarter of the block's; attention has no such cheap half at long context."""

    def __init__(self, tier: ResonanceTier, recompute_mixer: bool = False, layer: int = 0):
        super().__init__()
        self.recompute_mixer = recompute_mixer
        D = tier.d_model
        self.mix_norm = RMSNorm(D, tier.norm_eps)
        self.w_in = nn.Linear(D, 2 * D, bias=False)  # mixer input u and gate in one matmul
        self.mixer = ResonanceMixer(D, tier.n_groups, tier.n_eigen, tier.chunk_size)
        self.group_norm = RMSNorm(tier.group_dim, tier.norm_eps)  # per channel group, weight shared by groups
        self.w_out = nn.Linear(D, D, bias=False)
        self.mlp_norm = RMSNorm(D, tier.norm_eps)
        self.mlp = feed_forward(tier, layer)  # SwiGLU, or the mixture of experts (model/moe.py)

    def forward(self, x: torch.Tensor, form: str, starts=None, valid=None, state=None, carry=None):
        """x (B, T, D) -> (x (B, T, D), final mixer state (B, G, K, 2)). carry: a row split over ranks."""
        if self.recompute_mixer and self.training and torch.is_grad_enabled():
            mixed, last = checkpoint(self.mix, x, form, starts, valid, state, carry, use_reentrant=False)
        else:
            mixed, last = self.mix(x, form, starts, valid, state, carry)
        x = x + mixed
        return x + self.mlp(self.mlp_norm(x)), last

    def mix(self, x: torch.Tensor, form: str, starts=None, valid=None, state=None, carry=None):
        """The mixer half: W_out(GroupRMSNorm(y) * silu(gate)) with u, gate = W_in(RMSNorm(x)) and y the mixer's
        output. x (B, T, D) -> ((B, T, D), final mixer state (B, G, K, 2))."""
        u, gate = self.w_in(self.mix_norm(x)).chunk(2, dim=-1)  # (B, T, D) each
        y, last = self.mixer(u, form=form, starts=starts, valid=valid, state=state, carry=carry)
        return self.gated_out(y, gate), last

    def gated_out(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y (B, T, G, P), gate (B, T, D) -> W_out(GroupRMSNorm(y) * silu(gate)) (B, T, D); shared with the decode
        step."""
        B, T, D = gate.shape
        return self.w_out(self.group_norm(y).reshape(B, T, D) * F.silu(gate))


class ResonanceLM(TokenModel):
    """Token ids (B, T) -> hidden states (B, T, D) after the final RMSNorm; the same interface as
    model/decoder.py's Decoder (output_weight, logits, num_params, compile_blocks, new_kv_cache, decode_step)."""

    RESIDUAL_WRITERS = ("w_out.weight", *FEED_FORWARD_WRITERS)
    CONTEXT_LAYOUT = "contiguous"  # a row split over ranks: slices in order, the scan's state carried across them
    SKIP_INIT = ".mixer."  # the mixer's own reset_parameters initialises its eigenvalues and projections

    def __init__(self, tier: ResonanceTier, vocab_size: int, *, tie_embeddings: bool = True, doc_masking: bool = True,
                 activation_checkpointing: str = "none", form: str = "auto", attention: str = "auto"):
        super().__init__()
        del attention  # accepted so that build_model passes the same keywords to both families
        if form not in FORMS:
            raise ValueError(f"form={form!r} is not allowed; choose one of: {', '.join(FORMS)}")
        self.tier, self.vocab_size, self.tie_embeddings, self.doc_masking = tier, vocab_size, tie_embeddings, doc_masking
        self.form = form
        recompute_mixer = activation_checkpointing == "mixer"  # the rest of the specs are the shell's (whole blocks)
        self._build_shell(tier, vocab_size, tie_embeddings, "none" if recompute_mixer else activation_checkpointing,
                          lambda t, i: ResonanceBlock(t, recompute_mixer, i))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """As the attention decoder (N(0, 0.02), residual writers 0.02 / sqrt(2L), norms 1), plus S4D-Lin
        eigenvalues. Call again after to_empty(device=...) when built on the meta device."""
        super().init_weights()
        for block in self.blocks:
            block.mixer.reset_parameters()

    def training_form(self, device: torch.device | str) -> str:
        """What a training forward's core runs on `device`, for FLOP counting (model/flops.py): "kernel" (the
        Numba scan), "scan" (the reference scan) or "fft"."""
        form = core_form(device, self.doc_masking) if self.form == "auto" else self.form
        return "kernel" if form == "scan" and resolve_backend(device) == "numba" else form

    def new_kv_cache(self, batch_size: int, max_len: int, left_pad: torch.Tensor | None = None, *,
                     dtype: torch.dtype | None = None) -> ResonanceState:
        """Static generation state on the model's device (model/resonance_state.py); dtype of the decode step's
        projections: the autocast dtype when autocast is on (create the state inside the autocast region)."""
        return ResonanceState(self, batch_size, max_len, left_pad, dtype=dtype)

    def decode_step(self, tok: torch.Tensor, kv_cache: ResonanceState) -> torch.Tensor:
        """tok (B,) int64, one new token per row -> hidden (B, D): the fixed-shape recurrent step
        (what `self(tok[:, None], kv_cache=cache)` runs, without the sequence axis)."""
        return decode_step(self, tok, kv_cache)

    def decode_compute(self, tok: torch.Tensor, kv_cache: ResonanceState, span: int | None = None) -> torch.Tensor:
        """decode_step's graph-safe part (device state only, fixed shapes): what generate.py compiles and captures
        in a CUDA graph. It advances kv_cache.pos, not kv_cache.length. span: the generation loop's attention-span
        argument; a recurrent state has none (its step is the same at any length), so it is ignored."""
        del span
        return state_decode_compute(self, tok, kv_cache)

    def forward(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None,
                kv_cache: ResonanceState | None = None, context: RowSplit = NOT_SPLIT) -> torch.Tensor:
        """idx (B, T) int64, doc_ids (B, T) int or None -> hidden states (B, T, D) after the final RMSNorm.
        context (model/context.py): a row split over ranks; idx and doc_ids are the whole row, the output this rank's
        contiguous slice (B, T / context.degree, D), and every mixer runs the scan with its state carried across."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if doc_ids is not None and doc_ids.shape != idx.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} must equal idx shape {tuple(idx.shape)}")
        starts = valid = carry = None
        if kv_cache is not None:
            if doc_ids is not None:
                raise ValueError("generation with a state has no document masking; pass doc_ids=None")
            if context.degree > 1:
                raise ValueError("generation runs on one rank: a recurrent state takes no row split (context)")
            if T == 1:
                return decode_step(self, idx[:, 0], kv_cache)[:, None]  # (B, 1, D): the static recurrent step
            kv_cache.check(B, T)
            valid = kv_cache.valid(T, idx.device)
            form = core_form(idx.device, False) if self.form == "auto" else self.form
        else:
            if self.doc_masking and doc_ids is not None:
                starts = torch.zeros_like(doc_ids, dtype=torch.bool)
                starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]  # (B, T) True at each document start
            form = self.form if self.form != "auto" else core_form(idx.device, starts is not None)
            if form == "fft" and starts is not None:
                raise ValueError("form='fft' cannot isolate documents; use form='scan' or auto with doc masking")
            if context.degree > 1:  # document starts found on the whole row; this rank's slice of it from here on
                if self.form not in ("auto", "scan"):
                    raise ValueError(f"form={self.form!r} cannot continue a row split over ranks; use auto or scan")
                form, carry = "scan", context.scan_carry
                idx, starts = context.take(idx), None if starts is None else context.take(starts)

        x = self.tok_emb(idx)  # (B, T, D)
        for i, block in enumerate(self.blocks):
            if kv_cache is not None:  # .forward: eager even if compiled; the state continues from the cache's
                state = kv_cache.state[i] if kv_cache.length > 0 else None
                x, last = block.forward(x, form, None, valid, state)
                kv_cache.state[i].copy_(last)
            elif self.training and i in self.checkpointed and torch.is_grad_enabled():
                x, _ = checkpoint(block, x, form, starts, None, None, carry, use_reentrant=False)
            else:
                x, _ = block(x, form, starts, carry=carry)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm(x)  # (B, T, D)


def build_resonance_model(tier_name: "str | ResonanceTier", vocab_size: int, **kw) -> ResonanceLM:
    """ResonanceLM for the resonance tier (its name, or the ResonanceTier itself); kw: tie_embeddings, doc_masking, activation_checkpointing (none,
    all, every_<k>, or mixer: recompute every block's mixer half), form."""
    tier = get_mixer_tier(tier_name, "resonance") if isinstance(tier_name, str) else tier_name
    return ResonanceLM(tier, vocab_size, **kw)
