"""The Numba side of cuda_ops/sampling.py: a sorting-free, split, graph-capturable sampler (no sort, no host sync).

    plan = SamplingPlan(B, V, splits=None, n_sm=132)    # grid, bucket count and the fixed launch sequence
    ws = plan.workspace(device)                          # every buffer a call needs, allocated once
    plan.launch(kernel_args, needs_top_k, needs_top_p)   # L launches of one kernel on torch's current stream

The semantics (temperature -> top-k -> top-p -> min-p -> inverse-CDF draw) and the pure-torch reference are in
sampling.py; the counter-based uniform both paths draw from is here (part 1), so that kernel and reference share
it. Index names:
    B    rows; `row` = blockIdx.y          V    vocabulary; `i` a vocabulary index
    S    splits: blocks per row, `s` = blockIdx.x; split s owns the contiguous vocab slice [s*seg, (s+1)*seg)
    tid  thread in a block of BLOCK         NB   buckets per search round; `j` a bucket
    key  order-preserving int key of a float32 logit (-0.0 and +0.0 share key 0); w = exp((l - m) / T)

Why split and why several launches. Reading a (64, 32000) fp32 batch takes ~3 us, so the sampler is bound by
latency, not bytes: one block per row leaves half an H100 idle at batch 64 and 131 of 132 SMs at batch 1. Here each
row is cut into S slices (S chosen so the grid fills every SM with BLOCKS_PER_SM blocks, one wave, and has >= 128
blocks where the vocabulary allows), every pass over the logits is spread over S * B blocks, and the S partial
results of a pass are merged at the start of the next launch (a kernel boundary is the only grid-wide barrier that
is graph-capturable and that the CUDA simulator can run). Thresholds are found by pivot search, FlashInfer-style,
but NB-ary: a round splits the bracket [lo, hi] of keys into NB buckets and measures each (count for top-k, mass for
top-p) with the smallest and largest key seen in it; the next launch keeps the one bucket holding the threshold and
snaps the bracket to its extreme keys. A round divides the key range by NB = 16 at least, so 9 rounds bound any
search of 32-bit keys; rows that finish early skip the remaining launches. Keys above the bracket are counted once
(the `above` measure carried in the row state), so later rounds touch only keys inside the bracket. A thread keeps
its buckets in its own column of the block's shared arrays (no local memory: the PTX for sm_90 has none) and its
index arithmetic is shifts, masks and one exact fp64 division per visited key (no 64-bit integer division in the
loop).

Every number a row needs between launches lives in device memory (the row state and the partials), the step
counter too (incremented by the last launch), so the fixed launch sequence can be captured in a CUDA graph and
replayed for every generation step. Sums are fp64 over fp32 weights, reduced in a fixed order: the same inputs
give the same token on every run.
"""
from __future__ import annotations

import functools
import math
import warnings

# ---------------------------------------------------------------------------------------------------------------
# 1. Counter-based uniform: u = bits53(seed, step) / 2**53, identical in torch int64 ops and in Numba
# ---------------------------------------------------------------------------------------------------------------
# Written with operators only (& >> ^ * +) so the same function runs on torch int64 tensors, on numpy scalars under
# the CUDA simulator and, registered with register_jitable, inside the kernel. Every product stays below 2**63, so
# signed int64 arithmetic never overflows and there is no unsigned type to disagree about.
_M32 = 0xFFFFFFFF
INV_2_53 = 1.0 / 9007199254740992.0


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


def counter_bits53(seed, step):
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


def order_key(bits):
    """int32 bit pattern of a float32 -> int key with key(a) < key(b) iff a < b; -0.0 and +0.0 both map to 0.
    Keys of non-NaN floats lie in (-2**31, 2**31): they fit int32."""
    b = bits * 1  # widen: bits arrive as int32 (int64 in Numba's arithmetic)
    if b < 0:
        return (b ^ 0x7FFFFFFF) + 1
    return b


