"""Resonance scan: the linear recurrence of the resonance mixer, s(t) = a(t) s(t-1) + z(t) over complex channels,
forward and backward, in one pass per chunk plus a carry across chunks, with fp32 state in registers.

    from cuda_ops.resonance_scan import resonance_scan
    s, last = resonance_scan(z, log_lam, starts)     # z (B, T, G, K, 2) (re, im) pairs -> s like z; last (B, G, K, 2)
    s.square().sum().backward()                      # grads reach z and log_lam (G, K, 2)

a(t) = lambda_{g,k} = exp(log_lam) inside a document and 0 at a document start (starts (B, T) bool), so no document
sees its neighbour. The state and every sum are fp32; z and s are read and written in their own dtype (bf16 under
autocast: half the bytes of fp32, one 32-bit load per complex number). Backends as in cuda_ops/dispatch.py: the Numba
kernels for CUDA tensors with numba-cuda, the pure-torch reference otherwise (LONGTRAIN_KERNELS forces one).

Index names (fixed for this file, as in llm.c's dev/cuda files):
    B    rows                          T    tokens per row; t a token
    G    channel groups                K    eigenvalues per group; (g, k) a channel: one complex number per row, token
    L    chunk length, the tokens one thread walks      NC = ceil(T / L) chunks; j a chunk, tokens [t0, t1)
    lam  lambda_{g,k}, |lam| < 1       m(t) = 0 at a document start, else 1;     a(t) = m(t) lam
    A_j  product of a(t) over chunk j  S_j  chunk j's last state when started from zero
    H_j  the state entering chunk j: H_0 the initial state (0 in training on one rank; the carry from the ranks
         before under context parallelism), H_{j+1} = A_j H_j + S_j
    gs(t) = dLoss/ds(t) (what backward receives)      r(t) = dLoss/dz(t) = gs(t) + conj(a(t+1)) r(t+1) (the adjoint)
    E_j  the adjoint entering chunk j from its right: conj(a(t1)) r(t1); for the last chunk 0 (or, under context
         parallelism, the adjoint the ranks after this one send back)
    i    the global thread index; threads are ordered (b, j, g, k) with k fastest, so the 32 lanes of a warp read
         32 neighbouring channels of one token: coalesced loads of the (B, T, G, K) layout at every step
Complex numbers in registers are (re, im) pairs of fp32; in memory a trailing axis of 2 (or one packed int32 for bf16).
Complex gradients follow torch's convention: dLoss/dRe + i dLoss/dIm. Then d/dp (a p) = conj(a) gs, d/da = gs conj(p).

Forward ("reduce, carry, apply"; one thread per (b, j, g, k), the state in registers):
  1. reduce  walk chunk j from zero: A_j and S_j                                      reads z
  2. carry   one thread per (b, g, k) walks the NC chunk summaries: H_{j+1} = A_j H_j + S_j      O(B G K NC)
  3. apply   walk chunk j again from H_j, writing s(t); the last chunk writes the final state     reads z, writes s
When B G K channels alone fill the GPU, NC = 1 and only pass 3 runs (one read, one write). Reduce-then-scan reads z
twice and writes s once; scan-then-propagate would write and reread a per-token partial state instead (4 passes).
Backward runs the same three passes in reverse time:
  1. reduce  X_j = conj(a(t0)) r_local(t0) (the adjoint of chunk j alone, carried one step left), Y_j = conj(A_j)
  2. carry   E_{j-1} = X_j + Y_j E_j, from E_{NC-1} = 0
  3. apply   walk chunk j downwards from E_j: r(t) = gs(t) + carry, written as dLoss/dz(t), and the eigenvalue
             gradient dLoss/dlam = sum over b and t with m(t) = 1 of r(t) conj(s(t-1)), from s itself
Context parallelism (`carry`; model/context.py): a row split over ranks in contiguous slices is one more level of
chunks. Each rank reduces its whole slice (pass 1 and the fold of its chunk summaries: A, S), the ranks exchange those
summaries (`carry`, an all-gather and an exclusive prefix over the ranks before), and pass 2 starts from the carry
as H_0; backward likewise reduces (X, Y), exchanges in reverse rank order, and pass 2 starts from the adjoint the
later ranks send as E_{NC-1}. One exchange each way per layer, of (B, G, K) complex numbers. The reference path
does the same with closed forms for the summaries and an explicit reverse scan, in the Function (ReferenceScanFunction)
that differentiates every reference scan: forward without a tape, backward the reverse recurrence, saving s.
The Function saves its OUTPUT s, not z: the output projection after the scan keeps s for its own weight gradient,
so the tape holds no tensor for the scan that it would not hold anyway, and nothing per pass. Backward reads gs
twice and s once. (In bf16, dLoss/dlam then sums products with the bf16-rounded s, in fp32: a relative error of
order 2^-9 in the sum's terms, far below what the bf16 matmuls around it add.)

Layout of this file: (a) reference (pure torch: the CPU path; `sequential_scan` is the definition the tests run in
fp64) (b) the Numba kernels (c) launch configuration and the bytes-moved model (d) autograd Function, public API.
It is longer than the other kernel files because one scan is six kernels: three passes each way, and a row split
over ranks adds the reference's slice summaries and reverse scan.
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cuda_ops.dispatch import as_numba, check_same_device, resolve_backend, torch_stream

REFERENCE_CHUNK = 256  # the reference's default chunk (the resonance tiers' chunk_size)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype the state is kept in: fp64 for fp64 inputs (tests), fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_complex(x: torch.Tensor, real_dtype: torch.dtype) -> torch.Tensor:
    """(..., 2) real pairs -> (...) complex in real_dtype's complex type (a view when already contiguous fp32/64)."""
    return torch.view_as_complex(x.to(real_dtype).contiguous())


