"""Fused linear cross-entropy: loss, accuracy and gradients of `hidden @ weight.T` without the (N, V) logits.

    res = linear_cross_entropy(hidden, model.output_weight, targets)   # CEResult(loss_sum, n_tokens, n_correct)
    (res.loss_sum / res.n_tokens).backward()                           # grads reach hidden and weight

Index names used throughout (as in llm.c's dev/cuda files):
    N    tokens (rows) in the call               D    hidden size
    V    vocabulary size                         n    rows in the current chunk (n <= chunk_size)
    s:e  the chunk's row range in [0, N)         j    a vocabulary index within one row
    t    a row's target class                    lse  log(sum_j exp(logits[row, j]))
    tid  thread index within a block             BLOCK threads per block; one block per row

Per counted row (t != ignore_index):  loss = lse - logits[t] + z_loss * lse^2,  correct = (argmax_j logits == t)
and d loss / d logits[j] = softmax[j] * (1 + 2 z_loss lse) - [j == t].  Ignored rows add 0 loss, are not counted,
and get 0 gradient. A counted row whose target is outside [0, V) gets NaN loss (the device cannot raise without a
host sync; NaN makes bad data visible in the loss instead of reading out of bounds).

Memory plan: the gradient is computed DURING forward (the Liger-Kernel / llm.c trick). Each chunk's fp32 logits
buffer (n, V) is turned in place into d loss_sum / d logits, which two matmuls turn into grad_hidden[s:e] (n, D)
and an increment of grad_weight (V, D); the buffer is then dropped. Backward only scales the stored gradients by
the incoming scalar. Peak extra memory is O(chunk_size * V + N * D + V * D) instead of O(N * V), and there is no
second pass over the vocabulary. When no gradient is needed (eval, torch.no_grad) the gradient work is skipped.

Layout of this file: (a) reference row-wise op (pure torch: the oracle and the CPU path); (b) the Numba kernel;
(c) its launch configuration and the torch <-> Numba glue; (d) the chunk loop, autograd Function and public API.
"""
from __future__ import annotations

import functools
import math
import os
import time
from typing import NamedTuple

import torch

from cuda_ops.dispatch import as_numba, check_same_device, resolve_backend, torch_stream

cuda = None  # numba.cuda, bound by _rowwise_kernel on first use so that importing this module never needs numba


class CEResult(NamedTuple):
    """loss_sum: fp32 0-dim, differentiable w.r.t. hidden and weight; n_tokens, n_correct: int64 0-dim counts of
    non-ignored rows and of rows whose argmax equals the target. All on the input's device; nothing synced."""
    loss_sum: torch.Tensor
    n_tokens: torch.Tensor
    n_correct: torch.Tensor

    def mean(self) -> torch.Tensor:
        """Mean loss per counted token; 0 (not NaN) when every row is ignored, so a pure-padding batch is harmless."""
        return self.loss_sum / self.n_tokens.clamp(min=1)


# ---------------------------------------------------------------------------------------------------------------
# (a) reference: one chunk of rows, pure torch
# ---------------------------------------------------------------------------------------------------------------

def _rowwise_reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, z_loss: float,
                       write_grad: bool, loss_rows: torch.Tensor, correct_rows: torch.Tensor) -> None:
    """Same contract as the Numba kernel, in torch ops.

    logits (n, V) fp32, overwritten with d loss / d logits when write_grad; targets (n,) int64;
    loss_rows (n,) fp32 and correct_rows (n,) int32 are written.
    """
    n, V = logits.shape
    counted = targets != ignore_index                                       # (n,)
    in_range = (targets >= 0) & (targets < V)                               # (n,)
    safe_t = torch.where(in_range, targets, torch.zeros_like(targets))     # (n,) gather index that never faults
    lse = torch.logsumexp(logits, dim=1)                                    # (n,)
    target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)            # (n,)
    loss = lse - target_logit + z_loss * lse * lse
    loss = torch.where(in_range, loss, torch.full_like(loss, math.nan))
    loss_rows.copy_(torch.where(counted, loss, torch.zeros_like(loss)))
    # torch.argmax returns the first maximal index; the kernel breaks ties the same way.
    correct_rows.copy_((logits.argmax(dim=1) == targets) & counted)
    if write_grad:
        coef = 1.0 + 2.0 * z_loss * lse                                     # (n,) z-loss scales the softmax term
        logits.sub_(lse[:, None]).exp_().mul_(coef[:, None])                 # softmax * coef, in place
        logits.scatter_add_(1, safe_t[:, None], -(counted & in_range).to(logits.dtype)[:, None])
        logits.masked_fill_(~counted[:, None], 0.0)


