"""Fused linear cross-entropy: loss, accuracy and gradients of `hidden @ weight.T` without the (N, V) logits.

    res = linear_cross_entropy(hidden, model.output_weight, targets)   # CEResult(loss_sum, n_tokens, n_correct)
    (res.loss_sum / res.n_tokens).backward()                           # grads reach hidden and weight

Index names used throughout (as in llm.c's dev/cuda files):
    N    tokens (rows) in the call               D    hidden size
    V    vocabulary size                         n    rows in the current chunk (n <= chunk rows)
    s:e  the chunk's row range in [0, N)         j    a vocabulary index within one row
    t    a row's target class                    lse  log(sum_j exp(logits[row, j]))
    tid  thread index within a block             BLOCK threads per block; one block per row

Per counted row (t != ignore_index):  loss = lse - logits[t] + z_loss * lse^2,  correct = (argmax_j logits == t)
and d loss / d logits[j] = softmax[j] * (1 + 2 z_loss lse) - [j == t].  Ignored rows add 0 loss, are not counted,
and get 0 gradient. A counted row whose target is outside [0, V) gets NaN loss (the device cannot raise without a
host sync; NaN makes bad data visible in the loss instead of reading out of bounds).

Memory plan: the gradient is computed DURING forward (the Liger-Kernel / llm.c trick). Each chunk's logits buffer
(n, V) is turned in place into d loss_sum / d logits, which two matmuls turn into grad_hidden[s:e] (n, D) and an
increment of grad_weight (V, D); the buffer is then reused by the next chunk. Backward only scales the stored
gradients by the incoming scalar. Peak extra memory is O(chunk * V + N * D + V * D) instead of O(N * V), and there
is no second pass over the vocabulary. When no gradient is needed (eval, torch.no_grad) the gradient work is skipped.

Bytes moved per logit on the kernel backend (bf16 / fp16 inputs; bench/decoder_kernels.py prints this model):
    the logits matmul writes the chunk in the input dtype (2 B)   -- what torch.compile's full-logits path writes
    the row kernel reads it once (2 B; bf16 as 4-byte words of two logits) for an online (max, sum exp, argmax),
    holding the row in registers (rows up to 32,768 bf16 logits: 16 words a thread, 1,024 threads), then writes
    d loss / d logits in place, in the input dtype (2 B); longer rows read it a second time (2 B more)
    the gradient matmuls read it as it is (2 + 2 B), so there is no conversion pass, and grad_weight accumulates
    inside the matmul (addmm into one fp32 buffer): no accumulation pass either.
fp32 inputs keep fp32 logits (4 B each way). Chunks are as large as a byte budget allows (`chunk_size=None`, the
default: the smaller of LOGITS_BUDGET_BYTES and a quarter of the device's free memory), so a 32,768 x 32,000 bf16
call runs in 6 chunks of 5,504 rows (18 matmuls) where a fixed 4,096 took 8 (and 24 matmul launches).

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

# Numba names the kernel uses, bound by _rowwise_kernel on first use (importing this module never needs numba). They
# must be module globals: the CUDA simulator runs the kernel as Python and swaps the module-global `cuda`.
cuda = _int_as_float = _float_as_int = None


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

    logits (n, V) fp32 / bf16 / fp16, overwritten with d loss / d logits (in its own dtype) when write_grad; the
    math runs in fp32. targets (n,) int64; loss_rows (n,) fp32 and correct_rows (n,) int32 are written.
    """
    n, V = logits.shape
    x = logits.float()                                                      # (n, V) fp32 (no copy when fp32)
    counted = targets != ignore_index                                       # (n,)
    in_range = (targets >= 0) & (targets < V)                               # (n,)
    safe_t = torch.where(in_range, targets, torch.zeros_like(targets))     # (n,) gather index that never faults
    lse = torch.logsumexp(x, dim=1)                                         # (n,)
    target_logit = x.gather(1, safe_t[:, None]).squeeze(1)                 # (n,)
    loss = lse - target_logit + z_loss * lse * lse
    loss = torch.where(in_range, loss, torch.full_like(loss, math.nan))
    loss_rows.copy_(torch.where(counted, loss, torch.zeros_like(loss)))
    # torch.argmax returns the first maximal index; the kernel breaks ties the same way.
    correct_rows.copy_((x.argmax(dim=1) == targets) & counted)
    if write_grad:
        coef = 1.0 + 2.0 * z_loss * lse                                     # (n,) z-loss scales the softmax term
        g = x if x is logits else x.clone()
        g.sub_(lse[:, None]).exp_().mul_(coef[:, None])                      # softmax * coef, in place
        g.scatter_add_(1, safe_t[:, None], -(counted & in_range).to(g.dtype)[:, None])
        g.masked_fill_(~counted[:, None], 0.0)
        if g is not logits:
            logits.copy_(g)                                                 # rounded once to the buffer's dtype


