"""Token sampling for generation: temperature -> top-k -> top-p -> min-p, then one seeded draw per row.

    next_tok = sample(logits, temperature=0.8, top_k=50, top_p=0.95, seed=1234, step=t)   # (B,) int64

Index names (fixed for this file, as in llm.c's dev/cuda files):
    B    rows (sequences) in the batch; one CUDA block per row, `row` = blockIdx.x
    V    vocabulary size; `i` indexes the vocabulary
    tid  thread index in the block, `block` threads per block (a power of two)
    l_i  logit (fp32), m = max_i l_i, T = temperature of the row
    w_i  = exp((l_i - m) / T) in fp32: unnormalised probability, w = 1 at the argmax
    key  order-preserving int64 key of a float32 logit (-0.0 and +0.0 share key 0), see _order_key

Semantics (the reference and the kernel implement exactly these; the tests check both against them):
    temperature <= 0          greedy: argmax, lowest index on ties (torch.argmax's rule).
    top_k = k in (0, V)       keep logits >= the k-th largest logit. TIES: every logit equal to the k-th value is
                              kept, so more than k tokens survive when the k-th value is repeated. k <= 0 or >= V: off.
    top_p = p < 1             nucleus over the top-k survivors: sort them by logit, descending; n = the fewest leading
                              tokens whose mass reaches p * (their total mass); keep logits >= the n-th logit (ties at
                              that value kept, as for top-k). p >= 1: off. p <= 0 keeps only the argmax (and its ties).
    min_p = q > 0             keep tokens with w_i >= q, i.e. p_i >= q * p_max (ratios survive renormalisation, so
                              it does not matter that it runs after top-p). The argmax always survives every filter.
    draw                      u in [0, 1) from a counter-based hash of (seed[row], step[row]); the token is the first
                              i in VOCAB order whose running sum of kept w exceeds u * sum(kept w) (inverse CDF).
Reference and kernel share the hash, so they draw the same u and pick the same token, except where u * sum lands
within floating-point rounding of a CDF boundary or a filter threshold (the sums are taken in different orders:
sorted cumsum in fp64 in the reference, tree reductions in fp64 over fp32 w in the kernel).
Inputs: finite logits (-inf allowed) with at least one finite logit per row; fp16/bf16 logits are upcast to fp32.

Parts: 1. counter-based uniform (shared by both paths)  2. reference (pure torch: the oracle and the CPU path)
       3. kernel (Numba CUDA)  4. launch configuration  5. public entry `sample`.
"""
from __future__ import annotations

import functools
import math
import time

import torch

from cuda_ops.dispatch import resolve_backend

# ---------------------------------------------------------------------------------------------------------------
# 1. Counter-based uniform: u = bits53(seed, step) / 2**53, identical in torch int64 ops and in Numba
# ---------------------------------------------------------------------------------------------------------------
# Written with operators only (& >> ^ * +) so the same function runs on torch int64 tensors, on numpy scalars under
# the CUDA simulator and, registered with register_jitable, inside the kernel. Every product stays below 2**63, so
# signed int64 arithmetic never overflows and there is no unsigned type to disagree about.
_M32 = 0xFFFFFFFF


def _mul32(a, c):
    """(a * c) mod 2**32 for 0 <= a < 2**32 and a constant 0 <= c < 2**32, split in 16-bit halves of c."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser: a bijection on [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _counter_bits53(seed, step):
    """53 random bits (an int in [0, 2**53)) from the 64-bit seed and 64-bit step; two independent hash chains.
    For a fixed seed, distinct 32-bit steps give distinct chain-1 states (each stage is a bijection)."""
    words = (seed & _M32, (seed >> 32) & _M32, step & _M32, (step >> 32) & _M32)
    h1 = _fmix32(words[0] ^ 0x243F6A88)
    h1 = _fmix32(h1 ^ words[1])
    h1 = _fmix32(h1 ^ words[2])
    h1 = _fmix32(h1 ^ words[3])
    h2 = _fmix32(words[0] ^ 0x13198A2E)
    h2 = _fmix32(h2 ^ words[1] ^ 0x03707344)
    h2 = _fmix32(h2 ^ words[2])
    h2 = _fmix32(h2 ^ words[3] ^ 0x299F31D0)
    return h1 * 2097152 + (h2 >> 11)  # h1 << 21 | top 21 bits of h2


_INV_2_53 = 1.0 / 9007199254740992.0


def counter_uniform(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(B,) int64 seeds and steps -> (B,) float64 uniforms in [0, 1); the kernel computes the same values."""
    return _counter_bits53(seed.long(), step.long()).double() * _INV_2_53