# ---------------------------------------------------------------------------------------------------------------
# (b) Numba kernel: one block per row
# ---------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _rowwise_kernel(block: int):
    """Build (lazily: numba is imported here) the row-wise kernel for a power-of-two block size.

    kernel[n, block, stream](logits (n, V) f32, targets (n,) i64, ignore_index i64, z_loss f64, write_grad bool,
                             loss_rows (n,) f32, correct_rows (n,) i32)
    Pass 1: each thread keeps an online (max, sum of exp(x - max), first argmax) over j = tid, tid + block, ...;
            a shared-memory tree merges the block's partials. Online rescaling keeps logits of +-1e4 finite.
    Pass 2: (write_grad) logits[row, j] <- exp(x - lse) * (1 + 2 z lse) - [j == t], in place.
    """
    global cuda  # a module global, not a closure: the CUDA simulator swaps only globals that are numba.cuda
    from numba import cuda, float32, int32

    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")

    @cuda.jit
    def kernel(logits, targets, ignore_index, z_loss, write_grad, loss_rows, correct_rows):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        V = logits.shape[1]
        t = targets[row]
        neg_inf = float32(-math.inf)
        if t == ignore_index:
            # t is per row, so the whole block takes this branch: returning before the barriers is safe.
            if write_grad:
                for j in range(tid, V, block):
                    logits[row, j] = float32(0.0)
            if tid == 0:
                loss_rows[row] = float32(0.0)
                correct_rows[row] = 0
            return

        # pass 1: thread-local online softmax statistics; arg = V means "saw nothing" (V < block leaves idle threads)
        m = neg_inf
        s = float32(0.0)
        arg = V
        for j in range(tid, V, block):
            x = logits[row, j]
            if x > m:                      # strict: keeps the first index of a tie (j grows within a thread)
                s = s * math.exp(m - x) + float32(1.0)
                m = x
                arg = j
            else:
                s += math.exp(x - m)

        sh_m = cuda.shared.array(block, float32)
        sh_s = cuda.shared.array(block, float32)
        sh_arg = cuda.shared.array(block, int32)
        sh_m[tid] = m
        sh_s[tid] = s
        sh_arg[tid] = arg
        cuda.syncthreads()
        stride = block // 2
        while stride > 0:
            if tid < stride:
                m1 = sh_m[tid]
                m2 = sh_m[tid + stride]
                mm = max(m1, m2)
                if mm != neg_inf:          # two empty partials would give exp(-inf - -inf) = NaN
                    sh_s[tid] = sh_s[tid] * math.exp(m1 - mm) + sh_s[tid + stride] * math.exp(m2 - mm)
                a2 = sh_arg[tid + stride]
                if m2 > m1 or (m2 == m1 and a2 < sh_arg[tid]):
                    sh_arg[tid] = a2
                sh_m[tid] = mm
            cuda.syncthreads()
            stride //= 2

        lse = sh_m[0] + math.log(sh_s[0])
        z = float32(z_loss)
        if tid == 0:
            if t >= 0 and t < V:
                loss_rows[row] = lse - logits[row, t] + z * lse * lse
                correct_rows[row] = 1 if sh_arg[0] == t else 0
            else:
                loss_rows[row] = float32(math.nan)
                correct_rows[row] = 0

        if write_grad:
            cuda.syncthreads()             # thread 0 has read logits[row, t] before anyone overwrites the row
            coef = float32(1.0) + float32(2.0) * z * lse
            for j in range(tid, V, block):
                g = math.exp(logits[row, j] - lse) * coef
                if j == t:
                    g -= float32(1.0)
                logits[row, j] = g

    return kernel