# ---------------------------------------------------------------------------------------------------------------
# 2. Kernel: one launch = merge the previous launch's partials into the row state, then one pass over the slice
# ---------------------------------------------------------------------------------------------------------------
# Row state, int64 columns (state_i[row, c]) and float64 columns (state_f[row, c]):
PHASE, LO, HI, IMAX, TK, KEYMAX = range(6)
ABOVE, NEED, U, M = range(4)
# phases: what the partials written by the previous launch hold, i.e. what the next launch merges
ARGMAX, KSEARCH, PSEARCH, DRAW, DONE = range(5)
KEY_EMPTY_LO, KEY_EMPTY_HI = 2**31 - 1, -(2**31)  # bucket min / max of an empty bucket (outside every key)
UNROLL = 4  # loads in flight per thread in a streaming pass (the loop in build_kernel is written out for 4)
cuda = float32 = float64 = int32 = int64 = None  # bound by build_kernel (module globals: the simulator swaps `cuda`)
_int_as_float = None  # int32 bits -> the float32 they hold (libdevice on the GPU, numpy under the simulator)


@functools.lru_cache(maxsize=1)
def _register_helpers() -> None:
    """Make the plain-Python helpers callable from device code (the simulator calls them as plain Python)."""
    try:
        from numba.cuda.extending import register_jitable
    except ImportError:  # simulator builds without the extending module
        return
    for fn in (_mul32, _fmix32, counter_bits53, order_key):
        register_jitable(fn)