# ---------------------------------------------------------------------------------------------------------------
# (b) Numba kernel: one block per row, two sweeps over the row in its storage dtype
# ---------------------------------------------------------------------------------------------------------------
# Storage of the logits buffer, a compile-time constant of the kernel:
#   "f32", "f16"  a float32 / float16 array: Numba loads and stores it natively (float16 rounds to nearest even)
#   "bf16x2"      torch's bfloat16 buffer viewed as int32 words of two logits (torch's __cuda_array_interface__ has
#                 no bfloat16 type; V even): one 4-byte load brings two logits, each the top half of a float32
#                 widened by a bit cast, and the two gradients are rounded back to nearest even by integer
#                 arithmetic (as torch's .to(torch.bfloat16) rounds) and stored as one word
#   "bf16"        the same for an odd V, one int16 per logit
STORAGES = ("f32", "f16", "bf16", "bf16x2")


def _bf16_bits_to_f32(bits16):
    """int16 bit pattern of a bfloat16 -> its float32 value. bits16 * 65536 is that pattern in the top half of an
    int32 (two's complement), and always in int32 range, so no unsigned type and no overflow are involved."""
    return _int_as_float(bits16 * 65536)


def _f32_to_bf16_bits(x):
    """float32 -> int16 bit pattern of the bfloat16 nearest to it (ties to even; NaN stays a quiet NaN)."""
    if x != x:
        return 0x7FC0
    u = _float_as_int(x) & 0xFFFFFFFF                      # the float32 bits as a non-negative int64
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF    # round to nearest even in the dropped 16 bits
    return r - 0x10000 if r >= 0x8000 else r               # as a signed int16


def _bf16_pair_to_f32(word):
    """int32 word holding two bfloat16 (logit 2p in the low half, 2p + 1 in the high half: little-endian)."""
    lo = word & 0xFFFF
    return _bf16_bits_to_f32(lo - 0x10000 if lo >= 0x8000 else lo), _int_as_float(word & -65536)


def _f32_pair_to_bf16_word(g0, g1):
    """Two float32 -> the int32 word of their bfloat16 (g0 in the low half), in int32 range by construction."""
    return _f32_to_bf16_bits(g1) * 65536 + (_f32_to_bf16_bits(g0) & 0xFFFF)