# ---------------------------------------------------------------------------------------------------------------
# (c) launch configuration and torch <-> Numba glue
# ---------------------------------------------------------------------------------------------------------------

# One block per row: a 32k-vocab row is 128 KiB of fp32, so each of the 512 threads streams ~63 values per pass with
# coalesced loads, and 4 resident blocks per SM (2048 threads) keep an H100 busy on a 4096-row chunk (~8 waves).
# The tree reduction is log2(512) = 9 barrier steps per row, small next to the 3 sweeps (read, read, write) of V.
ROWWISE_BLOCK = 512


def launch_rowwise(logits, targets, ignore_index: int, z_loss: float, write_grad: bool, loss_rows, correct_rows,
                   *, block: int | None = None, stream=0) -> None:
    """Launch the kernel on Numba device arrays (or numpy arrays under NUMBA_ENABLE_CUDASIM=1). Shapes as in
    `_rowwise_kernel`; a grid of n blocks, one per row. block=None reads ROWWISE_BLOCK at call time (the
    simulator tests lower it to 32: the simulator runs every thread as a Python thread)."""
    n = logits.shape[0]
    if n == 0:
        return
    block = block or ROWWISE_BLOCK
    _rowwise_kernel(block)[n, block, stream](logits, targets, int(ignore_index), float(z_loss), bool(write_grad),
                                            loss_rows, correct_rows)


def _rowwise_numba(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, z_loss: float,
                   write_grad: bool, loss_rows: torch.Tensor, correct_rows: torch.Tensor,
                   *, block: int | None = None) -> None:
    """`_rowwise_reference`'s contract on the Numba kernel. CUDA tensors launch on torch's current stream with no
    host sync. Host tensors are only accepted under the CUDA simulator, where the kernel writes the numpy views."""
    if logits.is_cuda:
        launch_rowwise(as_numba(logits), as_numba(targets), ignore_index, z_loss, write_grad,
                       as_numba(loss_rows), as_numba(correct_rows), block=block, stream=torch_stream())
    elif os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        launch_rowwise(logits.numpy(), targets.numpy(), ignore_index, z_loss, write_grad,
                       loss_rows.numpy(), correct_rows.numpy(), block=block)
    else:
        raise ValueError("the Numba row-wise kernel needs CUDA tensors (or NUMBA_ENABLE_CUDASIM=1 for tests)")


def warmup(block: int | None = None) -> float:
    """Compile the kernel for the argument types used in training (first launch) and return the seconds it took.
    Needs CUDA; benchmarks call it to report compile time apart from steady-state timings."""
    start = time.perf_counter()
    logits = torch.zeros(2, 3 * (block or ROWWISE_BLOCK) + 1, device="cuda")
    targets = torch.tensor([0, -100], device="cuda")
    _rowwise_numba(logits, targets, -100, 0.0, True, torch.empty(2, device="cuda"),
                   torch.empty(2, dtype=torch.int32, device="cuda"), block=block)
    torch.cuda.synchronize()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------------