@functools.lru_cache(maxsize=None)
def build_kernel(block: int, nb: int):
    """The sampling kernel for `block` threads and `nb` buckets per round (compile-time constants).

    kernel[(S, B), block, stream](logits (B, V) f32, bits (B, V) i32 (same memory), temps, ks, ps, minps, seeds,
        steps (B,) params, out (B,) i64, state_i (2, B, 6) i64, state_f (2, B, 4) f64, part_f (2, B, S, nb) f64,
        part_lo (2, B, S, nb) i32, part_hi (2, B, S, nb) i32, it int, last bool)
    Launch `it` reads state and partials from copy it % 2 and writes copy 1 - it % 2: a block that finishes
    early must not overwrite what the other blocks of its row are still reading in the same launch.
    """
    global cuda, float32, float64, int32, int64, _int_as_float
    from numba import cuda, float32, float64, int32, int64
    from numba.cuda.core import config

    if block & (block - 1) or nb & (nb - 1) or not nb <= block <= 1024 or nb < 2:
        raise ValueError(f"block and nb must be powers of two, 2 <= nb <= block <= 1024; got block={block}, nb={nb}")
    # index arithmetic by shifts and masks: a 64-bit integer division costs ~100 instructions on a GPU
    log2_nb, log2_block = nb.bit_length() - 1, block.bit_length() - 1
    _register_helpers()
    if config.ENABLE_CUDASIM:  # the simulator has no libdevice: a numpy bit cast, the same value
        import numpy as np

        _int_as_float = lambda i: np.array(i, dtype=np.int64).astype(np.int32).view(np.float32)[()]  # noqa: E731
    else:
        from numba.cuda import libdevice

        _int_as_float = libdevice.int_as_float
    kernel_options = {} if config.ENABLE_CUDASIM else {"launch_bounds": block}

    @cuda.jit(device=True)
    def combine(red_f, red_lo, red_hi, j, a, b, argmax_pair):
        """Fold column b of bucket j into column a: sum, min key, max key; bucket 1 of the argmax pass holds a
        (max key, its first index) pair, folded lexicographically (larger key, then lower index)."""
        red_f[j, a] += red_f[j, b]
        if argmax_pair and j == 1:
            if red_hi[j, b] > red_hi[j, a] or (red_hi[j, b] == red_hi[j, a] and red_lo[j, b] < red_lo[j, a]):
                red_hi[j, a] = red_hi[j, b]
                red_lo[j, a] = red_lo[j, b]
        else:
            red_lo[j, a] = min(red_lo[j, a], red_lo[j, b])
            red_hi[j, a] = max(red_hi[j, a], red_hi[j, b])

    @cuda.jit(device=True)
    def merge_buckets(red_f, red_lo, red_hi, part_f, part_lo, part_hi, rd, row, S, tid, argmax_pair, reduce):
        """Load the S partials of every bucket into red_*[j, s]; with `reduce`, fold them over s in a fixed tree
        order so that bucket j ends in column 0. Ends synchronised."""
        for idx in range(tid, S * nb, block):
            j = idx & (nb - 1)  # idx = s * nb + j: consecutive threads read consecutive buckets of one partial
            s = idx >> log2_nb
            red_f[j, s] = part_f[rd, row, s, j]
            red_lo[j, s] = part_lo[rd, row, s, j]
            red_hi[j, s] = part_hi[rd, row, s, j]
        cuda.syncthreads()
        if not reduce:
            return
        shift = 0  # width = 2**shift, the power of two at or above S
        while (1 << shift) < S:
            shift += 1
        while shift > 0:
            shift -= 1
            half = 1 << shift
            for idx in range(tid, nb * half, block):
                j = idx >> shift
                s = idx & (half - 1)
                if s + half < S:
                    combine(red_f, red_lo, red_hi, j, s, s + half, argmax_pair)
            cuda.syncthreads()

    @cuda.jit(device=True)
    def decide(red_f, red_lo, red_hi, st_i, st_f):
        """Thread 0: keep the bucket holding the threshold. Returns True when the bracket is one key (= lo)."""
        above = st_f[ABOVE]
        if st_f[NEED] < 0.0:  # first top-p round: the mass of everything in the bracket is Z over the top-k set
            total = above
            for j in range(nb):
                total += red_f[j, 0]
            st_f[NEED] = st_f[NEED] * -1.0 * total
        need = st_f[NEED]
        meas = above
        for jj in range(nb):
            j = nb - 1 - jj
            if red_hi[j, 0] == KEY_EMPTY_HI:
                continue
            if meas + red_f[j, 0] >= need:  # largest bucket whose lower pivot reaches the need
                st_i[LO] = red_lo[j, 0]
                st_i[HI] = red_hi[j, 0]
                st_f[ABOVE] = meas
                return red_lo[j, 0] == red_hi[j, 0]
            meas += red_f[j, 0]
        st_i[HI] = st_i[LO]  # unreachable when the invariant holds (measure(key >= lo) >= need): stop at lo
        return True

    @cuda.jit(device=True)
    def visit(job, b, i, lo, hi, width_f, m, T, q, red_f, red_lo, red_hi, c):
        """Fold logit i (its float32 bits b) into this thread's buckets, column c of the block's shared bucket arrays
        (a per-thread array indexed by a computed bucket would live in local memory), for the pass `job`. ARGMAX:
        bucket 0 holds the min key, bucket 1 (first index of the max key, max key). KSEARCH / PSEARCH: the bucket of
        keys in [lo, hi] gets its count / mass and key range. DRAW: bucket 0 sums the kept mass (key >= lo, w >= min-p).
        The logit's value is its bits cast back (no second load); the bucket is floor((key - lo) * nb / width) in
        fp64, which is exact (operands below 2**37, a quotient at least 1 / width from any integer it is not), so
        buckets are the integer key ranges a 64-bit integer division would give, without the division's cost."""
        key = order_key(b)
        if job == ARGMAX:
            if key < red_lo[0, c]:
                red_lo[0, c] = key
            if key > red_hi[1, c]:  # strict: the first (lowest) i of this thread wins ties (i grows in a thread)
                red_hi[1, c] = key
                red_lo[1, c] = i
            return
        if key < lo:
            return
        if job == DRAW:
            w = math.exp((_int_as_float(b) - m) / T)
            if w >= q:
                red_f[0, c] += w
            return
        if key > hi:
            return
        j = int32(math.floor(float64((key - lo) * nb) / width_f))
        if job == KSEARCH:
            red_f[j, c] += 1.0
        else:
            red_f[j, c] += math.exp((_int_as_float(b) - m) / T)
        if key < red_lo[j, c]:
            red_lo[j, c] = key
        if key > red_hi[j, c]:
            red_hi[j, c] = key

    @cuda.jit(**kernel_options)
    def kernel(logits, bits, temps, ks, ps, minps, seeds, steps, out, state_i, state_f, part_f, part_lo, part_hi,
               it, last):
        s = cuda.blockIdx.x
        row = cuda.blockIdx.y
        S = cuda.gridDim.x
        tid = cuda.threadIdx.x
        V = logits.shape[1]
        seg = (V + S - 1) // S
        start = min(s * seg, V)
        end = min(start + seg, V)
        red_f = cuda.shared.array((nb, block), float64)  # merge scratch, then this block's bucket reduction
        red_lo = cuda.shared.array((nb, block), int32)
        red_hi = cuda.shared.array((nb, block), int32)
        st_i = cuda.shared.array(6, int64)  # this launch's copy of the row state
        st_f = cuda.shared.array(4, float64)
        work = cuda.shared.array(1, int32)  # the phase whose pass this launch runs (FIND = DRAW + 10)
        T = temps[row]
        first = it == 0
        rd = it % 2
        wr = 1 - rd

        # ---- merge: every block of the row computes the same new state; block 0 writes it back ----------------
        if first:
            if tid == 0:
                work[0] = ARGMAX
        else:
            if tid < 6:
                st_i[tid] = state_i[rd, row, tid]
            if tid < 4:
                st_f[tid] = state_f[rd, row, tid]
            cuda.syncthreads()
            phase = st_i[PHASE]
            if phase == ARGMAX or phase == KSEARCH or phase == PSEARCH or phase == DRAW:
                merge_buckets(red_f, red_lo, red_hi, part_f, part_lo, part_hi, rd, row, S, tid, phase == ARGMAX,
                              phase != DRAW)
            if tid == 0:
                work[0] = DONE
                if phase == ARGMAX:  # bucket 0: (min key, max key); bucket 1: (first index of the max key, max key)
                    st_i[KEYMAX] = red_hi[0, 0]
                    st_i[IMAX] = red_lo[1, 0]
                    if not (T > 0):  # greedy row: the argmax is the answer
                        out[row] = st_i[IMAX]
                        phase = DONE
                    else:
                        st_f[M] = logits[row, st_i[IMAX]]
                        k = ks[row]
                        st_i[LO] = red_lo[0, 0]
                        st_i[HI] = red_hi[0, 0]
                        st_f[ABOVE] = 0.0
                        if k > 0 and k < V and st_i[LO] < st_i[HI]:
                            phase = KSEARCH
                            st_f[NEED] = float64(k)
                        else:
                            phase = PSEARCH + 100  # enter top-p with t_k = the smallest key
                elif phase == KSEARCH:
                    if decide(red_f, red_lo, red_hi, st_i, st_f):
                        phase = PSEARCH + 100
                elif phase == PSEARCH:
                    if decide(red_f, red_lo, red_hi, st_i, st_f):
                        phase = DRAW + 100
                elif phase == DRAW:  # red_f[0, s]: the kept mass of slice s, in vocab order; find the slice
                    total = 0.0
                    for ss in range(S):
                        total += red_f[0, ss]
                    target = st_f[U] * total
                    acc = 0.0
                    owner = -1
                    last_with_mass = -1
                    for ss in range(S):
                        mass = red_f[0, ss]
                        if mass > 0.0:
                            last_with_mass = ss
                            if owner < 0 and target < acc + mass:
                                owner = ss
                                st_f[U] = target - acc  # the target inside the owner's slice
                        acc += mass
                    if owner < 0:  # rounding put the target at the very top: the last slice with mass
                        owner = last_with_mass
                        st_f[U] = red_f[0, owner]
                    if s == owner:
                        work[0] = DRAW + 10  # FIND: this block walks its slice
                    phase = DONE
                if phase == PSEARCH + 100:  # enter top-p over keys >= t_k (lo holds t_k)
                    st_i[TK] = st_i[LO]
                    st_i[HI] = st_i[KEYMAX]
                    st_f[ABOVE] = 0.0
                    if ps[row] < 1.0 and st_i[LO] < st_i[HI]:
                        phase = PSEARCH
                        st_f[NEED] = -float64(ps[row])  # negative: p * (mass of the bracket), known next launch
                    else:
                        phase = DRAW + 100
                if phase == DRAW + 100:  # the kept set is key >= lo and w >= min_p; draw u now
                    phase = DRAW
                    st_f[U] = float64(counter_bits53(seeds[row], steps[row])) * INV_2_53
                if phase == KSEARCH or phase == PSEARCH or phase == DRAW:
                    work[0] = phase
                st_i[PHASE] = phase
            cuda.syncthreads()
            if s == 0 and tid < 6:
                state_i[wr, row, tid] = st_i[tid]
            if s == 0 and tid < 4:
                state_f[wr, row, tid] = st_f[tid]
        if last and s == 0 and tid == 0:
            steps[row] += 1
        cuda.syncthreads()
        job = work[0]
        if job == DONE:
            return

        # ---- pass over this block's slice -----------------------------------------------------------------------
        m = float32(st_f[M])  # the max logit: w = exp((l - m) / T) in fp32, the reference's formula
        if job == DRAW + 10:  # FIND: thread tid owns a contiguous piece of the slice, so the scan is vocab order
            lo = st_i[LO]
            q = minps[row]
            piece = (end - start + block - 1) // block
            a = min(start + tid * piece, end)
            b = min(a + piece, end)
            tot = 0.0
            for i in range(a, b):
                bi = bits[row, i]
                if order_key(bi) >= lo:
                    w = math.exp((_int_as_float(bi) - m) / T)
                    if w >= q:
                        tot += w
            red_f[0, tid] = tot  # inclusive Hillis-Steele scan of the pieces
            cuda.syncthreads()
            off = 1
            while off < block:
                v = 0.0
                if tid >= off:
                    v = red_f[0, tid - off]
                cuda.syncthreads()
                red_f[0, tid] += v
                cuda.syncthreads()
                off *= 2
            incl = red_f[0, tid]
            excl = 0.0
            if tid > 0:
                excl = red_f[0, tid - 1]
            target = st_f[U]
            # the piece holding the target: the lowest claimant, else (rounding) the last piece with mass
            claim = block
            if tot > 0.0 and excl <= target and target < incl:
                claim = tid
            red_lo[0, tid] = claim
            red_hi[0, tid] = tid if tot > 0.0 else -1
            cuda.syncthreads()
            width = block // 2
            while width > 0:
                if tid < width:
                    red_lo[0, tid] = min(red_lo[0, tid], red_lo[0, tid + width])
                    red_hi[0, tid] = max(red_hi[0, tid], red_hi[0, tid + width])
                cuda.syncthreads()
                width //= 2
            winner = red_lo[0, 0] if red_lo[0, 0] < block else red_hi[0, 0]
            if tid == winner:
                acc = excl
                ans = -1
                for i in range(a, b):
                    bi = bits[row, i]
                    if order_key(bi) >= lo:
                        w = math.exp((_int_as_float(bi) - m) / T)
                        if w >= q and w > 0.0:
                            ans = i
                            acc += w
                            if acc > target:
                                break
                out[row] = ans
            return

        # ARGMAX, KSEARCH, PSEARCH, DRAW: per-thread buckets over the slice (strided: coalesced loads), each thread
        # in its own column of red_* (the merge's readers are past the barrier above)
        for j in range(nb):
            red_f[j, tid] = 0.0
            red_lo[j, tid] = KEY_EMPTY_LO
            red_hi[j, tid] = KEY_EMPTY_HI
        lo = st_i[LO]
        hi = st_i[HI]
        width_f = float64(hi - lo + 1)  # keys in the bracket: up to 2**32, exact in fp64
        q = minps[row]
        # UNROLL independent loads per thread before any is used: a streaming pass needs several loads in flight
        # per thread (128-thread blocks, ~6 per SM) to get near the memory bandwidth
        for base in range(start + tid, end, UNROLL * block):
            i1 = base + block
            i2 = base + 2 * block
            i3 = base + 3 * block
            b0 = bits[row, base]
            b1 = bits[row, i1] if i1 < end else 0
            b2 = bits[row, i2] if i2 < end else 0
            b3 = bits[row, i3] if i3 < end else 0
            visit(job, b0, base, lo, hi, width_f, m, T, q, red_f, red_lo, red_hi, tid)
            if i1 < end:
                visit(job, b1, i1, lo, hi, width_f, m, T, q, red_f, red_lo, red_hi, tid)
            if i2 < end:
                visit(job, b2, i2, lo, hi, width_f, m, T, q, red_f, red_lo, red_hi, tid)
            if i3 < end:
                visit(job, b3, i3, lo, hi, width_f, m, T, q, red_f, red_lo, red_hi, tid)
        if job == ARGMAX:
            red_hi[0, tid] = red_hi[1, tid]

        # block reduction of the nb buckets in a fixed tree order, then one partial per (row, s, bucket)
        cuda.syncthreads()  # block-uniform path: every thread gets here
        shift = log2_block - 1
        while shift >= 0:
            half = 1 << shift
            for idx in range(tid, nb * half, block):
                j = idx >> shift
                t = idx & (half - 1)
                combine(red_f, red_lo, red_hi, j, t, t + half, job == ARGMAX)
            cuda.syncthreads()
            shift -= 1
        if tid < nb:
            part_f[wr, row, s, tid] = red_f[tid, 0]
            part_lo[wr, row, s, tid] = red_lo[tid, 0]
            part_hi[wr, row, s, tid] = red_hi[tid, 0]
        if first and s == 0 and tid == 0:
            state_i[wr, row, PHASE] = ARGMAX

    return kernel


