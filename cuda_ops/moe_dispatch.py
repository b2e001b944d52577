"""Mixture-of-experts dispatch: token rows into expert order and back, for grouped GEMMs over the experts.

    from cuda_ops.moe_dispatch import plan_routes, scatter_rows, combine_rows
    plan = plan_routes(expert_ids, num_experts, align=8)      # (N, k) int64 -> RoutePlan (slots, group offsets)
    buf = scatter_rows(x, plan)                               # (N, D) -> (plan.rows, D), grouped by expert, padded
    y = torch._grouped_mm(buf, w, offs=plan.offsets)          # each expert's rows times its weight (the model's)
    out = combine_rows(y, plan, weights)                      # (N, D) fp32: sum over k of weight x its expert's row

The four steps of a dispatch: count the assignments per expert, prefix-sum the counts into group offsets, scatter
each token's row to its slot in expert order, and gather the rows back into their tokens with the router's weights
(the weighted combine). Assignment j = n k + i is token n's i-th choice (token-major). Its slot is its expert's
group start plus its rank among that expert's assignments in token order, so the layout is deterministic: the same
routes give the same buffer on every backend, and the tests compare the kernel's output with the reference's bit
for bit. Each expert's group is padded to a multiple of `align` rows (grouped GEMMs want 16-byte aligned groups:
8 rows of bf16) and the last group runs to the end of the buffer, whose size is fixed by N, k, E and `align` alone
(N k + E (align - 1)): no shape depends on the routes, so nothing reads the device from the host (a CUDA graph can
capture it). Padding rows are zero and no slot points at them, so they add nothing forward or backward.

Capacity (`capacity` C > 0): every group is C rows (C a multiple of `align`); an assignment ranked C or later in
its expert is dropped (slot -1: it contributes nothing, its token keeps only the residual and its other experts).
`RoutePlan.dropped` counts them on the device.

Backends as in cuda_ops/dispatch.py: the Numba kernels for CUDA tensors with numba-cuda, the pure-torch reference
otherwise (LONGTRAIN_KERNELS forces one). Layout of this file: (a) reference (b) Numba kernels (c) launch
configuration (d) autograd Functions and the public API.

Index names: N tokens, k choices per token, M = N k assignments (j), E experts (e), D row width (d), R buffer rows,
C capacity per expert, NCH chunks of CHUNK assignments (c) for the counting passes.
"""
from __future__ import annotations

import functools
import math
import os
import time
from typing import NamedTuple

import torch

from cuda_ops.dispatch import as_numba, check_same_device, resolve_backend, torch_stream


class RoutePlan(NamedTuple):
    """Where each assignment goes. slot (M,) int64: its row in the buffer, -1 when dropped; offsets (E,) int32: the
    end of each expert's group (grouped-GEMM offsets; the last one is `rows`); counts (E,) int64: assignments kept
    per expert; dropped () int64; rows: the buffer's rows (a host int fixed by N, k, E, align and capacity); k."""
    slot: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor
    dropped: torch.Tensor
    rows: int
    k: int


def buffer_rows(n_tokens: int, k: int, num_experts: int, align: int = 1, capacity: int = 0) -> int:
    """Rows of the expert-ordered buffer: E C with a capacity, else enough for any routes once each group is
    padded to `align` rows (N k + E (align - 1)), and at least one row per expert's group."""
    if capacity > 0:
        return num_experts * capacity
    return n_tokens * k + num_experts * (align - 1)


def _check_plan_args(expert_ids: torch.Tensor, num_experts: int, align: int, capacity: int) -> None:
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be (N, k) expert indices, got shape {tuple(expert_ids.shape)}")
    if num_experts < 1 or align < 1 or capacity < 0:
        raise ValueError(f"num_experts={num_experts} and align={align} must be >= 1 and capacity={capacity} >= 0")
    if capacity and capacity % align:
        raise ValueError(f"capacity={capacity} must be a multiple of align={align} (every group is capacity rows)")


# ---------------------------------------------------------------------------------------------------------------
# (a) reference: pure torch (the CPU path), no host sync
# ---------------------------------------------------------------------------------------------------------------