# (d) chunk loop, autograd Function, public API
# ---------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _cuda_mm_out_dtype_supported() -> bool:
    """torch.mm(a, b, out_dtype=float32) (bf16/fp16 in, fp32 out from cuBLAS) exists on CUDA in recent torch."""
    a = torch.zeros(2, 2, dtype=torch.bfloat16, device="cuda")
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _logits_fp32(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(n, D) @ (V, D)^T -> (n, V) fp32 in the input dtype's matmul (the kernel backend's choice).
    Without the out_dtype matmul, bf16 logits are upcast: the precision of full-logits F.cross_entropy."""
    if h.dtype == torch.float32:
        return h @ w.t()
    if h.is_cuda and _cuda_mm_out_dtype_supported():
        return torch.mm(h, w.t(), out_dtype=torch.float32)
    return (h @ w.t()).float()


def _forward_chunks(hidden, weight, targets, ignore_index, chunk_size, z_loss, backend, need_gh, need_gw):
    """Loop over row chunks. hidden (N, D), weight (V, D), targets (N,) int64 (all contiguous).
    Returns loss_sum f32 0-dim, n_tokens i64, n_correct i64, grad_hidden (N, D) | None, grad_weight (V, D) | None,
    the gradients being of loss_sum (the backward multiplies by the incoming scalar)."""
    N, D = hidden.shape
    V = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    write_grad = need_gh or need_gw
    rowwise = _rowwise_reference if backend == "reference" else _rowwise_numba
    # The reference does every matmul in fp32 (it is the oracle); the kernel backend keeps cuBLAS in the input dtype.
    fp32_matmuls = backend == "reference" or dtype == torch.float32
    w_mm = weight.float() if fp32_matmuls else weight          # (V, D); no copy when already fp32

    loss_rows = torch.empty(N, dtype=torch.float32, device=device)
    correct_rows = torch.empty(N, dtype=torch.int32, device=device)
    grad_h = torch.empty_like(hidden) if need_gh else None                                  # (N, D) input dtype
    grad_w_acc = torch.zeros(V, D, dtype=torch.float32, device=device) if need_gw else None  # fp32 accumulator

    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        h = hidden[s:e].float() if fp32_matmuls else hidden[s:e]                             # (n, D)
        logits = h @ w_mm.t() if fp32_matmuls else _logits_fp32(h, weight)                  # (n, V) fp32
        rowwise(logits, targets[s:e], ignore_index, z_loss, write_grad, loss_rows[s:e], correct_rows[s:e])
        if not write_grad:
            continue
        g = logits if fp32_matmuls else logits.to(dtype)                                     # (n, V) dL/dlogits
        if need_gh:
            if grad_h.dtype == g.dtype:
                torch.mm(g, w_mm, out=grad_h[s:e])                                           # (n, V) @ (V, D)
            else:
                grad_h[s:e] = g @ w_mm
        if need_gw:
            if fp32_matmuls:
                grad_w_acc.addmm_(g.t(), h)                                                  # (V, n) @ (n, D)
            else:
                # bf16 product rounded once per chunk, summed in fp32: as precise as full-logits autograd,
                # which rounds the whole (V, D) product once.
                grad_w_acc.add_(g.t() @ h)
        del logits, g

    loss_sum = loss_rows.sum()
    n_tokens = (targets != ignore_index).sum()
    n_correct = correct_rows.sum(dtype=torch.int64)
    grad_w = None
    if need_gw:
        grad_w = grad_w_acc if weight.dtype == torch.float32 else grad_w_acc.to(weight.dtype)
    return loss_sum, n_tokens, n_correct, grad_h, grad_w


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd node: forward computes the loss AND the gradients of loss_sum; backward scales them by the
    incoming scalar gradient (in place: they are this node's own buffers). Backward runs at most once."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, z_loss, backend):
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_sum, n_tokens, n_correct, grad_h, grad_w = _forward_chunks(
            hidden, weight, targets, ignore_index, chunk_size, z_loss, backend, need_gh, need_gw)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.backward_done = False
        ctx.mark_non_differentiable(n_tokens, n_correct)
        return loss_sum, n_tokens, n_correct

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_n_tokens, _grad_n_correct):
        if ctx.backward_done:
            raise RuntimeError("linear_cross_entropy computes its gradients during forward and scales them in place; "
                               "backward through one call only once (retain_graph re-use is not supported)")
        ctx.backward_done = True
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h.mul_(grad_loss)        # grad_loss: 0-dim fp32 on the device (e.g. 1 / n_tokens): no host sync
        if grad_w is not None:
            grad_w.mul_(grad_loss)
        return grad_h, grad_w, None, None, None, None, None


def _check_inputs(hidden, weight, targets, chunk_size):
    if weight.dim() != 2:
        raise ValueError(f"weight must be (V, D), got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., D={hidden.shape[-1]}) and weight (V, D={weight.shape[1]}) disagree on D")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one so they match")
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"hidden/weight dtype {hidden.dtype} unsupported; use float32, bfloat16 or float16")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor of class indices, got {targets.dtype}")
    if hidden.device != weight.device or hidden.device != targets.device:
        raise ValueError(f"hidden ({hidden.device}), weight ({weight.device}) and targets ({targets.device}) "
                         f"must be on one device")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _linear_cross_entropy(hidden, weight, targets, ignore_index, chunk_size, z_loss, backend) -> CEResult:
    """Shared body once the backend is fixed (tests drive the "numba" backend on host tensors under the simulator)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # Under autocast the projection runs in the autocast dtype, as nn.Linear would; the casts sit outside the
        # Function so autograd carries the gradient back to fp32 master weights.
        amp_dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(amp_dtype), weight.to(amp_dtype)
    _check_inputs(hidden, weight, targets, chunk_size)
    D = hidden.shape[-1]
    if backend == "numba" and hidden.is_cuda:
        check_same_device(hidden)
    args = (hidden.reshape(-1, D).contiguous(), weight.contiguous(), targets.reshape(-1).long().contiguous(),
            int(ignore_index), int(chunk_size), float(z_loss), backend)
    # Autocast off inside: the reference's fp32 matmuls and the fp32 logits buffer must stay fp32.
    with torch.autocast(device_type, enabled=False):
        if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
            # Eval / no_grad: skip the Function, whose needs_input_grad would still ask for gradients under no_grad.
            loss_sum, n_tokens, n_correct, _, _ = _forward_chunks(*args, need_gh=False, need_gw=False)
            return CEResult(loss_sum, n_tokens, n_correct)
        return CEResult(*LinearCrossEntropyFunction.apply(*args))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = -100, chunk_size: int = 4096, z_loss: float = 0.0,
                         backend: str | None = None, reduction: str = "sum"):
    """Cross-entropy of `hidden @ weight.T` against `targets`, never holding more than chunk_size x V logits.

    hidden (N, D) or (B, T, D); weight (V, D); targets (N,) or (B, T) integer classes, ignore_index rows skipped.
    dtype float32 / bfloat16 / float16 (softmax math in fp32; gradients come back in the input dtype); under
    torch.autocast both are cast to the autocast dtype first, so fp32 master weights get fp32 gradients.
    backend: None / "auto" / "numba" / "reference" (see cuda_ops.dispatch.resolve_backend).
    reduction="sum" -> CEResult(loss_sum, n_tokens, n_correct) (caller divides: loss_sum / n_tokens);
    reduction="mean" -> the 0-dim mean loss over counted tokens (0 when none), like F.cross_entropy.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    res = _linear_cross_entropy(hidden, weight, targets, ignore_index, chunk_size, z_loss,
                                resolve_backend(hidden.device, backend))
    return res if reduction == "sum" else res.mean()


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                   ignore_index: int = -100, chunk_size: int = 4096, z_loss: float = 0.0,
                                   backend: str | None = None, reduction: str = "sum"):
    """`linear_cross_entropy` on the pure-torch path whatever `backend` or LONGTRAIN_KERNELS say (the oracle)."""
    return linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, chunk_size=chunk_size,
                                z_loss=z_loss, backend="reference", reduction=reduction)