def like(z: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """`pairs` (B, T, G, K, 2) in z's dtype and z's memory layout (a strided z gets a strided s: what the output
    projection reads without a copy). Differentiable."""
    return torch.empty_like(z).copy_(pairs)


def lambdas(log_lam: torch.Tensor) -> torch.Tensor:
    """log_lam (G, K, 2) real pairs -> lambda (G, K) complex, exponentiated in float64 and rounded once to the work
    dtype: every path (reference, kernel, generation) multiplies by the same lambda."""
    work = _work_dtype(log_lam.dtype)
    lam = torch.exp(torch.view_as_complex(log_lam.to(torch.float64).contiguous()))
    return lam.to(torch.complex128 if work == torch.float64 else torch.complex64)


# ---------------------------------------------------------------------------------------------------------------
# (a) reference: pure torch, differentiable by autograd
# ---------------------------------------------------------------------------------------------------------------

def sequential_scan(z: torch.Tensor, log_lam: torch.Tensor, starts: torch.Tensor | None = None,
                    state0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one token at a time: s(t) = a(t) s(t-1) + z(t), s(-1) = state0 (or 0).

    z (B, T, G, K, 2), log_lam (G, K, 2), starts (B, T) bool, state0 (B, G, K, 2) -> (s like z, last (B, G, K, 2) in
    the work dtype). O(T) Python steps: the generation step, and the fp64 oracle of the tests."""
    work = _work_dtype(z.dtype)
    zc, lam = _as_complex(z, work), lambdas(log_lam)
    prev = torch.zeros_like(zc[:, 0]) if state0 is None else _as_complex(state0, work)  # (B, G, K)
    out = []
    for t in range(zc.shape[1]):
        keep = lam if starts is None else lam * (~starts[:, t, None, None]).to(lam.dtype)
        prev = keep * prev + zc[:, t]
        out.append(prev)
    s = torch.stack(out, dim=1)  # (B, T, G, K) complex
    return like(z, torch.view_as_real(s)), torch.view_as_real(s[:, -1])


def _linear_scan(a: torch.Tensor, z: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def scan_reference(z: torch.Tensor, log_lam: torch.Tensor, starts: torch.Tensor | None = None,
                   state0: torch.Tensor | None = None, chunk: int = REFERENCE_CHUNK):
    """The CPU path, vectorised: within chunks of `chunk` tokens a log-depth (Hillis-Steele) scan, across chunks
    the state carried forward. Same contract as `sequential_scan`; memory O(B T G K) per step, log2(chunk) steps."""
    work = _work_dtype(z.dtype)
    zc, lam = _as_complex(z, work), lambdas(log_lam)
    B, T, G, K = zc.shape
    if state0 is not None:  # s(0) = a(0) state0 + z(0): fold the incoming state into the first input
        keep0 = lam if starts is None else lam * (~starts[:, 0, None, None]).to(lam.dtype)
        zc = torch.cat([zc[:, :1] + (keep0 * _as_complex(state0, work))[:, None], zc[:, 1:]], dim=1)
    a = lam.expand(B, T, G, K)
    if starts is not None:
        a = a * (~starts)[:, :, None, None].to(zc.dtype)  # a(t) = 0: nothing from before t survives
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    if pad:  # trailing padding: its outputs are cut off and nothing flows backwards, so any values do
        zc, a = F.pad(zc, (0, 0, 0, 0, 0, pad)), F.pad(a, (0, 0, 0, 0, 0, pad))
    A, S = _linear_scan(a.reshape(B, n_chunks, chunk, G, K), zc.view(B, n_chunks, chunk, G, K), dim=2)
    # Across chunks: the state leaving chunk j is A_j(last) * (state entering j) + S_j(last).
    _, H = _linear_scan(A[:, :, -1], S[:, :, -1], dim=1)  # (B, n_chunks, G, K) state after each chunk
    entering = torch.cat([torch.zeros_like(H[:, :1]), H[:, :-1]], dim=1)  # (B, n_chunks, G, K)
    s = (S + A * entering[:, :, None]).reshape(B, n_chunks * chunk, G, K)[:, :T]
    return like(z, torch.view_as_real(s)), torch.view_as_real(s[:, -1])


def _powers(log_lam: torch.Tensor, n: int, work: torch.dtype) -> torch.Tensor:
    """lambda^j for j in [0, n]: (n + 1, G, K) complex in the work dtype, from float64 logarithms."""
    lg = torch.view_as_complex(log_lam.to(torch.float64).contiguous())  # (G, K)
    j = torch.arange(n + 1, device=log_lam.device, dtype=torch.float64)[:, None, None]
    return torch.exp(j * lg).to(torch.complex128 if work == torch.float64 else torch.complex64)


def slice_summary(zc: torch.Tensor, log_lam: torch.Tensor, starts: torch.Tensor | None):
    """zc (B, T, G, K) complex, starts (B, T) bool | None -> (A, S) (B, G, K) complex: the product of a(t) over the
    slice (0 when a document starts in it) and the state the slice ends in from zero, S = sum over the tokens from its
    last document start on of lambda^(T-1-t) z(t). The reference's pass 1 under context parallelism, one reduction."""
    B, T = zc.shape[:2]
    P = _powers(log_lam, T, torch.float64 if zc.dtype == torch.complex128 else torch.float32)
    if starts is None:
        return P[T].expand(B, *P.shape[1:]).clone(), torch.einsum("btgk,tgk->bgk", zc, P[:T].flip(0))
    idx = torch.arange(T, device=zc.device)
    keep = idx[None] >= torch.where(starts, idx, 0).amax(1)[:, None]  # (B, T): at or after the last start
    none = (~starts.any(1)).to(zc.dtype)[:, None, None]
    return P[T][None] * none, torch.einsum("btgk,tgk->bgk", zc * keep[:, :, None, None], P[:T].flip(0))


def adjoint_summary(gc: torch.Tensor, log_lam: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """gc (B, T, G, K) complex dLoss/ds of the slice -> X (B, G, K): what the slice alone sends left, the gradient of
    the state entering it, sum over the tokens before its first document start of conj(lambda^(t+1)) gs(t)."""
    B, T = gc.shape[:2]
    P = _powers(log_lam, T, torch.float64 if gc.dtype == torch.complex128 else torch.float32)
    if starts is not None:
        idx = torch.arange(T, device=gc.device)
        first = torch.where(starts, idx, T).amin(1)  # (B,): T when no document starts in the slice
        gc = gc * (idx[None] < first[:, None])[:, :, None, None]
    return torch.einsum("btgk,tgk->bgk", gc, P[1:].conj())


def reverse_scan(g: torch.Tensor, log_lam: torch.Tensor, starts: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """The adjoint recurrence r(t) = g(t) + conj(a(t+1)) r(t+1) (r(T) = 0) on the reference: the forward scan of the
    time-reversed g with conj(lambda) and the starts moved one token (a(t+1) is zero where t+1 starts a document).
    g (B, T, G, K, 2) -> r (B, T, G, K) complex."""
    rev = None
    if starts is not None:
        rev = torch.cat([starts[:, 1:], torch.zeros_like(starts[:, :1])], dim=1).flip(1)
    conj = log_lam * torch.tensor([1.0, -1.0], dtype=log_lam.dtype, device=log_lam.device)
    r, _ = scan_reference(g.flip(1), conj, rev, None, chunk)
    return _as_complex(r, _work_dtype(g.dtype)).flip(1)


class ReferenceScanFunction(torch.autograd.Function):
    """The reference's autograd: forward the log-depth scan without a tape, backward the reverse recurrence (one more
    scan) and dLoss/dlam from the saved output, like ResonanceScanFunction: it saves s and the initial state, where
    autograd through the log-depth scan kept every level of it (twice the step's memory and more). With `carry`, one
    contiguous slice of a row split over ranks (module docstring): forward sends (A, S) and starts from the carry it
    gets back; backward sends X and adds the adjoint it gets back at the last token. state0 takes no gradient."""

    @staticmethod
    def forward(ctx, z, log_lam, starts, carry, chunk, state0=None):
        work = _work_dtype(z.dtype)
        A = None
        if carry is not None:
            A, S = slice_summary(_as_complex(z, work), log_lam, starts)
            state0 = carry(torch.view_as_real(A), torch.view_as_real(S), False)
            A = torch.view_as_real(A)
        B, _, G, K, _ = z.shape
        H = (torch.zeros(B, G, K, 2, dtype=work, device=z.device) if state0 is None
             else state0.detach().to(work))  # (B, G, K, 2): s(-1)
        s, last = scan_reference(z, log_lam, starts, H, chunk)
        ctx.save_for_backward(s, log_lam, starts, H, A)
        ctx.carry, ctx.chunk = carry, chunk
        ctx.mark_non_differentiable(last)
        return s, last

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gs, _glast):
        s, log_lam, starts, H, A = ctx.saved_tensors
        work = _work_dtype(s.dtype)
        g = _as_complex(gs, work)
        if ctx.carry is not None:
            X = adjoint_summary(g, log_lam, starts)
            E = ctx.carry(torch.view_as_real(_as_complex(A, work).conj().resolve_conj()), torch.view_as_real(X), True)
            g = g.clone()
            g[:, -1] += _as_complex(E, work)  # the adjoint of the state this slice hands to the next rank
        r = reverse_scan(torch.view_as_real(g), log_lam, starts, ctx.chunk)  # dLoss/dz, (B, T, G, K)
        prev = torch.cat([_as_complex(H, work)[:, None], _as_complex(s, work)[:, :-1]], dim=1)  # s(t-1)
        terms = r * prev.conj()
        if starts is not None:
            terms = terms * (~starts)[:, :, None, None]
        dlog = terms.sum(dim=(0, 1)) * lambdas(log_lam).conj()  # lam = exp(log_lam)
        return torch.view_as_real(r).to(s.dtype), torch.view_as_real(dlog).to(log_lam.dtype), None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# (b) Numba kernels
# ---------------------------------------------------------------------------------------------------------------
# Numba names the kernels use, bound by _kernels on first use (numba is imported lazily). They must be module globals:
# the CUDA simulator runs a kernel as Python and swaps only the module-global `cuda` for its fake module.
cuda = float32 = int32 = None

IO_KINDS = ("f32", "bf16")  # f32: (B, T, G, K, 2) float32 pairs; bf16: (B, T, G, K) int32, re in the low 16 bits


def _bf16_codec(simulated: bool):
    """(bits_to_f32, f32_to_bits, wrap32) for the bf16 loads and stores. Reinterpreting bits is the one thing the
    simulator cannot run as on the device (libdevice is device-only), so it gets numpy views; the integer
    arithmetic around them (shifts, round to nearest even) is shared and so tested by the simulator."""
    if simulated:
        import numpy as np

        def bits_to_f32(bits):  # any int whose low 32 bits are a float32 pattern
            return np.array(bits, dtype=np.int64).astype(np.int32).view(np.float32)[()]

        def f32_to_bits(x):
            return int(np.array(x, dtype=np.float32).view(np.int32)[()])

        def wrap32(x):  # 0 <= x < 2**32 -> the int32 with those bits
            return np.array(x, dtype=np.int64).astype(np.int32)[()]

        return bits_to_f32, f32_to_bits, wrap32
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def bits_to_f32(bits):
        return libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True)
    def f32_to_bits(x):
        return libdevice.float_as_int(x)

    @cuda.jit(device=True)
    def wrap32(x):
        return int32(x)

    return bits_to_f32, f32_to_bits, wrap32


@functools.lru_cache(maxsize=None)
def _kernels(io: str) -> dict:
    """Build (lazily: numba is imported here) the six kernels for one storage kind of z, s, gs and dz.

    io "f32": (B, T, G, K, 2) float32 arrays. io "bf16": (B, T, G, K) int32 arrays, each the two bf16 halves of a
    complex number (a torch bf16 (..., 2) tensor viewed as int32): one 32-bit load per complex number per thread.
    Other arrays: lam (G, K, 2) f32; starts (B, T) uint8; AS, XY (B, NC, G, K, 4) f32 chunk summaries;
    H, E, dlam (B, NC, G, K, 2) f32; last, s0 (B, G, K, 2) f32.
    """
    global cuda, float32, int32
    from numba import cuda, float32, int32
    from numba.cuda.core import config

    if io not in IO_KINDS:
        raise ValueError(f"io must be one of {IO_KINDS}, got {io!r}")
    bits_to_f32, f32_to_bits, wrap32 = _bf16_codec(config.ENABLE_CUDASIM)

    if io == "f32":
        @cuda.jit(device=True)
        def load(x, b, t, g, k):
            return x[b, t, g, k, 0], x[b, t, g, k, 1]

        @cuda.jit(device=True)
        def store(x, b, t, g, k, re, im):
            x[b, t, g, k, 0] = re
            x[b, t, g, k, 1] = im
    else:
        @cuda.jit(device=True)
        def load(x, b, t, g, k):
            v = x[b, t, g, k]  # little-endian: re in bits 0-15, im in bits 16-31; bf16 = the high half of an f32
            return bits_to_f32(v << 16), bits_to_f32(v & -65536)

        @cuda.jit(device=True)
        def to_bf16_bits(x):
            """float32 -> its bf16 bits (0..0xFFFF), rounded to nearest even as torch rounds; NaN stays NaN."""
            if x != x:
                return 0x7FC0
            u = f32_to_bits(x) & 0xFFFFFFFF
            return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

        @cuda.jit(device=True)
        def store(x, b, t, g, k, re, im):
            x[b, t, g, k] = wrap32((to_bf16_bits(im) << 16) | to_bf16_bits(re))

    @cuda.jit(device=True)
    def chunk_thread(i, NC, G, K):
        """Global thread index -> (b, j, g, k), k fastest: a warp covers 32 neighbouring channels of one token."""
        return i // (K * G * NC), (i // (K * G)) % NC, (i // K) % G, i % K

    @cuda.jit(device=True)
    def store4(x, b, j, g, k, v0, v1, v2, v3):
        x[b, j, g, k, 0] = v0
        x[b, j, g, k, 1] = v1
        x[b, j, g, k, 2] = v2
        x[b, j, g, k, 3] = v3

    @cuda.jit
    def fwd_reduce(z, lam, starts, L, AS):
        B, NC, G, K = AS.shape[0], AS.shape[1], AS.shape[2], AS.shape[3]
        i = cuda.grid(1)
        if i >= B * NC * G * K:
            return
        b, j, g, k = chunk_thread(i, NC, G, K)
        lr, li = lam[g, k, 0], lam[g, k, 1]
        ar, ai = float32(1.0), float32(0.0)  # A: product of a(t) so far
        sr, si = float32(0.0), float32(0.0)  # S: the state from zero
        for t in range(j * L, min(j * L + L, starts.shape[1])):
            zr, zi = load(z, b, t, g, k)
            if starts[b, t]:  # a(t) = 0: the chunk forgets everything before t
                ar, ai, sr, si = float32(0.0), float32(0.0), zr, zi
            else:
                sr, si = lr * sr - li * si + zr, lr * si + li * sr + zi
                ar, ai = lr * ar - li * ai, lr * ai + li * ar
        store4(AS, b, j, g, k, ar, ai, sr, si)

    @cuda.jit
    def fwd_carry(AS, H):
        """H[:, 0] holds the initial state; writes H[:, 1:NC] (the final state H_NC is pass 3's)."""
        B, NC, G, K = AS.shape[0], AS.shape[1], AS.shape[2], AS.shape[3]
        i = cuda.grid(1)
        if i >= B * G * K:
            return
        b, _, g, k = chunk_thread(i, 1, G, K)  # one thread per channel
        hr, hi = H[b, 0, g, k, 0], H[b, 0, g, k, 1]
        for j in range(NC - 1):
            ar, ai, sr, si = AS[b, j, g, k, 0], AS[b, j, g, k, 1], AS[b, j, g, k, 2], AS[b, j, g, k, 3]
            hr, hi = ar * hr - ai * hi + sr, ar * hi + ai * hr + si
            H[b, j + 1, g, k, 0] = hr
            H[b, j + 1, g, k, 1] = hi

    @cuda.jit
    def fwd_apply(z, lam, starts, L, H, s, last):
        B, NC, G, K = H.shape[0], H.shape[1], H.shape[2], H.shape[3]
        i = cuda.grid(1)
        if i >= B * NC * G * K:
            return
        b, j, g, k = chunk_thread(i, NC, G, K)
        lr, li = lam[g, k, 0], lam[g, k, 1]
        sr, si = H[b, j, g, k, 0], H[b, j, g, k, 1]
        for t in range(j * L, min(j * L + L, starts.shape[1])):
            zr, zi = load(z, b, t, g, k)
            if starts[b, t]:
                sr, si = zr, zi
            else:
                sr, si = lr * sr - li * si + zr, lr * si + li * sr + zi
            store(s, b, t, g, k, sr, si)
        if j == NC - 1:
            last[b, g, k, 0] = sr
            last[b, g, k, 1] = si

    @cuda.jit
    def bwd_reduce(gs, lam, starts, L, XY):
        B, NC, G, K = XY.shape[0], XY.shape[1], XY.shape[2], XY.shape[3]
        i = cuda.grid(1)
        if i >= B * NC * G * K:
            return
        b, j, g, k = chunk_thread(i, NC, G, K)
        lr, li = lam[g, k, 0], lam[g, k, 1]
        cr, ci = float32(0.0), float32(0.0)  # conj(a(t+1)) r_local(t+1): what flows into token t from the right
        yr, yi = float32(1.0), float32(0.0)  # Y: product of conj(a(t)) over the tokens walked
        t0 = j * L
        for t in range(min(t0 + L, starts.shape[1]) - 1, t0 - 1, -1):
            gr, gi = load(gs, b, t, g, k)
            rr, ri = gr + cr, gi + ci  # r_local(t)
            if starts[b, t]:
                cr, ci, yr, yi = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
            else:
                cr, ci = lr * rr + li * ri, lr * ri - li * rr
                yr, yi = lr * yr + li * yi, lr * yi - li * yr
        store4(XY, b, j, g, k, cr, ci, yr, yi)  # X_j = conj(a(t0)) r_local(t0), Y_j

    @cuda.jit
    def bwd_carry(XY, E):
        """E[:, NC-1] holds the adjoint entering from the right (0 for a whole row); E_{j-1} = X_j + Y_j E_j."""
        B, NC, G, K = XY.shape[0], XY.shape[1], XY.shape[2], XY.shape[3]
        i = cuda.grid(1)
        if i >= B * G * K:
            return
        b, _, g, k = chunk_thread(i, 1, G, K)  # one thread per channel
        er, ei = E[b, NC - 1, g, k, 0], E[b, NC - 1, g, k, 1]
        for j in range(NC - 1, 0, -1):
            xr, xi, yr, yi = XY[b, j, g, k, 0], XY[b, j, g, k, 1], XY[b, j, g, k, 2], XY[b, j, g, k, 3]
            er, ei = xr + yr * er - yi * ei, xi + yr * ei + yi * er
            E[b, j - 1, g, k, 0] = er
            E[b, j - 1, g, k, 1] = ei

    @cuda.jit
    def bwd_apply(gs, s, lam, starts, L, s0, E, dz, dlam):
        B, NC, G, K = E.shape[0], E.shape[1], E.shape[2], E.shape[3]
        i = cuda.grid(1)
        if i >= B * NC * G * K:
            return
        b, j, g, k = chunk_thread(i, NC, G, K)
        lr, li = lam[g, k, 0], lam[g, k, 1]
        cr, ci = E[b, j, g, k, 0], E[b, j, g, k, 1]  # conj(a(t+1)) r(t+1), E_j at the chunk's last token
        accr, acci = float32(0.0), float32(0.0)  # this chunk's share of dLoss/dlam
        t0 = j * L
        for t in range(min(t0 + L, starts.shape[1]) - 1, t0 - 1, -1):
            gr, gi = load(gs, b, t, g, k)
            rr, ri = gr + cr, gi + ci  # r(t)
            store(dz, b, t, g, k, rr, ri)
            if starts[b, t]:  # a(t) = 0: no gradient for lam here, and nothing flows to t - 1
                cr, ci = float32(0.0), float32(0.0)
            else:
                if t > 0:
                    pr, pi = load(s, b, t - 1, g, k)
                else:
                    pr, pi = s0[b, g, k, 0], s0[b, g, k, 1]
                accr += rr * pr + ri * pi  # r(t) conj(s(t-1))
                acci += ri * pr - rr * pi
                cr, ci = lr * rr + li * ri, lr * ri - li * rr
        dlam[b, j, g, k, 0] = accr
        dlam[b, j, g, k, 1] = acci

    return {"fwd_reduce": fwd_reduce, "fwd_carry": fwd_carry, "fwd_apply": fwd_apply,
            "bwd_reduce": bwd_reduce, "bwd_carry": bwd_carry, "bwd_apply": bwd_apply}


# ---------------------------------------------------------------------------------------------------------------
# (c) launch configuration and the bytes-moved model
# ---------------------------------------------------------------------------------------------------------------

BLOCK = 128  # threads per block: 4 warps, each 32 neighbouring channels of one (b, j)
MIN_CHUNK = 16  # shorter chunks make the sequential carry pass (NC steps) longer than the chunk walks
# Threads to aim for: half of what the device holds at once (H100: 132 SMs x 2048 / 2 = 135,168). Each thread has
# one 4-byte load per step in flight, more once the compiler unrolls the walk, and the carry pass gets longer with
# every chunk added, so more threads than this buy little.
OCCUPANCY = 0.5
H100 = {"sm_count": 132, "threads_per_sm": 2048, "bandwidth": 3.0e12}  # the device of the bytes-moved printout


@dataclass(frozen=True)
class ScanPlan:
    """How one scan is cut: chunk length L, NC chunks, and threads per chunk pass (B G K NC)."""
    B: int
    T: int
    G: int
    K: int
    chunk: int
    n_chunks: int

    @property
    def threads(self) -> int:
        return self.B * self.n_chunks * self.G * self.K


def plan_scan(B: int, T: int, G: int, K: int, *, sm_count: int, threads_per_sm: int,
              chunk: int | None = None) -> ScanPlan:
    """Choose the chunk length from the numbers: the longest power-of-two chunk (>= MIN_CHUNK) that still gives
    B G K ceil(T / L) >= OCCUPANCY x the device's resident threads; one chunk (a single pass) when the B G K channels
    fill the device on their own. `chunk` forces a length (tests, tuning)."""
    if chunk is None:
        target = OCCUPANCY * sm_count * threads_per_sm
        channels = B * G * K
        if channels >= target or T <= MIN_CHUNK:
            chunk = T
        else:
            chunk = MIN_CHUNK
            while chunk * 2 < T and channels * math.ceil(T / (chunk * 2)) >= target:
                chunk *= 2
    chunk = max(1, min(int(chunk), T))
    return ScanPlan(B, T, G, K, chunk, math.ceil(T / chunk))


def device_plan(B: int, T: int, G: int, K: int, device: torch.device, chunk: int | None = None) -> ScanPlan:
    """plan_scan with the device's SM count and resident threads (the H100's numbers off CUDA: the simulator)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return plan_scan(B, T, G, K, sm_count=props.multi_processor_count,
                         threads_per_sm=props.max_threads_per_multi_processor, chunk=chunk)
    return plan_scan(B, T, G, K, sm_count=H100["sm_count"], threads_per_sm=H100["threads_per_sm"], chunk=chunk)


def traffic(plan: ScanPlan, io_bytes: int = 4) -> list[dict]:
    """Bytes each pass reads and writes (DRAM, counting every array once per pass) for a forward and a backward
    scan; io_bytes per complex number of z, s, gs, dz (4 in bf16, 8 in fp32). Summaries and carries are fp32.
    `steps`: the dependent steps a thread walks (what bounds a pass that moves few bytes)."""
    p = plan
    tok = p.B * p.T * p.G * p.K * io_bytes  # one pass over z (or s, gs, dz)
    starts = p.B * p.T  # uint8; every thread of a token reads the same byte: counted once
    per_chunk = p.B * p.n_chunks * p.G * p.K * 8  # one complex fp32 per (b, j, g, k)
    last = p.B * p.G * p.K * 8
    rows = [("fwd reduce", tok + starts, 2 * per_chunk, p.chunk),
            ("fwd carry", 2 * per_chunk + last, per_chunk, p.n_chunks - 1),
            ("fwd apply", tok + starts + per_chunk, tok + last, p.chunk),
            ("bwd reduce", tok + starts, 2 * per_chunk, p.chunk),
            ("bwd carry", 2 * per_chunk, per_chunk, p.n_chunks - 1),
            ("bwd apply", 2 * tok + starts + per_chunk + last, tok + per_chunk, p.chunk)]
    if p.n_chunks == 1:  # a single pass each way: no summaries, no carries
        rows = [r for r in rows if r[0].endswith("apply")]
    return [{"pass": name, "read": r, "written": w, "steps": steps} for name, r, w, steps in rows]


def _launch(name: str, io: str, n_threads: int, args, stream=0) -> None:
    if n_threads > 0:
        _kernels(io)[name][math.ceil(n_threads / BLOCK), BLOCK, stream](*args)


def _io_view(x: torch.Tensor, io: str) -> torch.Tensor:
    """The tensor the kernel indexes: the (..., 2) float32 pairs themselves, or bf16 pairs seen as one int32."""
    return x if io == "f32" else x.view(torch.int32).squeeze(-1)


def _arrays(*tensors):
    """Numba views of torch tensors: device arrays on CUDA, numpy views (shared memory) under the simulator."""
    if tensors[0].is_cuda:
        return [as_numba(t) for t in tensors]
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise ValueError("the resonance scan kernels need CUDA tensors (or NUMBA_ENABLE_CUDASIM=1 for tests)")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # wrapped: strided views, no copies

    return [FakeCUDAArray(t.detach().numpy()) for t in tensors]


def _io_kind(x: torch.Tensor) -> str:
    return "bf16" if x.dtype == torch.bfloat16 else "f32"


def _pairs_for_kernel(x: torch.Tensor) -> torch.Tensor:
    """z or gs as the kernel reads it: bf16 or fp32 with the (re, im) axis contiguous (other strides are fine: the
    kernels take strided arrays); other dtypes are converted to fp32."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    return x if x.stride(-1) == 1 and all(s % 2 == 0 for s in x.stride()[:-1]) else x.contiguous()


def _fold_forward(AS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk summaries AS (B, NC, G, K, 4) -> the slice's (A, S) as (B, G, K, 2) fp32 pairs: H_{j+1} = A_j H_j + S_j
    from H_0 = 0 over every chunk (a log-depth scan over NC numbers per channel)."""
    A = torch.complex(AS[..., 0], AS[..., 1])
    S = torch.complex(AS[..., 2], AS[..., 3])
    A_all, S_all = _linear_scan(A, S, dim=1)
    return torch.view_as_real(A_all[:, -1]).contiguous(), torch.view_as_real(S_all[:, -1]).contiguous()


def _fold_backward(XY: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward chunk summaries XY (B, NC, G, K, 4) -> the slice's (Y, X) as fp32 pairs: E_{j-1} = X_j + Y_j E_j
    from the right with E = 0, down to what enters from before chunk 0 (X), and the product of the Y_j."""
    X = torch.complex(XY[..., 0], XY[..., 1]).flip(1)
    Y = torch.complex(XY[..., 2], XY[..., 3]).flip(1)
    Y_all, X_all = _linear_scan(Y, X, dim=1)
    return torch.view_as_real(Y_all[:, -1]).contiguous(), torch.view_as_real(X_all[:, -1]).contiguous()


def kernel_forward(z, lam_pairs, starts_u8, state0, plan: ScanPlan, carry=None):
    """Passes 1-3. z (B, T, G, K, 2) bf16/fp32, lam_pairs (G, K, 2) fp32, starts_u8 (B, T) uint8, state0 (B, G, K, 2)
    fp32 -> (s like z, last (B, G, K, 2) fp32, the initial state used). carry: context parallelism (module
    docstring): pass 1 runs even for one chunk, and the initial state is carry(A, S) of this slice, not state0."""
    B, T, G, K, _ = z.shape
    NC, io = plan.n_chunks, _io_kind(z)
    dev = z.device
    H = torch.empty(B, NC, G, K, 2, dtype=torch.float32, device=dev)  # the state entering each chunk
    H[:, 0] = state0
    s = torch.empty_like(z)  # z's layout: (G, B, T, K, 2) in memory when z comes from the mixer's projection
    last = torch.empty(B, G, K, 2, dtype=torch.float32, device=dev)
    stream = torch_stream() if z.is_cuda else 0
    if NC > 1 or carry is not None:
        AS = torch.empty(B, NC, G, K, 4, dtype=torch.float32, device=dev)
        zz, lam, st, as_ = _arrays(_io_view(z, io), lam_pairs, starts_u8, AS)
        _launch("fwd_reduce", io, plan.threads, (zz, lam, st, plan.chunk, as_), stream)
        if carry is not None:  # the ranks before this one: one exchange of (B, G, K) summaries
            H[:, 0] = carry(*_fold_forward(AS), False).float()
        if NC > 1:
            as_, hh = _arrays(AS, H)
            _launch("fwd_carry", io, B * G * K, (as_, hh), stream)
    zz, lam, st, hh, ss, ll = _arrays(_io_view(z, io), lam_pairs, starts_u8, H, _io_view(s, io), last)
    _launch("fwd_apply", io, plan.threads, (zz, lam, st, plan.chunk, hh, ss, ll), stream)
    return s, last, H[:, 0].contiguous()


def kernel_backward(gs, s, lam_pairs, starts_u8, state0, plan: ScanPlan, carry=None):
    """Backward passes 1-3 from the forward's output s -> (dz like s, dlam (G, K, 2) fp32: the sum over rows and
    chunks of each chunk's share). carry: context parallelism: pass 1 runs even for one chunk, and the adjoint the
    ranks after this one send, carry(Y, X, reverse=True), enters the last chunk from the right."""
    B, T, G, K, _ = s.shape
    NC = plan.n_chunks
    gs = _pairs_for_kernel(gs).to(s.dtype)  # the kernel reads gs and s with one storage kind
    io, dev = _io_kind(s), s.device
    E = torch.zeros(B, NC, G, K, 2, dtype=torch.float32, device=dev)
    dz = torch.empty_like(s)
    dlam = torch.empty(B, NC, G, K, 2, dtype=torch.float32, device=dev)
    stream = torch_stream() if s.is_cuda else 0
    if NC > 1 or carry is not None:
        XY = torch.empty(B, NC, G, K, 4, dtype=torch.float32, device=dev)
        gg, lam, st, xy = _arrays(_io_view(gs, io), lam_pairs, starts_u8, XY)
        _launch("bwd_reduce", io, plan.threads, (gg, lam, st, plan.chunk, xy), stream)
        if carry is not None:  # the ranks after this one, in reverse rank order
            E[:, NC - 1] = carry(*_fold_backward(XY), True).float()
        if NC > 1:
            xy, ee = _arrays(XY, E)
            _launch("bwd_carry", io, B * G * K, (xy, ee), stream)
    gg, ss, lam, st, s0, ee, dd, dl = _arrays(_io_view(gs, io), _io_view(s, io), lam_pairs, starts_u8, state0, E,
                                              _io_view(dz, io), dlam)
    _launch("bwd_apply", io, plan.threads, (gg, ss, lam, st, plan.chunk, s0, ee, dd, dl), stream)
    return dz, dlam.sum(dim=(0, 1))


def warmup() -> float:
    """Compile all six kernels for both storage kinds (first launch) on CUDA; returns the seconds it took."""
    start = time.perf_counter()
    for dtype in (torch.float32, torch.bfloat16):
        z = torch.zeros(1, 40, 1, 2, 2, dtype=dtype, device="cuda", requires_grad=True)
        log_lam = torch.zeros(1, 2, 2, device="cuda", requires_grad=True)
        s, _ = resonance_scan(z, log_lam, backend="numba", kernel_chunk=16)
        s.float().sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------------
# (d) autograd Function and public API
# ---------------------------------------------------------------------------------------------------------------

class ResonanceScanFunction(torch.autograd.Function):
    """The kernel path: forward keeps its output s (which the caller's output projection keeps anyway), lambda,
    the starts and the initial state; backward runs the three reverse passes. The final state is not
    differentiable (it feeds generation, never a loss). `carry` (context parallelism): the initial state and the
    adjoint entering from the right come from the other ranks (kernel_forward, kernel_backward)."""

    @staticmethod
    def forward(ctx, z, log_lam, starts_u8, state0, kernel_chunk, carry=None):
        plan = device_plan(z.shape[0], z.shape[1], z.shape[2], z.shape[3], z.device, kernel_chunk)
        lam_pairs = torch.view_as_real(lambdas(log_lam)).float().contiguous()  # (G, K, 2)
        s, last, state0 = kernel_forward(_pairs_for_kernel(z), lam_pairs, starts_u8, state0, plan, carry)
        out = s.to(z.dtype)  # no copy for bf16 and fp32 z
        ctx.save_for_backward(s, lam_pairs, starts_u8, state0)
        ctx.plan, ctx.z_dtype, ctx.log_lam_dtype, ctx.carry = plan, z.dtype, log_lam.dtype, carry
        ctx.mark_non_differentiable(last)
        return out, last

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gs, _glast):
        s, lam_pairs, starts_u8, state0 = ctx.saved_tensors
        dz, dlam = kernel_backward(gs, s, lam_pairs, starts_u8, state0, ctx.plan, ctx.carry)
        # lam = exp(log_lam): dLoss/dlog_lam = dLoss/dlam * conj(lam) (torch's complex-gradient convention)
        dlog = torch.view_as_complex(dlam.contiguous()) * torch.view_as_complex(lam_pairs).conj()
        return dz.to(ctx.z_dtype), torch.view_as_real(dlog).to(ctx.log_lam_dtype), None, None, None, None


def _check(z: torch.Tensor, log_lam: torch.Tensor, starts, state0) -> None:
    if z.dim() != 5 or z.shape[-1] != 2:
        raise ValueError(f"z must be (B, T, G, K, 2) real (re, im) pairs, got shape {tuple(z.shape)}")
    B, T, G, K, _ = z.shape
    if T < 1:
        raise ValueError("z must hold at least one token (T >= 1)")
    if tuple(log_lam.shape) != (G, K, 2):
        raise ValueError(f"log_lam must be (G, K, 2) = ({G}, {K}, 2), got {tuple(log_lam.shape)}")
    if starts is not None and (tuple(starts.shape) != (B, T) or starts.dtype != torch.bool):
        raise ValueError(f"starts must be a ({B}, {T}) bool tensor, got {tuple(starts.shape)} {starts.dtype}")
    if state0 is not None and tuple(state0.shape) != (B, G, K, 2):
        raise ValueError(f"state0 must be (B, G, K, 2) = ({B}, {G}, {K}, 2), got {tuple(state0.shape)}")


def resonance_scan(z: torch.Tensor, log_lam: torch.Tensor, starts: torch.Tensor | None = None,
                   state0: torch.Tensor | None = None, *, backend: str | None = None, chunk: int = REFERENCE_CHUNK,
                   kernel_chunk: int | None = None, carry=None) -> tuple[torch.Tensor, torch.Tensor]:
    """s(t) = a(t) s(t-1) + z(t), a(t) = exp(log_lam) (0 where starts), s(-1) = state0 or 0.

    z (B, T, G, K, 2) real (re, im) pairs in any float dtype; log_lam (G, K, 2) (Re, Im of log lambda, Re < 0);
    starts (B, T) bool or None; state0 (B, G, K, 2) or None (generation: no gradient flows into it).
    Returns (s (B, T, G, K, 2) in z's dtype, last (B, G, K, 2) fp32 (fp64 for fp64 z on the reference): the state
    after token T-1, for generation). backend: None / "auto" / "numba" / "reference" (cuda_ops/dispatch.py).
    chunk: the reference's chunk length (its log-depth scan runs within chunks); kernel_chunk: force the kernel's
    chunk length (default: plan_scan from the device's thread count).
    carry: context parallelism (model/context.py RowSplit.scan_carry): z is one contiguous slice of a row split over
    ranks, and carry(decay, state, reverse) -> (B, G, K, 2) exchanges the slices' summaries; s(-1) is then the state
    the ranks before hand over (state0 must be None), and gradients flow across the ranks in backward."""
    _check(z, log_lam, starts, state0)
    if carry is not None and state0 is not None:
        raise ValueError("carry (a row split over ranks) sets the initial state itself; pass state0=None")
    return _scan(z, log_lam, starts, state0, resolve_backend(z.device, backend), chunk, kernel_chunk, carry)


def _scan(z, log_lam, starts, state0, backend: str, chunk: int, kernel_chunk: int | None, carry=None):
    """`resonance_scan` once the backend is fixed (the simulator tests drive "numba" on host tensors)."""
    if backend == "reference":
        if carry is not None or (torch.is_grad_enabled() and (z.requires_grad or log_lam.requires_grad)):
            return ReferenceScanFunction.apply(z, log_lam, starts, carry, chunk, state0)
        return scan_reference(z, log_lam, starts, state0, chunk)
    if z.is_cuda:
        check_same_device(z)
    B, _, G, K, _ = z.shape
    starts_u8 = (torch.zeros(z.shape[:2], dtype=torch.uint8, device=z.device) if starts is None
                 else starts.to(torch.uint8).contiguous())
    state = (torch.zeros(B, G, K, 2, dtype=torch.float32, device=z.device) if state0 is None
             else state0.detach().float().contiguous())
    return ResonanceScanFunction.apply(z, log_lam, starts_u8, state, kernel_chunk, carry)