def plan_reference(expert_ids: torch.Tensor, num_experts: int, align: int = 1, capacity: int = 0) -> RoutePlan:
    """RoutePlan of (N, k) expert ids by sorting: a stable argsort gives each assignment's rank in its expert."""
    N, k = expert_ids.shape
    E, device = num_experts, expert_ids.device
    flat = expert_ids.reshape(-1).long()  # (M,)
    M = flat.numel()
    counts = torch.zeros(E, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.sort(flat, stable=True).indices  # assignments in expert order, token order within an expert
    first = torch.cumsum(counts, 0) - counts  # (E,) position of each expert's first assignment in `order`
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(M, device=device) - first[flat[order]]
    rows = buffer_rows(N, k, E, align, capacity)
    if capacity > 0:
        keep = rank < capacity
        slot = torch.where(keep, flat * capacity + rank, torch.full_like(flat, -1))
        kept = counts.clamp(max=capacity)
        offsets = torch.arange(1, E + 1, device=device) * capacity
        dropped = (~keep).sum()
    else:
        padded = (counts + align - 1) // align * align
        start = torch.cumsum(padded, 0) - padded
        slot = start[flat] + rank
        kept, offsets, dropped = counts, torch.cumsum(padded, 0), torch.zeros((), dtype=torch.int64, device=device)
        offsets[-1] = rows
    return RoutePlan(slot, offsets.to(torch.int32), kept, dropped, rows, k)


def _slot_or_sink(plan: RoutePlan) -> torch.Tensor:
    """Slots with every dropped assignment sent to one extra row past the buffer (the sink, discarded)."""
    return torch.where(plan.slot >= 0, plan.slot, torch.full_like(plan.slot, plan.rows))


def scatter_reference(x: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """(N, D) -> (rows, D) in x's dtype: token n's row at the slot of each of its k assignments, zeros elsewhere.
    A gather: each buffer row reads its token's row, or a zero row past the tokens (padding, the sink), so autograd
    keeps only the (rows,) index for backward (an index_add of the rows' gradients into their tokens)."""
    N, D = x.shape
    M = plan.slot.numel()
    token = torch.full((plan.rows + 1,), N, dtype=torch.int64, device=x.device)  # N: the zero row
    token.index_copy_(0, _slot_or_sink(plan), torch.arange(M, device=x.device) // plan.k)
    return torch.cat([x, x.new_zeros(1, D)]).index_select(0, token[: plan.rows])


def combine_reference(y: torch.Tensor, plan: RoutePlan, weights: torch.Tensor) -> torch.Tensor:
    """(rows, D) expert outputs, (N, k) weights -> (N, D): sum over i of weights[n, i] y[slot(n, i)], in fp32 (fp64 for
    fp64 y); a dropped assignment adds nothing. Differentiable in y and weights by autograd."""
    N, k = weights.shape
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    y_sink = torch.cat([y, y.new_zeros(1, y.shape[1])])  # the sink row: zeros for dropped assignments
    picked = y_sink.index_select(0, _slot_or_sink(plan)).to(acc)  # (M, D)
    return (picked * weights.reshape(-1, 1).to(acc)).view(N, k, -1).sum(1)


# ---------------------------------------------------------------------------------------------------------------
# (b) Numba kernels
# ---------------------------------------------------------------------------------------------------------------
# Numba names the kernels use, bound by _kernels on first use (numba is imported lazily). Module globals: the CUDA
# simulator runs a kernel as Python and swaps only the module-global `cuda` for its fake module.
cuda = float32 = int32 = int64 = None

IO_KINDS = ("f32", "bf16")  # f32: float32 rows; bf16: rows seen as int16 (the bf16 bits), converted in registers


def _bf16_codec(simulated: bool):
    """(load, store) between a bf16 element held as an int16 and an fp32 value. load: the bits shifted into the
    high half of a float32; store: round to nearest even, as torch's .to(torch.bfloat16). Reinterpreting bits is
    the one step the simulator cannot run as the device does (libdevice is device-only): numpy views there."""
    if simulated:
        import numpy as np

        def load(bits):
            return np.array((int(bits) & 0xFFFF) << 16, dtype=np.int64).astype(np.uint32).view(np.float32)[()]

        def store(x):
            u = int(np.array(x, dtype=np.float32).view(np.uint32)[()])
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
            return r - 0x10000 if r >= 0x8000 else r

        return load, store
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def load(bits):
        return libdevice.int_as_float(int32((int64(bits) & 0xFFFF) << 16))

    @cuda.jit(device=True)
    def store(x):
        u = int64(libdevice.float_as_int(x)) & 0xFFFFFFFF
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        return r - 0x10000 if r >= 0x8000 else r

    return load, store


@functools.lru_cache(maxsize=None)
def _kernels(io: str, chunk: int) -> dict:
    """Build (lazily) the kernels for one storage kind of the rows (IO_KINDS) and one counting chunk length.

    Plan (ids (M,) int64 expert of each assignment): count_chunks -> chunk_counts (NCH, E) int32 by atomics;
    scan_chunks: one thread per expert walks the chunks, base (NCH, E) the assignments before each chunk, counts (E,);
    group_offsets (one thread): padded group starts and ends, capacity or not; assign_slots: one block per chunk,
    each thread counts the earlier assignments of its expert in the chunk (deterministic, no atomics), so slot =
    start + base + that rank. Rows (one block per row, threads striding over D): copy_rows (the scatter: bits copied,
    any kind), scale_rows (combine's backward into y's gradient: g[n] w[j] stored in the rows' kind), gather_sum (the
    combine, and the scatter's backward: fp32 sum over a token's k slots, weighted or not), row_dots (combine's
    weight gradient: <g[n], y[slot j]> reduced over the block)."""
    global cuda, float32, int32, int64
    from numba import cuda, float32, int32, int64

    simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    if io == "bf16":
        load, store = _bf16_codec(simulated)
    else:
        def load(v):
            return v

        def store(v):
            return v

        if not simulated:
            load, store = cuda.jit(device=True)(load), cuda.jit(device=True)(store)

    @cuda.jit
    def count_chunks(ids, chunk_counts, chunk_len):
        j = cuda.grid(1)
        if j < ids.shape[0]:
            cuda.atomic.add(chunk_counts, (j // chunk_len, ids[j]), 1)

    @cuda.jit
    def scan_chunks(chunk_counts, base, counts):
        e = cuda.grid(1)
        if e < counts.shape[0]:
            run = 0
            for c in range(chunk_counts.shape[0]):
                base[c, e] = run
                run += chunk_counts[c, e]
            counts[e] = run

    @cuda.jit
    def group_offsets(counts, align, capacity, rows, starts, offsets, kept):
        if cuda.grid(1) == 0:
            E = counts.shape[0]
            run = 0
            for e in range(E):
                starts[e] = run
                n = counts[e]
                if capacity > 0:
                    kept[e] = min(n, capacity)
                    run += capacity
                else:
                    kept[e] = n
                    run += (n + align - 1) // align * align
                offsets[e] = run
            offsets[E - 1] = rows

    @cuda.jit
    def assign_slots(ids, base, starts, capacity, slot, dropped):
        seen = cuda.shared.array(chunk, int64)
        c, t = cuda.blockIdx.x, cuda.threadIdx.x
        j = c * chunk + t
        M = ids.shape[0]
        e = ids[j] if j < M else -1
        seen[t] = e
        cuda.syncthreads()
        if j < M:
            r = 0
            for i in range(t):
                if seen[i] == e:
                    r += 1
            r += base[c, e]
            if capacity > 0 and r >= capacity:
                slot[j] = -1
                cuda.atomic.add(dropped, 0, 1)
            else:
                slot[j] = starts[e] + r

    @cuda.jit
    def copy_rows(src, slot, k, dst):
        j = cuda.blockIdx.x
        s = slot[j]
        if s >= 0:
            n = j // k
            for d in range(cuda.threadIdx.x, src.shape[1], cuda.blockDim.x):
                dst[s, d] = src[n, d]

    @cuda.jit
    def scale_rows(g, slot, k, w, dst):
        j = cuda.blockIdx.x
        s = slot[j]
        if s >= 0:
            n = j // k
            wj = w[j]
            for d in range(cuda.threadIdx.x, g.shape[1], cuda.blockDim.x):
                dst[s, d] = store(float32(g[n, d] * wj))

    @cuda.jit
    def gather_sum(src, slot, k, w, weighted, out):
        n = cuda.blockIdx.x
        for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
            acc = float32(0.0)
            for i in range(k):
                s = slot[n * k + i]
                if s >= 0:
                    v = float32(load(src[s, d]))
                    acc += v * w[n * k + i] if weighted else v
            out[n, d] = acc

    @cuda.jit
    def row_dots(g, src, slot, k, out):
        part = cuda.shared.array(DATA_BLOCK, float32)
        j, t = cuda.blockIdx.x, cuda.threadIdx.x
        s = slot[j]
        n = j // k
        acc = float32(0.0)
        if s >= 0:
            for d in range(t, g.shape[1], cuda.blockDim.x):
                acc += g[n, d] * float32(load(src[s, d]))
        part[t] = acc
        cuda.syncthreads()
        step = DATA_BLOCK // 2
        while step > 0:
            if t < step:
                part[t] += part[t + step]
            cuda.syncthreads()
            step //= 2
        if t == 0:
            out[j] = part[0]

    return {"count_chunks": count_chunks, "scan_chunks": scan_chunks, "group_offsets": group_offsets,
            "assign_slots": assign_slots, "copy_rows": copy_rows, "scale_rows": scale_rows,
            "gather_sum": gather_sum, "row_dots": row_dots}


# ---------------------------------------------------------------------------------------------------------------
# (c) launch configuration
# ---------------------------------------------------------------------------------------------------------------

CHUNK = 256  # assignments per counting block: a thread's rank scans at most this many ids in shared memory
DATA_BLOCK = 128  # threads per row kernel (a power of two: row_dots reduces in halves), striding over D
COUNT_BLOCK = 128  # threads per block of the per-assignment and per-expert counting kernels


def _arrays(*tensors):
    """Numba views of torch tensors: device arrays on CUDA, numpy views (shared memory) under the simulator."""
    if tensors[0].is_cuda:
        return [as_numba(t) for t in tensors]
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise ValueError("the MoE dispatch kernels need CUDA tensors (or NUMBA_ENABLE_CUDASIM=1 for tests)")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return [FakeCUDAArray(t.detach().numpy()) for t in tensors]


def _stream(t: torch.Tensor):
    return torch_stream() if t.is_cuda else 0


def _io(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "f32"


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """What the row kernels index: fp32 rows as they are, bf16 rows as int16 bits."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _kernel_dtype(x: torch.Tensor) -> torch.Tensor:
    """Rows in a kind the kernels take (bf16 or fp32, row-contiguous); other dtypes are converted to fp32."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    return x.contiguous()


def plan_kernel(expert_ids: torch.Tensor, num_experts: int, align: int = 1, capacity: int = 0,
                chunk: int = CHUNK) -> RoutePlan:
    """RoutePlan by the counting kernels (same slots as plan_reference)."""
    N, k = expert_ids.shape
    E, device = num_experts, expert_ids.device
    ids = expert_ids.reshape(-1).to(torch.int64).contiguous()
    M = ids.numel()
    rows = buffer_rows(N, k, E, align, capacity)
    n_chunks = max(1, math.ceil(M / chunk))
    chunk_counts = torch.zeros(n_chunks, E, dtype=torch.int32, device=device)
    base = torch.empty(n_chunks, E, dtype=torch.int64, device=device)
    counts = torch.empty(E, dtype=torch.int64, device=device)
    starts = torch.empty(E, dtype=torch.int64, device=device)
    offsets = torch.empty(E, dtype=torch.int32, device=device)
    kept = torch.empty(E, dtype=torch.int64, device=device)
    slot = torch.empty(M, dtype=torch.int64, device=device)
    dropped = torch.zeros(1, dtype=torch.int64, device=device)
    ks, stream = _kernels("f32", chunk), _stream(ids)
    a_ids, a_cc, a_base, a_counts, a_starts, a_off, a_kept, a_slot, a_drop = _arrays(
        ids, chunk_counts, base, counts, starts, offsets, kept, slot, dropped)
    if M:
        ks["count_chunks"][math.ceil(M / COUNT_BLOCK), COUNT_BLOCK, stream](a_ids, a_cc, chunk)
    ks["scan_chunks"][math.ceil(E / COUNT_BLOCK), COUNT_BLOCK, stream](a_cc, a_base, a_counts)
    ks["group_offsets"][1, 1, stream](a_counts, align, capacity, rows, a_starts, a_off, a_kept)
    if M:
        ks["assign_slots"][n_chunks, chunk, stream](a_ids, a_base, a_starts, capacity, a_slot, a_drop)
    return RoutePlan(slot, offsets, kept, dropped[0], rows, k)


def copy_rows_kernel(x: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """The scatter on the kernels: (N, D) -> (rows, D) in x's (kernel) dtype, zeros where no slot points."""
    x = _kernel_dtype(x)
    buf = x.new_zeros(plan.rows, x.shape[1])
    M = plan.slot.numel()
    if M:
        src, slot, dst = _arrays(_rows_view(x), plan.slot, _rows_view(buf))
        _kernels(_io(x.dtype), CHUNK)["copy_rows"][M, DATA_BLOCK, _stream(x)](src, slot, plan.k, dst)
    return buf


def gather_sum_kernel(src: torch.Tensor, plan: RoutePlan, weights: torch.Tensor | None) -> torch.Tensor:
    """(rows, D) -> (N, D) fp32: sum over each token's k slots, times weights (N, k) when given."""
    src = _kernel_dtype(src)
    M, k = plan.slot.numel(), plan.k
    N = M // k
    out = torch.empty(N, src.shape[1], dtype=torch.float32, device=src.device)
    w = (weights.reshape(-1).float().contiguous() if weights is not None
         else torch.zeros(1, dtype=torch.float32, device=src.device))
    if N:
        a_src, a_slot, a_w, a_out = _arrays(_rows_view(src), plan.slot, w, out)
        _kernels(_io(src.dtype), CHUNK)["gather_sum"][N, DATA_BLOCK, _stream(src)](
            a_src, a_slot, k, a_w, weights is not None, a_out)
    return out


def scale_rows_kernel(g: torch.Tensor, plan: RoutePlan, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """combine's backward into y: (N, D) grad -> (rows, D) in `dtype` with row slot(j) = g[token(j)] weights[j]."""
    g = g.float().contiguous()
    out = torch.zeros(plan.rows, g.shape[1], dtype=dtype, device=g.device)
    M = plan.slot.numel()
    if M:
        a_g, a_slot, a_w, a_out = _arrays(g, plan.slot, weights.reshape(-1).float().contiguous(), _rows_view(out))
        _kernels(_io(dtype), CHUNK)["scale_rows"][M, DATA_BLOCK, _stream(g)](a_g, a_slot, plan.k, a_w, a_out)
    return out


def row_dots_kernel(g: torch.Tensor, y: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """combine's weight gradient: (M,) fp32 with <g[token(j)], y[slot(j)]>, 0 for a dropped assignment."""
    g, y = g.float().contiguous(), _kernel_dtype(y)
    M = plan.slot.numel()
    out = torch.zeros(M, dtype=torch.float32, device=g.device)
    if M:
        a_g, a_y, a_slot, a_out = _arrays(g, _rows_view(y), plan.slot, out)
        _kernels(_io(y.dtype), CHUNK)["row_dots"][M, DATA_BLOCK, _stream(g)](a_g, a_y, a_slot, plan.k, a_out)
    return out


def warmup() -> float:
    """Compile every kernel for both row kinds (first launch) on CUDA; returns the seconds it took."""
    start = time.perf_counter()
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]], device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        for capacity in (0, 2):
            plan = plan_routes(ids, 2, align=2, capacity=capacity, backend="numba")
            x = torch.randn(3, 8, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.rand(3, 2, device="cuda", requires_grad=True)
            combine_rows(scatter_rows(x, plan, backend="numba"), plan, w, backend="numba").sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------------
# (d) autograd Functions and the public API
# ---------------------------------------------------------------------------------------------------------------

class ScatterRowsFunction(torch.autograd.Function):
    """The kernel scatter; backward sums each token's k slot gradients (gather_sum without weights)."""

    @staticmethod
    def forward(ctx, x, plan_slot, k, rows):
        plan = RoutePlan(plan_slot, None, None, None, rows, k)
        ctx.save_for_backward(plan_slot)
        ctx.k, ctx.rows, ctx.x_dtype = k, rows, x.dtype
        return copy_rows_kernel(x, plan).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (plan_slot,) = ctx.saved_tensors
        plan = RoutePlan(plan_slot, None, None, None, ctx.rows, ctx.k)
        return gather_sum_kernel(g, plan, None).to(ctx.x_dtype), None, None, None


class CombineRowsFunction(torch.autograd.Function):
    """The kernel combine; backward: y's gradient by scale_rows (zeros on padding rows), the weights' by row_dots."""

    @staticmethod
    def forward(ctx, y, weights, plan_slot, k):
        plan = RoutePlan(plan_slot, None, None, None, y.shape[0], k)
        ctx.save_for_backward(y, weights, plan_slot)
        ctx.k = k
        return gather_sum_kernel(y, plan, weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        y, weights, plan_slot = ctx.saved_tensors
        plan = RoutePlan(plan_slot, None, None, None, y.shape[0], ctx.k)
        gy = scale_rows_kernel(g, plan, weights, _kernel_dtype(y).dtype).to(y.dtype) if ctx.needs_input_grad[0] \
            else None
        gw = row_dots_kernel(g, y, plan).view_as(weights).to(weights.dtype) if ctx.needs_input_grad[1] else None
        return gy, gw, None, None


def plan_routes(expert_ids: torch.Tensor, num_experts: int, *, align: int = 1, capacity: int = 0,
                backend: str | None = None) -> RoutePlan:
    """(N, k) int expert ids -> RoutePlan: count, prefix-sum, slots (module docstring). align: rows each expert's
    group is padded to a multiple of; capacity: 0 = dropless, else rows per expert (a multiple of align).
    backend: None / "auto" / "numba" / "reference" (cuda_ops/dispatch.py)."""
    _check_plan_args(expert_ids, num_experts, align, capacity)
    if resolve_backend(expert_ids.device, backend) == "reference":
        return plan_reference(expert_ids, num_experts, align, capacity)
    if expert_ids.is_cuda:
        check_same_device(expert_ids)
    return plan_kernel(expert_ids, num_experts, align, capacity)


def scatter_rows(x: torch.Tensor, plan: RoutePlan, *, backend: str | None = None) -> torch.Tensor:
    """(N, D) token rows -> (plan.rows, D) in x's dtype, each token's row at its k slots (zeros elsewhere).
    Differentiable in x."""
    if x.dim() != 2 or x.shape[0] * plan.k != plan.slot.numel():
        raise ValueError(f"x must be (N, D) with N k = {plan.slot.numel()} assignments, got {tuple(x.shape)}")
    return _scatter(x, plan, resolve_backend(x.device, backend))


def _scatter(x: torch.Tensor, plan: RoutePlan, backend: str) -> torch.Tensor:
    """`scatter_rows` once the backend is fixed (the simulator tests drive "numba" on host tensors)."""
    if backend == "reference":
        return scatter_reference(x, plan)
    if x.is_cuda:
        check_same_device(x)
    return ScatterRowsFunction.apply(x, plan.slot, plan.k, plan.rows)


def combine_rows(y: torch.Tensor, plan: RoutePlan, weights: torch.Tensor, *, backend: str | None = None
                 ) -> torch.Tensor:
    """(plan.rows, D) expert outputs, (N, k) routing weights -> (N, D) fp32 (fp64 for fp64 on the reference): each
    token's weighted sum of its experts' rows. Differentiable in y and weights."""
    if y.dim() != 2 or y.shape[0] != plan.rows or weights.numel() != plan.slot.numel():
        raise ValueError(f"y must be ({plan.rows}, D) and weights (N, {plan.k}) with N k = {plan.slot.numel()}, "
                         f"got {tuple(y.shape)} and {tuple(weights.shape)}")
    return _combine(y, plan, weights, resolve_backend(y.device, backend))


def _combine(y: torch.Tensor, plan: RoutePlan, weights: torch.Tensor, backend: str) -> torch.Tensor:
    """`combine_rows` once the backend is fixed."""
    if backend == "reference":
        return combine_reference(y, plan, weights)
    if y.is_cuda:
        check_same_device(y)
    return CombineRowsFunction.apply(y, weights, plan.slot, plan.k)