# ---------------------------------------------------------------------------------------------------------------
# 3. Launch configuration
# ---------------------------------------------------------------------------------------------------------------
BLOCK, NB = 128, 16  # 128 threads: the bucket scratch (16 x 128 x 16 B = 32 KB) fits static shared memory
MAX_SPLITS = 64
MIN_SLICE = 256  # vocab entries per block at least: below that, more blocks only add merge work
MIN_GRID = 128  # numba-cuda warns below this many blocks (NumbaPerformanceWarning "Grid size N ...")
# Blocks a launch aims to put on each SM: 7 fit (32 KB of shared memory each, 228 KB an SM on H100/H200), 6 leave
# room. The H200's per-launch times (bench/results/decoder-nvidia-h200-20261127.json: 14 us at 500 entries a block,
# 31 us at 6,400, 332 us at 64,128, in one wave each) grow with the entries a block walks, not with the bytes: a
# block's threads walk their slice serially, so the widest grid that is still one wave is the fastest.
BLOCKS_PER_SM = 6


def pick_splits(B: int, V: int, n_sm: int) -> int:
    """Blocks per row: enough for BLOCKS_PER_SM blocks per SM and >= MIN_GRID blocks, as far as slices of >= MIN_SLICE
    entries allow, at most MAX_SPLITS. 1 x 32,000 -> 64 splits, 64 x 32,000 -> 13, 256 x 128,256 -> 4 (132 SMs)."""
    want = max(-(-BLOCKS_PER_SM * n_sm // B), -(-MIN_GRID // B))
    cap = max(1, min(MAX_SPLITS, V // MIN_SLICE))
    return max(1, min(want, cap))


def max_rounds(nb: int) -> int:
    """Search rounds that bound any threshold search over 32-bit keys: each round keeps <= ceil(width / nb) keys."""
    return math.ceil(32 / math.log2(nb)) + 1


class SamplingPlan:
    """The launch sequence of one sampling call: grid (S, B), `block` threads, `nb` buckets; launches =
    argmax (1) + merge/enter (1) + top-k rounds (if any row has top-k) + top-p rounds (if any row has top-p < 1)
    + draw (1); greedy-only batches need 2."""

    def __init__(self, B: int, V: int, *, splits: int | None = None, n_sm: int = 132, block: int = BLOCK,
                 nb: int = NB):
        self.B, self.V, self.block, self.nb = B, V, block, nb
        self.S = splits or pick_splits(B, V, n_sm)
        if not 1 <= self.S <= min(block, V):
            raise ValueError(f"splits must be in [1, min(block={block}, V={V})], got {self.S}")

    def workspace_shapes(self) -> list[tuple[tuple[int, ...], str]]:
        """(shape, dtype name) of state_i, state_f, part_f, part_lo, part_hi: two copies each (see build_kernel)."""
        B, S, nb = self.B, self.S, self.nb
        return [((2, B, 6), "int64"), ((2, B, 4), "float64"), ((2, B, S, nb), "float64"), ((2, B, S, nb), "int32"),
                ((2, B, S, nb), "int32")]

    def n_launches(self, greedy_only: bool, needs_top_k: bool, needs_top_p: bool) -> int:
        if greedy_only:
            return 2
        return 3 + max_rounds(self.nb) * (int(needs_top_k) + int(needs_top_p))

    def configured(self, stream=0):
        """The configured kernel `kernel[grid, block, stream]`, made once: Numba's low-occupancy check runs when a
        launch is configured, so it runs once per plan. A grid under MIN_GRID blocks here is as large as the problem
        allows (pick_splits), so that warning says nothing actionable and is silenced for this configuration only."""
        from numba.cuda.core.errors import NumbaPerformanceWarning  # numba-cuda's own class, not numba.core's

        with warnings.catch_warnings():
            # ".*": numba may wrap the message in terminal highlighting (an ANSI escape before "Grid"), and the filter
            # matches from the message's start.
            warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-utilization",
                                    category=NumbaPerformanceWarning)
            return build_kernel(self.block, self.nb)[(self.S, self.B), self.block, stream]