@functools.lru_cache(maxsize=None)
def _rowwise_kernel(block: int, storage: str = "f32", staged: int = 0):
    """Build (lazily: numba is imported here) the row-wise kernel for a power-of-two block size and a storage.

    kernel[n, block, stream](logits (n, W) f32 | f16 | i16 | i32 (W = V, or V / 2 words for bf16x2), targets (n,)
                             i64, ignore_index i64, z_loss f64, write_grad bool, loss_rows (n,) f32,
                             correct_rows (n,) i32)
    Sweep 1: each thread keeps an online (max, sum of exp(x - max), first argmax) over words p = tid, tid + block,
             ... (two loads in flight); a shared-memory tree merges the block's partials. Online rescaling keeps logits of +-1e4 finite.
    Sweep 2: (write_grad) logits[row, j] <- exp(x - lse) * (1 + 2 z lse) - [j == t], in place, in the storage dtype.
    staged = K > 0 (a power of two; rows of at most K x block words): sweep 1 issues all K loads of a thread at once
    and keeps the words in registers (K constant: the loops unroll and the array never reaches local memory), so
    sweep 2 reads nothing from memory: the row is read once and written once instead of read twice. The words are
    folded in the same order as the two-read sweep, so both give the same results.
    """
    global cuda, _int_as_float, _float_as_int
    from numba import cuda, float32, int32
    from numba.cuda.core import config

    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    if config.ENABLE_CUDASIM:  # the simulator has no libdevice: numpy bit casts, same values
        import numpy as np

        _int_as_float = lambda i: np.array(i, dtype=np.int64).astype(np.int32).view(np.float32)[()]  # noqa: E731
        _float_as_int = lambda f: int(np.array(f, dtype=np.float32).view(np.int32)[()])  # noqa: E731
    else:
        from numba.cuda import libdevice
        from numba.cuda.extending import register_jitable

        _int_as_float, _float_as_int = libdevice.int_as_float, libdevice.float_as_int
        for fn in (_bf16_bits_to_f32, _f32_to_bf16_bits, _bf16_pair_to_f32, _f32_pair_to_bf16_word):
            register_jitable(fn)
    E = 2 if storage == "bf16x2" else 1  # logits per stored word
    if staged and (staged & (staged - 1)):
        raise ValueError(f"staged must be 0 or a power of two, got {staged}")
    word_type = int32 if storage in ("bf16", "bf16x2") else float32  # a stored word as a register holds it
    held_len = max(staged, 1)

    @cuda.jit(device=True)
    def load(logits, row, p):
        """Word p -> (logit E*p, logit E*p + 1 or 0)."""
        if storage == "bf16x2":
            return _bf16_pair_to_f32(int32(logits[row, p]))
        if storage == "bf16":
            return _bf16_bits_to_f32(int32(logits[row, p])), float32(0.0)
        return float32(logits[row, p]), float32(0.0)

    @cuda.jit(device=True)
    def raw(logits, row, p):
        """Word p as stored (widened to a register type), decoded later by `decode`."""
        if storage == "bf16x2" or storage == "bf16":
            return int32(logits[row, p])
        return float32(logits[row, p])

    @cuda.jit(device=True)
    def decode(w):
        if storage == "bf16x2":
            return _bf16_pair_to_f32(w)
        if storage == "bf16":
            return _bf16_bits_to_f32(w), float32(0.0)
        return w, float32(0.0)

    @cuda.jit(device=True)
    def store(logits, row, p, g0, g1):
        if storage == "bf16x2":
            logits[row, p] = _f32_pair_to_bf16_word(g0, g1)
        elif storage == "bf16":
            logits[row, p] = _f32_to_bf16_bits(g0)
        else:
            logits[row, p] = g0            # f16: Numba rounds the float32 to nearest even

    @cuda.jit(device=True)
    def online(m, s, arg, x, j):
        """Fold logit x at index j into (max, sum exp(. - max), first argmax); j grows within a thread."""
        if x > m:                          # strict: keeps the first index of a tie
            return x, s * math.exp(m - x) + float32(1.0), j
        return m, s + math.exp(x - m), arg

    @cuda.jit(device=True)
    def grad(x0, x1, j, lse, coef, t):
        """d loss / d logits at j and j + 1 (the second is ignored unless E == 2)."""
        g0 = math.exp(x0 - lse) * coef
        g1 = math.exp(x1 - lse) * coef
        if j == t:
            g0 -= float32(1.0)
        if E == 2 and j + 1 == t:
            g1 -= float32(1.0)
        return g0, g1

    @cuda.jit
    def kernel(logits, targets, ignore_index, z_loss, write_grad, loss_rows, correct_rows):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        W = logits.shape[1]
        V = W * E
        t = targets[row]
        neg_inf = float32(-math.inf)
        if t == ignore_index:
            # t is per row, so the whole block takes this branch: returning before the barriers is safe.
            if write_grad:
                for p in range(tid, W, block):
                    store(logits, row, p, float32(0.0), float32(0.0))
            if tid == 0:
                loss_rows[row] = float32(0.0)
                correct_rows[row] = 0
            return

        # sweep 1: thread-local online softmax statistics; arg = V means "saw nothing" (V < block leaves idle threads)
        m = neg_inf
        s = float32(0.0)
        arg = V
        held = cuda.local.array(held_len, word_type)  # unused (and removed by the compiler) when not staged
        if staged:
            for k in range(staged):  # every load in flight before the first is used
                p = tid + k * block
                if p < W:
                    held[k] = raw(logits, row, p)
            for k in range(staged):
                p = tid + k * block
                if p < W:
                    x0, x1 = decode(held[k])
                    m, s, arg = online(m, s, arg, x0, p * E)
                    if E == 2:
                        m, s, arg = online(m, s, arg, x1, p * E + 1)
        for p in range(tid, W if not staged else 0, 2 * block):  # two words in flight per thread
            q = p + block
            x0, x1 = load(logits, row, p)
            y0, y1 = load(logits, row, q) if q < W else (neg_inf, neg_inf)
            m, s, arg = online(m, s, arg, x0, p * E)
            if E == 2:
                m, s, arg = online(m, s, arg, x1, p * E + 1)
            if q < W:
                m, s, arg = online(m, s, arg, y0, q * E)
                if E == 2:
                    m, s, arg = online(m, s, arg, y1, q * E + 1)

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
                y0, y1 = load(logits, row, t // E)
                loss_rows[row] = lse - (y1 if t % E == 1 else y0) + z * lse * lse
                correct_rows[row] = 1 if sh_arg[0] == t else 0
            else:
                loss_rows[row] = float32(math.nan)
                correct_rows[row] = 0

        if write_grad:
            cuda.syncthreads()             # thread 0 has read logits[row, t] before anyone overwrites the row
            coef = float32(1.0) + float32(2.0) * z * lse
            if staged:
                for k in range(staged):
                    p = tid + k * block
                    if p < W:
                        x0, x1 = decode(held[k])
                        store(logits, row, p, *grad(x0, x1, p * E, lse, coef, t))
            for p in range(tid, W if not staged else 0, 2 * block):
                q = p + block
                x0, x1 = load(logits, row, p)
                y0, y1 = load(logits, row, q) if q < W else (neg_inf, neg_inf)
                store(logits, row, p, *grad(x0, x1, p * E, lse, coef, t))
                if q < W:
                    store(logits, row, q, *grad(y0, y1, q * E, lse, coef, t))

    return kernel


# ---------------------------------------------------------------------------------------------------------------
# (c) launch configuration and torch <-> Numba glue
# ---------------------------------------------------------------------------------------------------------------

# One block per row: a 32k-vocab row is 64 KiB of bf16, 16,000 words of two logits, so each of the 512 threads
# streams ~31 words per sweep with coalesced 4-byte loads, two in flight, and 4 resident blocks per SM (2048 threads)
# keep an H100 busy on a 5,504-row chunk (~10 waves). The tree reduction is log2(512) = 9 barrier steps per row,
# small next to the 2 sweeps of V.
ROWWISE_BLOCK = 512
# Rows that fit 16 words a thread in blocks of 2 x ROWWISE_BLOCK (1,024 threads: V <= 32,768 in bf16, the training
# vocabularies) run staged: read once, written once, 2/3 of the two-read kernel's bytes (8 B a logit pair against 12;
# bench/decoder_kernels.py times both). ~56 registers a thread: one 1,024-thread block an SM, 64 KiB of loads in
# flight on each. ROWWISE_STAGED = False (or a longer row: 128,256 in bf16, 32,000 in fp32) keeps the two reads.
ROWWISE_STAGED = True
STAGED_WORDS = (2, 4, 8, 16)  # words a thread may hold; the kernel is built for the smallest that fits the row


def rowwise_plan(W: int, block: int | None = None, staged: bool | None = None) -> tuple[int, int]:
    """(threads a block, words held a thread or 0) for rows of W stored words."""
    block = block or ROWWISE_BLOCK
    if not (ROWWISE_STAGED if staged is None else staged):
        return block, 0
    wide = 2 * block
    fits = [k for k in STAGED_WORDS if k * wide >= W]
    return (wide, fits[0]) if fits else (block, 0)


def launch_rowwise(logits, targets, ignore_index: int, z_loss: float, write_grad: bool, loss_rows, correct_rows,
                   *, block: int | None = None, storage: str = "f32", stream=0, staged: bool | None = None) -> None:
    """Launch the kernel on Numba device arrays (or numpy arrays under NUMBA_ENABLE_CUDASIM=1). Shapes as in
    `_rowwise_kernel`; a grid of n blocks, one per row. block=None reads ROWWISE_BLOCK at call time (the
    simulator tests lower it to 32: the simulator runs every thread as a Python thread); staged=None reads
    ROWWISE_STAGED (rowwise_plan)."""
    n = logits.shape[0]
    if n == 0:
        return
    threads, words = rowwise_plan(logits.shape[1], block, staged)
    _rowwise_kernel(threads, storage, words)[n, threads, stream](logits, targets, int(ignore_index), float(z_loss),
                                                                 bool(write_grad), loss_rows, correct_rows)


def _storage_view(logits: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The logits buffer as Numba can take it, and the kernel's storage name: bf16 goes in as int32 words of two
    logits when V is even (one 4-byte load per two logits), else as int16 bits."""
    if logits.dtype == torch.float32:
        return logits, "f32"
    if logits.dtype == torch.float16:
        return logits, "f16"
    if logits.dtype == torch.bfloat16:
        if logits.shape[1] % 2 == 0 and logits.is_contiguous():
            return logits.view(torch.int32), "bf16x2"
        return logits.view(torch.int16), "bf16"
    raise ValueError(f"logits dtype {logits.dtype} unsupported; use float32, bfloat16 or float16")


def _rowwise_numba(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, z_loss: float,
                   write_grad: bool, loss_rows: torch.Tensor, correct_rows: torch.Tensor,
                   *, block: int | None = None, staged: bool | None = None) -> None:
    """`_rowwise_reference`'s contract on the Numba kernel. CUDA tensors launch on torch's current stream with no
    host sync. Host tensors are only accepted under the CUDA simulator, where the kernel writes the numpy views."""
    buf, storage = _storage_view(logits)
    if logits.is_cuda:
        launch_rowwise(as_numba(buf), as_numba(targets), ignore_index, z_loss, write_grad,
                       as_numba(loss_rows), as_numba(correct_rows), block=block, storage=storage,
                       stream=torch_stream(), staged=staged)
    elif os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        launch_rowwise(buf.numpy(), targets.numpy(), ignore_index, z_loss, write_grad,
                       loss_rows.numpy(), correct_rows.numpy(), block=block, storage=storage, staged=staged)
    else:
        raise ValueError("the Numba row-wise kernel needs CUDA tensors (or NUMBA_ENABLE_CUDASIM=1 for tests)")


def warmup(block: int | None = None, dtypes=(torch.bfloat16, torch.float32), vocab_size: int = 32000) -> float:
    """Compile the kernel for the storages used in training at this vocabulary (first launch: the staged kernel is
    built for the words a row holds) and return the seconds it took. Needs CUDA; benchmarks call it to report
    compile time apart from steady-state timings."""
    start = time.perf_counter()
    for dtype in dtypes:
        logits = torch.zeros(2, vocab_size, device="cuda", dtype=dtype)
        targets = torch.tensor([0, -100], device="cuda")
        _rowwise_numba(logits, targets, -100, 0.0, True, torch.empty(2, device="cuda"),
                       torch.empty(2, dtype=torch.int32, device="cuda"), block=block)
    torch.cuda.synchronize()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------------
# (d) chunk loop, autograd Function, public API
# ---------------------------------------------------------------------------------------------------------------

# The default chunk: as many rows as fit this many bytes of logits (also capped by a quarter of the free memory).
# 384 MiB keeps the whole call's extra memory (chunk + grad_hidden + fp32 grad_weight + its cast) near 0.6 GB at
# 32,768 x 768 x 32,000 bf16, about 1/20 of full-logits eager's, while the matmuls stay large (5,504 rows).
LOGITS_BUDGET_BYTES = 384 * 2**20
CHUNK_MULTIPLE = 128  # rows per chunk rounded up to this: whole tensor-core tiles for the matmuls


def _free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can get on a CUDA device: the driver's free memory plus what torch's caching
    allocator holds unused. None off CUDA (the budget alone decides there)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def auto_chunk_rows(N: int, V: int, logits_dtype: torch.dtype, device: torch.device,
                    budget_bytes: int | None = None) -> int:
    """Rows per chunk for `chunk_size=None`: the fewest chunks whose (rows, V) logits fit the budget (the smaller
    of `budget_bytes` or LOGITS_BUDGET_BYTES and a quarter of the free device memory), with N split evenly among
    them and rows rounded up to CHUNK_MULTIPLE (never above N)."""
    budget = budget_bytes or LOGITS_BUDGET_BYTES
    free = _free_device_bytes(torch.device(device))
    if free is not None:
        budget = min(budget, free // 4)
    row_bytes = V * torch.finfo(logits_dtype).bits // 8
    max_rows = max(1, budget // row_bytes)
    if max_rows < CHUNK_MULTIPLE:  # a tiny budget (or a huge vocabulary): whatever fits
        return min(max_rows, N)
    n_chunks = -(-N // max_rows)
    rows = -(-N // n_chunks)                                   # N split evenly over the fewest chunks
    return min(-(-rows // CHUNK_MULTIPLE) * CHUNK_MULTIPLE, N)


@functools.lru_cache(maxsize=None)
def _cuda_addmm_fp32_out_supported() -> bool:
    """torch.mm / torch.addmm(acc_fp32, a_bf16, b_bf16, out_dtype=float32, out=acc) (cuBLAS: low-precision inputs,
    an fp32 result written, then read and written in place) exist on CUDA in recent torch; checked once."""
    a = torch.ones(4, 4, dtype=torch.bfloat16, device="cuda")
    acc = torch.empty(4, 4, dtype=torch.float32, device="cuda")
    try:
        torch.mm(a, a, out_dtype=torch.float32, out=acc)              # the first chunk
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)      # every later one
        return bool((acc == 8.0).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _accumulate_grad_w(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """acc (V, D) (+)= g.T (V, n) @ h (n, D) in one matmul, no temporary and no separate add.

    acc in fp32 with bf16/fp16 g, h: cuBLAS reads and writes the fp32 accumulator in its epilogue (out_dtype), so
    the sum over chunks is as precise as full-logits autograd's single rounding. Same-dtype operands: addmm_."""
    if acc.dtype == g.dtype:
        if first:
            torch.mm(g.t(), h, out=acc)
        else:
            acc.addmm_(g.t(), h)
    elif g.is_cuda and _cuda_addmm_fp32_out_supported():
        if first:
            torch.mm(g.t(), h, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)
    elif first:  # CPU, or older torch: a temporary product, rounded once, summed in fp32
        acc.copy_(g.t() @ h)
    else:
        acc.add_(g.t() @ h)


def _forward_chunks(hidden, weight, targets, ignore_index, chunk_size, z_loss, backend, need_gh, need_gw):
    """Loop over row chunks. hidden (N, D), weight (V, D), targets (N,) int64 (all contiguous).
    Returns loss_sum f32 0-dim, n_tokens i64, n_correct i64, grad_hidden (N, D) | None, grad_weight (V, D) | None,
    the gradients being of loss_sum (the backward multiplies by the incoming scalar)."""
    N, D = hidden.shape
    V = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    write_grad = need_gh or need_gw
    rowwise = _rowwise_reference if backend == "reference" else _rowwise_numba
    # The reference does every matmul in fp32 (it is the oracle); the kernel backend keeps cuBLAS in the input dtype
    # and the logits in it too (what the full-logits eager and compiled recipes hold).
    fp32_matmuls = backend == "reference" or dtype == torch.float32
    logits_dtype = torch.float32 if fp32_matmuls else dtype
    w_mm = weight.float() if fp32_matmuls else weight          # (V, D); no copy when already fp32
    rows = auto_chunk_rows(N, V, logits_dtype, device) if chunk_size is None else min(int(chunk_size), N)

    loss_rows = torch.empty(N, dtype=torch.float32, device=device)
    correct_rows = torch.empty(N, dtype=torch.int32, device=device)
    # The gradients are of loss_sum: backward scales them by the incoming gradient (1 / tokens). fp16 holds them in
    # fp32 until then, since a sum-scale gradient times 1 / 262,144 tokens lands among fp16's subnormals (below
    # 6e-5): scaled first, cast after. bf16 has fp32's range and keeps the input dtype.
    grad_dtype = torch.float32 if dtype == torch.float16 else dtype
    grad_h = torch.empty(N, D, dtype=grad_dtype, device=device) if need_gh else None      # (N, D)
    n_chunks = -(-N // max(rows, 1))
    # one chunk: grad_weight straight from one matmul in the weight's dtype; more (or fp16): one fp32 accumulator
    acc_dtype = logits_dtype if n_chunks == 1 and dtype != torch.float16 else torch.float32
    grad_w_acc = torch.empty(V, D, dtype=acc_dtype, device=device) if need_gw else None
    buf = torch.empty(min(rows, N), V, dtype=logits_dtype, device=device) if N else None  # reused by every chunk

    for i, s in enumerate(range(0, N, max(rows, 1))):
        e = min(s + rows, N)
        h = hidden[s:e].float() if fp32_matmuls else hidden[s:e]                         # (n, D)
        logits = buf[: e - s]
        torch.mm(h, w_mm.t(), out=logits)                                                # (n, V) logits_dtype
        rowwise(logits, targets[s:e], ignore_index, z_loss, write_grad, loss_rows[s:e], correct_rows[s:e])
        if not write_grad:
            continue
        g = logits                                                                        # (n, V) dL/dlogits
        if need_gh:
            if grad_h.dtype == g.dtype:
                torch.mm(g, w_mm, out=grad_h[s:e])                                       # (n, V) @ (V, D)
            else:
                grad_h[s:e] = g @ w_mm
        if need_gw:
            _accumulate_grad_w(grad_w_acc, g, h, first=i == 0)                           # (V, n) @ (n, D)
    del buf

    loss_sum = loss_rows.sum()
    n_tokens = (targets != ignore_index).sum()
    n_correct = correct_rows.sum(dtype=torch.int64)
    grad_w = None
    if need_gw:  # fp16 keeps the fp32 accumulator until backward has scaled it (grad_dtype above)
        grad_w = grad_w_acc if grad_w_acc.dtype in (weight.dtype, grad_dtype) else grad_w_acc.to(weight.dtype)
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
        ctx.dtypes = (hidden.dtype, weight.dtype)  # fp16's gradients wait in fp32 and are cast after the scaling
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
        h_dtype, w_dtype = ctx.dtypes
        if grad_h is not None:
            grad_h.mul_(grad_loss)        # grad_loss: 0-dim fp32 on the device (e.g. 1 / n_tokens): no host sync
            grad_h = grad_h.to(h_dtype)   # a no-op but for fp16
        if grad_w is not None:
            grad_w.mul_(grad_loss)
            grad_w = grad_w.to(w_dtype)
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
    if chunk_size is not None and int(chunk_size) < 0:
        raise ValueError(f"chunk_size must be >= 1 rows (or None / 0: sized from the free memory), got {chunk_size}")


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
            int(ignore_index), int(chunk_size or 0) or None, float(z_loss), backend)
    # Autocast off inside: the reference's fp32 matmuls and the fp32 logits buffer must stay fp32.
    with torch.autocast(device_type, enabled=False):
        if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
            # Eval / no_grad: skip the Function, whose needs_input_grad would still ask for gradients under no_grad.
            loss_sum, n_tokens, n_correct, _, _ = _forward_chunks(*args, need_gh=False, need_gw=False)
            return CEResult(loss_sum, n_tokens, n_correct)
        return CEResult(*LinearCrossEntropyFunction.apply(*args))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = -100, chunk_size: int | None = None, z_loss: float = 0.0,
                         backend: str | None = None, reduction: str = "sum"):
    """Cross-entropy of `hidden @ weight.T` against `targets`, never holding more than one chunk of logits.

    hidden (N, D) or (B, T, D); weight (V, D); targets (N,) or (B, T) integer classes, ignore_index rows skipped.
    dtype float32 / bfloat16 / float16 (softmax math in fp32; gradients come back in the input dtype); under
    torch.autocast both are cast to the autocast dtype first, so fp32 master weights get fp32 gradients.
    chunk_size: rows of logits per chunk; None or 0 (default): the fewest chunks whose logits fit
    LOGITS_BUDGET_BYTES and a quarter of the device's free memory (see auto_chunk_rows).
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
                                   ignore_index: int = -100, chunk_size: int | None = None, z_loss: float = 0.0,
                                   backend: str | None = None, reduction: str = "sum"):
    """`linear_cross_entropy` on the pure-torch path whatever `backend` or LONGTRAIN_KERNELS say (the oracle)."""
    return linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, chunk_size=chunk_size,
                                z_loss=z_loss, backend="reference", reduction=reduction)