# ---------------------------------------------------------------------------------------------------------------
# 2. Reference (pure torch): the test oracle and the CPU path
# ---------------------------------------------------------------------------------------------------------------

def _kept_weights(logits, temps, ks, ps, minps):
    """(B, V) logits and (B,) params -> (B, V) float64 unnormalised kept weights w_i (0 where filtered) and (B,)
    bool greedy mask. Greedy rows get a one-hot weight at the argmax."""
    x = logits.float()  # (B, V)
    B, V = x.shape
    greedy = ~(temps > 0)  # NaN temperature counts as greedy, as in the kernel
    m = x.max(dim=1, keepdim=True).values  # (B, 1)
    t = torch.where(greedy, torch.ones_like(temps), temps).float()[:, None]  # (B, 1)
    w32 = torch.exp((x - m) / t)  # (B, V) fp32, the kernel's formula
    # top-k: keep l >= k-th largest (ties kept)
    xs, order = x.sort(dim=1, descending=True, stable=True)  # (B, V)
    kth = xs.gather(1, (ks - 1).clamp(0, V - 1)[:, None])  # (B, 1)
    k_on = ((ks > 0) & (ks < V))[:, None]
    keep = ~k_on | (x >= kth)  # (B, V)
    # top-p over the top-k survivors: n = first sorted position where the cumulative mass reaches p * total
    ws = (w32.double() * keep).gather(1, order)  # (B, V) sorted by logit, descending
    cum = ws.cumsum(dim=1)
    need = ps.double()[:, None] * cum[:, -1:]
    n = (cum < need).sum(dim=1, keepdim=True).clamp(max=V - 1)  # (B, 1)
    p_on = (ps < 1)[:, None]
    keep = keep & (~p_on | (x >= xs.gather(1, n)))
    # min-p: w_i >= q (w_max = 1), compared in fp32 as in the kernel
    keep = keep & (w32 >= minps.float()[:, None])
    w = w32.double() * keep  # (B, V)
    onehot = torch.zeros_like(w).scatter_(1, x.argmax(dim=1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, w), greedy


def filtered_probs_reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """(B, V) logits -> (B, V) float64 probabilities after all filters, renormalised; zero outside the kept set."""
    temps, ks, ps, minps, _, _ = _row_params(logits, temperature, top_k, top_p, min_p, 0, 0)
    w, _ = _kept_weights(logits, temps, ks, ps, minps)
    return w / w.sum(dim=1, keepdim=True)


def _sample_reference_rows(logits, temps, ks, ps, minps, seeds, steps) -> torch.Tensor:
    w, greedy = _kept_weights(logits, temps, ks, ps, minps)  # (B, V) float64
    cum = w.cumsum(dim=1)  # (B, V) in vocab order
    target = counter_uniform(seeds, steps) * cum[:, -1]  # (B,)
    tok = torch.searchsorted(cum, target[:, None], right=True)[:, 0]  # first i with cum_i > target
    V = w.shape[1]
    last_kept = V - 1 - (w > 0).flip(1).int().argmax(dim=1)  # rounding guard: target >= cum[-1]
    tok = torch.minimum(tok, last_kept)
    return torch.where(greedy, logits.float().argmax(dim=1), tok)


def sample_reference(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0) -> torch.Tensor:
    """Pure-torch `sample` (same signature minus backend): sort-based filters, fp64 cumsum inverse CDF."""
    return _sample_reference_rows(logits, *_row_params(logits, temperature, top_k, top_p, min_p, seed, step))


# ---------------------------------------------------------------------------------------------------------------
# 3. Kernel: one block per row; every loop over V is strided by `block` (coalesced) except the final scan
# ---------------------------------------------------------------------------------------------------------------
_KEY_LO = -(2**31)  # below every key of a non-NaN float32: count(key >= _KEY_LO) == V
# Numba names the kernel uses, bound by _build_kernel on first use (numba is imported lazily). They must be module
# globals: the CUDA simulator runs the kernel as Python and swaps the module-global `cuda` for its fake module.
cuda = float64 = int64 = None


def _order_key(bits):
    """int32 bit pattern of a float32 -> int64 key with key(a) < key(b) iff a < b; -0.0 and +0.0 both map to 0."""
    b = bits * 1  # widen: bits arrive as int32 (int64 in Numba's arithmetic)
    if b < 0:
        return (b ^ 0x7FFFFFFF) + 1
    return b


@functools.lru_cache(maxsize=1)
def _register_helpers() -> None:
    """Make the plain-Python helpers callable from device code (once per process; the simulator calls them as
    ordinary Python, and the same functions run on torch tensors in the reference)."""
    try:
        from numba.cuda.extending import register_jitable
    except ImportError:  # simulator builds without the extending module
        return
    for fn in (_mul32, _fmix32, _counter_bits53, _order_key):
        register_jitable(fn)


@functools.lru_cache(maxsize=None)
def _build_kernel(block: int):
    """Compile-once factory: `block` is a compile-time constant (shared-memory sizes, reduction trees)."""
    global cuda, float64, int64
    from numba import cuda, float64, int64
    from numba.cuda.core import config

    # launch_bounds caps registers so `block` threads fit one SM (64 per thread at 1024; the simulator lacks it)
    kernel_options = {} if config.ENABLE_CUDASIM else {"launch_bounds": block}

    _register_helpers()

    @cuda.jit(device=True)
    def block_sum(sh, v, tid):
        sh[tid] = v
        cuda.syncthreads()
        s = block // 2
        while s > 0:
            if tid < s:
                sh[tid] += sh[tid + s]
            cuda.syncthreads()
            s //= 2
        total = sh[0]
        cuda.syncthreads()  # everyone has read sh[0] before sh is reused
        return total

    @cuda.jit(device=True)
    def block_max(sh, v, tid):
        sh[tid] = v
        cuda.syncthreads()
        s = block // 2
        while s > 0:
            if tid < s and sh[tid + s] > sh[tid]:
                sh[tid] = sh[tid + s]
            cuda.syncthreads()
            s //= 2
        best = sh[0]
        cuda.syncthreads()
        return best

    @cuda.jit(device=True)
    def block_argmax(sh_k, sh_j, key, idx, tid):
        """(max key, lowest index holding it) over the block."""
        sh_k[tid] = key
        sh_j[tid] = idx
        cuda.syncthreads()
        s = block // 2
        while s > 0:
            if tid < s:
                k2 = sh_k[tid + s]
                j2 = sh_j[tid + s]
                if k2 > sh_k[tid] or (k2 == sh_k[tid] and j2 < sh_j[tid]):
                    sh_k[tid] = k2
                    sh_j[tid] = j2
            cuda.syncthreads()
            s //= 2
        best_k = sh_k[0]
        best_j = sh_j[0]
        cuda.syncthreads()
        return best_k, best_j

    @cuda.jit(device=True)
    def block_reduce3(sh_f, sh_k, sh_j, total, kmin, kmax, tid):
        """(sum of total, min of kmin, max of kmax) over the block in one reduction tree."""
        sh_f[tid] = total
        sh_k[tid] = kmin
        sh_j[tid] = kmax
        cuda.syncthreads()
        s = block // 2
        while s > 0:
            if tid < s:
                sh_f[tid] += sh_f[tid + s]
                if sh_k[tid + s] < sh_k[tid]:
                    sh_k[tid] = sh_k[tid + s]
                if sh_j[tid + s] > sh_j[tid]:
                    sh_j[tid] = sh_j[tid + s]
            cuda.syncthreads()
            s //= 2
        total = sh_f[0]
        kmin = sh_k[0]
        kmax = sh_j[0]
        cuda.syncthreads()
        return total, kmin, kmax

    @cuda.jit(device=True)
    def bisect_threshold(logits, bits, row, lo, hi, m, T, by_mass, need, sh_f, sh_k, sh_j, tid):
        """Largest key t in [lo, hi] with measure(key >= t) >= need; measure = count (by_mass False) or sum of w.
        Needs measure(key >= lo) >= need and hi a data key. Bisection over the int keys, and every round also
        reduces the nearest data keys on both sides of mid, to which lo / hi snap: the loop ends as soon as the
        bracket holds one data key, after about log2(key range / gap at the threshold) rounds (at most 32)."""
        V = logits.shape[1]
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            meas = 0.0
            above = hi  # smallest data key >= mid (hi is one)
            below = lo  # largest data key in [lo, mid); one exists whenever the round fails (see the docstring)
            for i in range(tid, V, block):
                key = _order_key(bits[row, i])
                if key >= mid:
                    if by_mass:
                        meas += math.exp((logits[row, i] - m) / T)
                    else:
                        meas += 1.0
                    if key < above:
                        above = key
                elif key > below:
                    below = key
            meas, above, below = block_reduce3(sh_f, sh_k, sh_j, meas, above, below, tid)
            if meas >= need:
                lo = above  # same kept set as mid
            else:
                hi = below
        return lo

    @cuda.jit(**kernel_options)
    def sample_kernel(logits, bits, temps, ks, ps, minps, seeds, steps, out):
        # logits (B, V) f32; bits (B, V) i32 = the same memory viewed as int32; params (B,); out (B,) int64
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        V = logits.shape[1]
        sh_f = cuda.shared.array(block, float64)
        sh_k = cuda.shared.array(block, int64)
        sh_j = cuda.shared.array(block, int64)

        # argmax: the greedy answer, m and the upper end of both bisections
        best_k = _KEY_LO - 1
        best_j = V
        for i in range(tid, V, block):
            key = _order_key(bits[row, i])
            if key > best_k:  # strict: the first (lowest) i of this thread wins ties
                best_k = key
                best_j = i
        key_max, i_max = block_argmax(sh_k, sh_j, best_k, best_j, tid)
        T = temps[row]
        if not (T > 0):  # greedy row (block-uniform branch, so the early return is safe)
            if tid == 0:
                out[row] = i_max
            return
        m = logits[row, i_max]

        # top-k: the k-th largest key is the largest t with count(key >= t) >= k, so logits tied with it are kept
        k = ks[row]
        t_k = _KEY_LO
        if k > 0 and k < V:
            t_k = bisect_threshold(logits, bits, row, _KEY_LO, key_max, m, T, False, float64(k),
                                   sh_f, sh_k, sh_j, tid)

        # top-p: largest t >= t_k with mass(key >= t) >= p * mass(key >= t_k). Probabilities are monotone in the
        # logit, so bisecting on the logit key is bisecting on the probability threshold, ties included
        p = ps[row]
        t_p = t_k
        if p < 1.0:
            z = 0.0
            for i in range(tid, V, block):
                if _order_key(bits[row, i]) >= t_k:
                    z += math.exp((logits[row, i] - m) / T)
            need = float64(p) * block_sum(sh_f, z, tid)
            t_p = bisect_threshold(logits, bits, row, t_k, key_max, m, T, True, need, sh_f, sh_k, sh_j, tid)

        # draw: thread tid owns the contiguous vocab segment [start, end) so the block scan follows vocab order
        q = minps[row]
        seg = (V + block - 1) // block
        start = tid * seg
        end = min(start + seg, V)
        s = 0.0
        for i in range(start, end):
            if _order_key(bits[row, i]) >= t_p:
                w = math.exp((logits[row, i] - m) / T)
                if w >= q:
                    s += w
        sh_f[tid] = s  # inclusive Hillis-Steele scan of the segment sums
        cuda.syncthreads()
        off = 1
        while off < block:
            v = 0.0
            if tid >= off:
                v = sh_f[tid - off]
            cuda.syncthreads()
            sh_f[tid] += v
            cuda.syncthreads()
            off *= 2
        incl = sh_f[tid]
        excl = 0.0
        if tid > 0:
            excl = sh_f[tid - 1]
        target = float64(_counter_bits53(seeds[row], steps[row])) * _INV_2_53 * sh_f[block - 1]
        # the segment holding the target; rounding can leave none (target at the very top) or, the scan not being
        # bitwise monotone, two: take the lowest claimant, else the last segment with mass
        claim = block
        if s > 0.0 and excl <= target and target < incl:
            claim = tid
        winner = -block_max(sh_j, -claim, tid)
        if winner == block:
            has = -1
            if s > 0.0:
                has = tid
            winner = block_max(sh_j, has, tid)
        if tid == winner:
            acc = excl
            ans = -1
            last = -1
            for i in range(start, end):
                if _order_key(bits[row, i]) >= t_p:
                    w = math.exp((logits[row, i] - m) / T)
                    if w >= q and w > 0.0:
                        last = i
                        acc += w
                        if acc > target:
                            ans = i
                            break
            if ans < 0:
                ans = last
            out[row] = ans

    return sample_kernel


# ---------------------------------------------------------------------------------------------------------------
# 4. Launch configuration
# ---------------------------------------------------------------------------------------------------------------

def _pick_block(V: int) -> int:
    """Threads per block: a power of two in [32, 1024], about 16 vocab entries per thread (V=32000 -> 1024)."""
    block = 32
    while block < 1024 and block * 16 < V:
        block *= 2
    return block


def _launch(logits, bits, temps, ks, ps, minps, seeds, steps, out, block: int, stream=0):
    """One launch for the whole batch: grid B blocks, `block` threads. Arrays are numpy or Numba device arrays."""
    if block & (block - 1) or not 1 <= block <= 1024:
        raise ValueError(f"block must be a power of two in [1, 1024], got {block}")
    _build_kernel(block)[logits.shape[0], block, stream](logits, bits, temps, ks, ps, minps, seeds, steps, out)


def _sample_numba_arrays(logits, temps, ks, ps, minps, seeds, steps, *, block=None):
    """numpy driver (tests, CUDA simulator): (B, V) logits and (B,) params -> (B,) int64 tokens."""
    import numpy as np

    x = np.ascontiguousarray(logits, dtype=np.float32)
    B, V = x.shape
    row = lambda a, dt: np.array(np.broadcast_to(np.asarray(a, dtype=dt), (B,)))  # noqa: E731 (writable copy)
    out = np.full(B, -1, dtype=np.int64)
    _launch(x, x.view(np.int32), row(temps, np.float32), row(ks, np.int64), row(ps, np.float32),
            row(minps, np.float32), row(seeds, np.int64), row(steps, np.int64), out, block or _pick_block(V))
    return out


def _sample_numba_torch(logits, temps, ks, ps, minps, seeds, steps, block=None) -> torch.Tensor:
    from cuda_ops.dispatch import as_numba, check_same_device, torch_stream

    x = logits.float().contiguous()  # (B, V) fp32; a copy only for fp16/bf16 or strided logits
    check_same_device(x)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    args = [as_numba(a) for a in (x, x.view(torch.int32), temps, ks, ps, minps, seeds, steps, out)]
    _launch(*args, block=block or _pick_block(x.shape[1]), stream=torch_stream())
    return out


def warmup(block: int = 1024) -> float:
    """Compile the kernel for `block` ahead of the first generation step; returns the seconds it took."""
    import numpy as np

    t0 = time.perf_counter()
    _sample_numba_arrays(np.zeros((1, 2 * block), np.float32), 1.0, 0, 1.0, 0.0, 0, 0, block=block)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------
# 5. Public entry
# ---------------------------------------------------------------------------------------------------------------

def _per_row(value, name, B, dtype, device):
    """Python scalar -> (B,) tensor filled on `device` (no host sync); tensor -> checked (B,) tensor on `device`.
    Pass per-row tensors already on the logits' device: a CPU tensor is copied synchronously."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(B)
        if tuple(value.shape) != (B,):
            raise ValueError(f"sample(): {name} must be a Python number or a ({B},) tensor, one value per row of "
                             f"logits; got a tensor of shape {tuple(value.shape)}")
        return value.to(device=device, dtype=dtype).contiguous()
    return torch.full((B,), value, dtype=dtype, device=device)


def _row_params(logits, temperature, top_k, top_p, min_p, seed, step):
    """Validate scalars (tensor values are not checked: that would sync) and expand everything to (B,) tensors."""
    if logits.dim() != 2:
        raise ValueError(f"sample(): logits must be (B, V), got shape {tuple(logits.shape)}")
    checks = (("temperature", temperature, lambda v: v >= 0, ">= 0 (0 = greedy)"),
              ("top_k", top_k, lambda v: v >= 0 and int(v) == v, "an integer >= 0 (0 = off)"),
              ("top_p", top_p, lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
              ("min_p", min_p, lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"))
    for name, value, ok, rule in checks:
        if not isinstance(value, torch.Tensor) and not ok(value):
            raise ValueError(f"sample(): {name}={value!r} is out of range; it must be {rule}")
    B, dev = logits.shape[0], logits.device
    return (_per_row(temperature, "temperature", B, torch.float32, dev),
            _per_row(top_k, "top_k", B, torch.int64, dev),
            _per_row(top_p, "top_p", B, torch.float32, dev),
            _per_row(min_p, "min_p", B, torch.float32, dev),
            _per_row(seed, "seed", B, torch.int64, dev),
            _per_row(step, "step", B, torch.int64, dev))


def sample(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0, backend=None) -> torch.Tensor:
    """Draw one token per row. logits (B, V) any float dtype; each parameter a Python number or a (B,) tensor.

    Returns (B,) int64 on logits.device. Same (logits, params, seed, step) -> same tokens; advance `step` every
    generation step (a (B,) `step` tensor is accepted too). On CUDA with numba-cuda this is one kernel launch on
    torch's current stream with no host sync (given per-row tensors already on the device); elsewhere, or with
    backend="reference", the pure-torch reference runs. See the module docstring for the exact filter rules.
    """
    params = _row_params(logits, temperature, top_k, top_p, min_p, seed, step)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if resolve_backend(logits.device, backend) == "numba":
        return _sample_numba_torch(logits, *params)
    return _sample_reference_rows(logits, *params)
